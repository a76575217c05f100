"""ListJobs and CancelJob as callers see them: filters, limits, status codes, idempotence, and jobs of other
quantizers sharing the registry (rows written here straight into it)."""

from __future__ import annotations

import grpc
import pytest
from sqlalchemy.exc import OperationalError

from services.quantizer.views import Stage
from shared.registry import (
    cancel_job,
    create_job,
    fail_job,
    finish_job,
    mark_artifact_ready,
    register_model_version,
    reserve_artifact,
    start_job,
)
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import StorageConfig
from tests.quantizer.pauses import pause_after_progress

Q = quantizer_pb2
OTHER = "quantizer@elsewhere:1:boot"  # another quantizer, alive (its rows were just written)


@pytest.fixture
def quantizer(tmp_path, start_quantizer, registry_url):
    return start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url, create_bucket=True)


@pytest.fixture
def registry(open_registry, registry_url):
    return open_registry(registry_url)


def _jobs(registry, *models: str, start: bool = False) -> list[str]:
    with registry.transaction() as session:
        ids = [create_job(session, owner=OTHER, model_name=model).id for model in models]
        for job_id in ids if start else ():
            start_job(session, job_id, owner=OTHER)
    return ids


def _error(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call(request)
    return raised.value


def _listed(quantizer, **fields) -> list[str]:
    return [job.job_id for job in quantizer.stub.ListJobs(Q.ListJobsRequest(**fields)).jobs]


def test_list_jobs_newest_first_by_state_and_model(quantizer, registry):
    llama = _jobs(registry, "llama", "llama", "llama")
    mistral = _jobs(registry, "mistral", start=True)
    with registry.transaction() as session:
        cancel_job(session, llama[0], actor="alice")

    assert _listed(quantizer) == [*mistral, *reversed(llama)]
    assert _listed(quantizer, model_name="llama") == list(reversed(llama))
    assert _listed(quantizer, states=[Q.JOB_STATE_QUEUED]) == [llama[2], llama[1]]
    assert _listed(quantizer, states=[Q.JOB_STATE_RUNNING, Q.JOB_STATE_CANCELLED]) == [*mistral, llama[0]]
    assert _listed(quantizer, model_name="llama", states=[Q.JOB_STATE_CANCELLED]) == [llama[0]]
    assert _listed(quantizer, limit=2) == [*mistral, llama[2]]
    assert _listed(quantizer, model_name="unknown") == []
    [job] = quantizer.stub.ListJobs(Q.ListJobsRequest(model_name="mistral")).jobs
    assert (job.state, job.model_name, job.HasField("request")) == (Q.JOB_STATE_RUNNING, "mistral", False)


def test_list_jobs_shows_the_request_of_this_quantizers_own_jobs(quantizer, small_model, request_for, monkeypatch):
    pause = pause_after_progress(monkeypatch, Stage.LOAD)
    job_id = quantizer.stub.Publish(request_for(small_model, model_name="mine")).job_id
    pause.wait_reached()
    try:
        [job] = quantizer.stub.ListJobs(Q.ListJobsRequest(states=[Q.JOB_STATE_RUNNING])).jobs
        assert (job.job_id, job.model_name, job.request.model_name) == (job_id, "mine", "mine")
    finally:
        pause.go.set()


def test_list_jobs_limit_defaults_to_100_and_is_capped_at_1000(quantizer, registry):
    _jobs(registry, *["llama"] * 101)
    assert len(_listed(quantizer)) == 100
    assert len(_listed(quantizer, limit=1000)) == 101
    error = _error(quantizer.stub.ListJobs, Q.ListJobsRequest(limit=1001))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "limit 1001 is above 1000" in error.details()


@pytest.mark.parametrize(("state", "says"), [(Q.JOB_STATE_UNSPECIFIED, "JOB_STATE_UNSPECIFIED"),
                                             (42, "unknown value 42")])
def test_list_jobs_refuses_a_state_that_is_no_filter(quantizer, state, says):
    error = _error(quantizer.stub.ListJobs, Q.ListJobsRequest(states=[Q.JOB_STATE_FAILED, state]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"states holds {says}, not a job state to filter by; accepted: JOB_STATE_QUEUED" in error.details()


def test_cancel_a_queued_job_of_another_quantizer_ends_it_at_once(quantizer, registry):
    [job_id] = _jobs(registry, "llama")
    cancelled = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id, requested_by="alice", reason="oops"))
    assert cancelled.state == Q.JOB_STATE_CANCELLED and cancelled.error == "cancelled by alice: oops"
    assert cancelled.HasField("cancel_requested_at")
    [update] = quantizer.follow(job_id, timeout_s=10)  # followers see the end at once
    assert update.job.state == Q.JOB_STATE_CANCELLED


def test_cancel_a_running_job_asks_it_to_stop_and_asking_again_returns_it(quantizer, registry):
    [job_id] = _jobs(registry, "llama", start=True)
    asked = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id, requested_by="alice", reason="wrong model"))
    assert asked.state == Q.JOB_STATE_RUNNING and asked.HasField("cancel_requested_at")
    assert asked.error == "cancelled by alice: wrong model"
    again = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id, requested_by="bob"))
    assert (again.state, again.error, again.cancel_requested_at) == (asked.state, asked.error, asked.cancel_requested_at)
    assert quantizer.stub.GetJob(Q.GetJobRequest(job_id=job_id)).error == "cancelled by alice: wrong model"


def test_cancel_without_requested_by_records_the_callers_address(quantizer, registry):
    [job_id] = _jobs(registry, "llama")
    cancelled = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id))
    assert cancelled.error.startswith(("cancelled by ipv4:127.0.0.1:", "cancelled by ipv6:")), cancelled.error


@pytest.mark.parametrize("end", ["SUCCEEDED", "FAILED", "CANCELLED"])
def test_cancel_an_ended_job_is_a_failed_precondition_naming_its_state(quantizer, registry, end):
    with registry.transaction() as session:
        version = register_model_version(session, "llama", "a" * 64)
        artifact = reserve_artifact(session, version, "w4a8kv4-g128", "cpu").artifact
        job = create_job(session, owner=OTHER, artifact_id=artifact.id, model_name="llama")
        start_job(session, job.id, owner=OTHER)
        if end == "SUCCEEDED":
            mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest="d")
            finish_job(session, job.id)
        elif end == "FAILED":
            fail_job(session, job.id, "tokenizer missing")
        else:
            cancel_job(session, job.id, actor="alice")
            fail_job(session, job.id, "stopped")
    error = _error(quantizer.stub.CancelJob, Q.CancelJobRequest(job_id=job.id, requested_by="bob"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"job {job.id} has already ended: it is {end}" in error.details()


@pytest.mark.parametrize(
    ("fields", "code", "says"),
    [
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "job_id is required"),
        ({"job_id": "nope"}, grpc.StatusCode.NOT_FOUND, "quantization job 'nope' does not exist"),
        ({"job_id": "nope", "reason": "x" * 1001}, grpc.StatusCode.INVALID_ARGUMENT,
         "reason has 1001 characters; at most 1000"),
        ({"job_id": "nope", "requested_by": "x" * 129}, grpc.StatusCode.INVALID_ARGUMENT,
         "requested_by has 129 characters; at most 128"),
    ],
)
def test_cancel_refuses_bad_requests_naming_the_field(quantizer, fields, code, says):
    error = _error(quantizer.stub.CancelJob, Q.CancelJobRequest(**fields))
    assert error.code() == code and says in error.details()


def test_a_queued_job_of_this_quantizer_gives_its_place_back(tmp_path, start_quantizer, registry_url, registry,
                                                             small_model, request_for, monkeypatch):
    """One worker, one queue slot: a cancelled queued job frees its slot at once; one cancelled through
    another quantizer (straight in the registry) ends for this quantizer's followers at its next heartbeat."""
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True, workers=1, max_queued=1, heartbeat_s=0.5)
    pause = pause_after_progress(monkeypatch, Stage.LOAD)
    running = quantizer.stub.Publish(request_for(small_model)).job_id
    pause.wait_reached()
    queued = quantizer.stub.Publish(request_for(small_model)).job_id
    full = _error(quantizer.stub.Publish, request_for(small_model))
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    # The job's end goes on the board from the cancel's own view: a registry read failing just after the cancel
    # committed answered UNAVAILABLE and left the board's 'queued' for good (WatchJob never ended).
    runner = quantizer.server.running.runner
    view = runner.view

    def registry_lost(job_id):
        raise OperationalError("SELECT quant_jobs", {}, ConnectionResetError("registry connection lost"))

    monkeypatch.setattr(runner, "view", registry_lost)
    assert quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=queued)).state == Q.JOB_STATE_CANCELLED
    monkeypatch.setattr(runner, "view", view)
    assert [u.job.state for u in quantizer.follow(queued, timeout_s=10)] == [Q.JOB_STATE_CANCELLED]
    queued_again = quantizer.stub.Publish(request_for(small_model)).job_id  # the slot is free
    with registry.transaction() as session:
        cancel_job(session, queued_again, actor="bob")
    assert quantizer.follow(queued_again, timeout_s=10)[-1].job.state == Q.JOB_STATE_CANCELLED

    quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=running))
    pause.go.set()
    assert quantizer.follow(running, timeout_s=60)[-1].job.state == Q.JOB_STATE_CANCELLED

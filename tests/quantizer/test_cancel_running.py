"""CancelJob of a job that runs a real pipeline (a tiny random Llama): it stops at its next step, leaves no
work folder and no object behind, its artifact ends FAILED and the job CANCELLED, and followers see that end.
Also when the cancel reaches another quantizer sharing the registry, and when it races the final binding."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from services.quantizer.errors import JobCancelled
from services.quantizer.pipeline import Pipeline
from services.quantizer.views import Stage
from shared.registry import ArtifactState, EventKind, cancel_job, get_artifact, list_events
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2
from shared.storage import StorageConfig, open_store
from tests.quantizer.pauses import pause_after_progress

Q = quantizer_pb2


def _cancel(quantizer, job_id: str, who: str = "alice", why: str = "wrong checkpoint") -> Q.Job:
    return quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id, requested_by=who, reason=why))


def _follow_in_background(quantizer, job_id: str) -> tuple[threading.Thread, list[Q.JobProgress]]:
    updates: list[Q.JobProgress] = []
    thread = threading.Thread(target=lambda: updates.extend(quantizer.follow(job_id, timeout_s=120)), daemon=True)
    thread.start()
    return thread, updates


def _removed_soon(folder, timeout_s: float = 5.0) -> bool:
    """The job's thread removes its folder just after it marks the job ended (which ends the watchers' streams)."""
    deadline = time.monotonic() + timeout_s
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not folder.exists()


@pytest.fixture
def local_store(tmp_path) -> StorageConfig:
    return StorageConfig(kind="local", root=tmp_path / "objects")


def _record_quantized_blocks(monkeypatch) -> list[tuple[str, int, int]]:
    """The quantizer's own (stage, done, total) callbacks: what work it actually did."""
    from services.quantizer import pipeline

    calls: list[tuple[str, int, int]] = []
    real = pipeline.quantize_checkpoint

    def recording(settings, progress):
        def record(stage, done, total):
            calls.append((stage, done, total))
            progress(stage, done, total)
        return real(settings, record)

    monkeypatch.setattr(pipeline, "quantize_checkpoint", recording)
    return calls


def test_a_cancelled_job_stops_at_the_next_block_and_leaves_nothing_behind(
        local_store, start_quantizer, registry_url, open_registry, small_model, request_for, monkeypatch):
    pause = pause_after_progress(monkeypatch, Stage.QUANTIZE, 2)
    quantizer_calls = _record_quantized_blocks(monkeypatch)
    quantizer = start_quantizer(local_store, registry_url, create_bucket=True)
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    assert pause.wait_reached() == job_id  # block 1 of 2 done
    work_dir = quantizer.config.work_dir / "jobs" / job_id
    assert work_dir.is_dir()
    follower, updates = _follow_in_background(quantizer, job_id)

    asked = _cancel(quantizer, job_id)
    assert asked.state == Q.JOB_STATE_RUNNING and asked.HasField("cancel_requested_at")
    assert asked.error == "cancelled by alice: wrong checkpoint" and asked.model_name == "rand"
    again = _cancel(quantizer, job_id, who="bob", why="me too")  # idempotent: the first request stands
    assert (again.state, again.error, again.cancel_requested_at) == (asked.state, asked.error, asked.cancel_requested_at)
    pause.go.set()
    follower.join(120)

    final = updates[-1].job
    assert final.state == Q.JOB_STATE_CANCELLED and final.error == "cancelled by alice: wrong checkpoint"
    assert (final.stage, final.block_index, final.block_count) == (Q.JOB_STAGE_QUANTIZE, 2, 2)  # stopped right there
    assert ("quantize", 1, 2) in quantizer_calls and ("quantize", 2, 2) not in quantizer_calls  # block 2 never ran
    assert final.artifact.state == common_pb2.ARTIFACT_STATE_FAILED
    assert final.artifact.failure_reason == "cancelled by alice: wrong checkpoint"
    assert quantizer.stub.GetJob(Q.GetJobRequest(job_id=job_id)).state == Q.JOB_STATE_CANCELLED
    assert _removed_soon(work_dir)
    assert open_store(local_store).list("") == []
    with open_registry(registry_url).sessions() as session:
        kinds = [e.kind for e in list_events(session, job_id=job_id)]
        assert kinds[-2:] == [EventKind.JOB_CANCEL_REQUESTED, EventKind.JOB_CANCELLED]

    # The binding was let go: publishing it again builds it.
    retried, _ = quantizer.publish(request_for(small_model))
    assert retried.state == Q.JOB_STATE_SUCCEEDED and retried.artifact.artifact_id == final.artifact.artifact_id


def test_a_cancel_mid_upload_leaves_no_staged_object(moto, bucket_store, start_quantizer, registry_url, small_model,
                                                     request_for, monkeypatch):
    from shared.storage.s3 import S3Store

    quantizer = start_quantizer(bucket_store, registry_url)
    real_put = S3Store.put_file
    puts: list[str] = []
    job_ids: list[str] = []

    def cancel_after_the_second_put(self, local_path, key):
        info = real_put(self, local_path, key)
        puts.append(key)
        if len(puts) == 2:
            _cancel(quantizer, job_ids[0])
        return info

    monkeypatch.setattr(S3Store, "put_file", cancel_after_the_second_put)
    job_ids.append(quantizer.stub.Publish(request_for(small_model)).job_id)
    final = quantizer.follow(job_ids[0])[-1].job

    assert final.state == Q.JOB_STATE_CANCELLED and final.error == "cancelled by alice: wrong checkpoint"
    assert final.stage == Q.JOB_STAGE_UPLOAD and len(puts) == 2
    assert final.artifact.state == common_pb2.ARTIFACT_STATE_FAILED
    assert moto.keys(bucket_store.bucket) == []  # the staged objects went too


def test_a_cancel_sent_to_another_quantizer_is_noticed_within_a_heartbeat(
        local_store, start_quantizer, any_registry_url, small_model, request_for, monkeypatch):
    heartbeat_s = 1.0
    noticed_after: list[float] = []

    def wait_for_the_heartbeat_to_notice(runner, job_id):  # no progress report reads the row meanwhile
        started = time.monotonic()
        while time.monotonic() - started < 30:
            try:
                runner.cancels.check(job_id)
            except JobCancelled:
                noticed_after.append(time.monotonic() - started)
                return
            time.sleep(0.02)

    pause = pause_after_progress(monkeypatch, Stage.QUANTIZE, 2, then=wait_for_the_heartbeat_to_notice)
    running = start_quantizer(local_store, any_registry_url, create_bucket=True, heartbeat_s=heartbeat_s)
    other = start_quantizer(local_store, any_registry_url, heartbeat_s=heartbeat_s)
    job_id = running.stub.Publish(request_for(small_model)).job_id
    pause.wait_reached()
    followers = [_follow_in_background(q, job_id) for q in (running, other)]

    asked = _cancel(other, job_id)
    pause.go.set()
    assert asked.state == Q.JOB_STATE_RUNNING and asked.HasField("cancel_requested_at")
    assert asked.model_name == "rand" and not asked.HasField("request")  # the other quantizer's job
    for thread, _ in followers:
        thread.join(120)

    assert noticed_after and noticed_after[0] < 2 * heartbeat_s + 1.0, noticed_after
    for _, updates in followers:
        final = updates[-1].job
        assert final.state == Q.JOB_STATE_CANCELLED and final.error == "cancelled by alice: wrong checkpoint"
    assert _removed_soon(running.config.work_dir / "jobs" / job_id)
    assert open_store(local_store).list("") == []


def test_a_cancel_that_lands_before_the_final_binding_keeps_it_from_committing(
        local_store, start_quantizer, any_registry_url, open_registry, small_model, request_for, monkeypatch):
    """The cancel comes from another quantizer after the job's last check: the registering transaction
    itself refuses to finish the job, so the READY artifact is rolled back and the uploaded objects deleted."""
    registry = open_registry(any_registry_url)

    def cancel_elsewhere(runner, job_id):
        with registry.transaction() as session:
            cancel_job(session, job_id, actor="bob", reason="wrong model")

    pause = pause_after_progress(monkeypatch, Stage.REGISTER, then=cancel_elsewhere)
    pause.go.set()  # no need to wait: the cancel is made on the pipeline's own thread
    quantizer = start_quantizer(local_store, any_registry_url, create_bucket=True)
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    final = quantizer.follow(job_id)[-1].job

    assert final.state == Q.JOB_STATE_CANCELLED and final.error == "cancelled by bob: wrong model"
    assert final.stage == Q.JOB_STAGE_REGISTER
    assert open_store(local_store).list("") == []
    with registry.sessions() as session:
        artifact = get_artifact(session, final.artifact.artifact_id)
        assert artifact.state == ArtifactState.FAILED and artifact.manifest_sha256 is None
        kinds = [e.kind for e in list_events(session, artifact_id=artifact.id)]
        assert EventKind.ARTIFACT_READY not in kinds, kinds  # never READY, not even for a moment


def test_a_cancel_after_the_final_binding_is_refused_as_succeeded(
        local_store, start_quantizer, registry_url, small_model, request_for, monkeypatch):
    quantizer = start_quantizer(local_store, registry_url, create_bucket=True)
    real_run = Pipeline.run
    refusals: list[grpc.RpcError] = []

    def cancel_once_published(self, finish):  # the binding has committed; the job is still winding down
        artifact_id = real_run(self, finish)
        try:
            _cancel(quantizer, self.job_id)
        except grpc.RpcError as exc:
            refusals.append(exc)
        return artifact_id

    monkeypatch.setattr(Pipeline, "run", cancel_once_published)
    final, _ = quantizer.publish(request_for(small_model))

    assert final.state == Q.JOB_STATE_SUCCEEDED and final.artifact.state == common_pb2.ARTIFACT_STATE_READY
    [refused] = refusals
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"job {final.job_id} has already ended: it is SUCCEEDED" in refused.details()
    assert open_store(local_store).list(final.artifact.object_key_prefix)  # the objects stay

"""Caller tokens (QSERVE_QUANTIZER_TOKENS): every Quantizer rpc needs a known token once tokens are configured,
a read token cannot publish or cancel, the token's name is the actor of the events Publish and CancelJob record;
without tokens every caller is accepted, as before. Health stays open for container health checks."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.quantizer.config import QuantizerToken
from shared.rpc.address import is_loopback
from shared.registry import EventKind, create_job, list_events
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import StorageConfig

Q = quantizer_pb2
PUBLISH, READ = "publish-s3cret", "read-s3cret"
OTHER = "quantizer@elsewhere:1:boot"  # another quantizer's job, written straight into the registry
TOKENS = {"ci": QuantizerToken(PUBLISH, "publish"), "dash": QuantizerToken(READ, "read")}


def _as(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture
def store(tmp_path) -> StorageConfig:
    return StorageConfig(kind="local", root=tmp_path / "objects")


@pytest.fixture
def quantizer(start_quantizer, store, registry_url):
    return start_quantizer(store, registry_url, create_bucket=True, tokens=TOKENS)


@pytest.fixture
def registry(open_registry, registry_url):
    return open_registry(registry_url)


def _queued_job(registry) -> str:
    with registry.transaction() as session:
        return create_job(session, owner=OTHER, model_name="llama").id


# Every rpc of the service, with a request that gets past the token check.
CALLS = {
    "Publish": Q.PublishRequest(),
    "CancelJob": Q.CancelJobRequest(job_id="0" * 32),
    "GetJob": Q.GetJobRequest(job_id="0" * 32),
    "WatchJob": Q.WatchJobRequest(job_id="0" * 32),
    "GetArtifact": Q.GetArtifactRequest(artifact_id="0" * 32),
    "ListArtifacts": Q.ListArtifactsRequest(),
    "ListModels": Q.ListModelsRequest(),
    "ListJobs": Q.ListJobsRequest(),
}


def _call(quantizer, rpc: str, metadata=None):
    request = CALLS[rpc]
    if rpc == "WatchJob":
        return list(quantizer.stub.WatchJob(request, metadata=metadata, timeout=30))
    return getattr(quantizer.stub, rpc)(request, metadata=metadata, timeout=30)


def _code(quantizer, rpc: str, metadata=None) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        _call(quantizer, rpc, metadata)
    return raised.value.code(), raised.value.details()


def test_every_rpc_needs_a_token(quantizer):
    assert set(CALLS) == set(Q.DESCRIPTOR.services_by_name["Quantizer"].methods_by_name)
    for rpc in CALLS:
        code, details = _code(quantizer, rpc)
        assert code == grpc.StatusCode.UNAUTHENTICATED, rpc
        assert f"Quantizer.{rpc} needs metadata `authorization: Bearer <token>`" in details
        assert "QSERVE_QUANTIZER_TOKENS" in details


@pytest.mark.parametrize("metadata", [_as("wrong"), _as(PUBLISH + "x"), (("authorization", PUBLISH),)])
def test_an_unknown_or_malformed_token_is_unauthenticated(quantizer, metadata):
    for rpc in ("Publish", "ListJobs", "WatchJob"):
        code, details = _code(quantizer, rpc, metadata)
        assert code == grpc.StatusCode.UNAUTHENTICATED, rpc
        assert PUBLISH not in details


def test_a_read_token_lists_but_cannot_publish_or_cancel(quantizer, registry):
    job_id = _queued_job(registry)
    for rpc in ("Publish", "CancelJob"):
        code, details = _code(quantizer, rpc, _as(READ))
        assert code == grpc.StatusCode.PERMISSION_DENIED, rpc
        assert "token 'dash' has scope 'read'" in details and "scope 'publish'" in details
    listed = quantizer.stub.ListJobs(Q.ListJobsRequest(), metadata=_as(READ)).jobs
    assert [job.job_id for job in listed] == [job_id]
    assert quantizer.stub.GetJob(Q.GetJobRequest(job_id=job_id), metadata=_as(READ)).state == Q.JOB_STATE_QUEUED
    assert quantizer.stub.ListModels(Q.ListModelsRequest(), metadata=_as(READ)).models == []
    stream = quantizer.stub.WatchJob(Q.WatchJobRequest(job_id=job_id), metadata=_as(READ), timeout=30)
    assert next(stream).job.job_id == job_id  # the job stays queued: its first snapshot, then stop watching
    stream.cancel()
    # Refused: nothing happened to the job.
    assert quantizer.stub.GetJob(Q.GetJobRequest(job_id=job_id), metadata=_as(PUBLISH)).state == Q.JOB_STATE_QUEUED


def test_health_and_reflection_stay_open(quantizer):
    health = health_pb2_grpc.HealthStub(quantizer.channel)
    for service in ("", "qserve.v1.Quantizer"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(quantizer.channel)
    answers = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    assert "qserve.v1.Quantizer" in {s.name for answer in answers for s in answer.list_services_response.service}


def test_the_token_name_is_the_actor_of_a_cancel(quantizer, registry):
    job_id = _queued_job(registry)
    job = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id, requested_by="alice@laptop", reason="wrong model"),
                                   metadata=_as(PUBLISH))
    assert job.state == Q.JOB_STATE_CANCELLED
    assert job.error == "cancelled by ci: for alice@laptop: wrong model"
    with registry.sessions() as session:
        events = [(e.kind, e.actor) for e in list_events(session, job_id=job_id)]
    assert (EventKind.JOB_CANCELLED, "ci") in events and "alice@laptop" not in {actor for _, actor in events}

    other = _queued_job(registry)
    plain = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=other), metadata=_as(PUBLISH))
    assert plain.error == "cancelled by ci"  # no requested_by: neither the caller's address


def test_the_token_name_is_the_actor_of_a_publish(quantizer, registry, small_model, request_for):
    job = quantizer.stub.Publish(request_for(small_model), metadata=_as(PUBLISH))
    with registry.sessions() as session:
        queued = [e for e in list_events(session, job_id=job.job_id) if e.kind == EventKind.JOB_QUEUED]
    assert [e.actor for e in queued] == ["ci"]
    final = list(quantizer.stub.WatchJob(Q.WatchJobRequest(job_id=job.job_id), metadata=_as(READ), timeout=240))[-1]
    assert final.job.state == Q.JOB_STATE_SUCCEEDED, final.job.error


def test_without_tokens_every_caller_is_accepted_as_before(start_quantizer, store, registry_url, registry):
    quantizer = start_quantizer(store, registry_url, create_bucket=True)
    job_id = _queued_job(registry)
    assert [j.job_id for j in quantizer.stub.ListJobs(Q.ListJobsRequest()).jobs] == [job_id]
    assert [j.job_id for j in quantizer.stub.ListJobs(Q.ListJobsRequest(), metadata=_as("anything")).jobs] == [job_id]
    job = quantizer.stub.CancelJob(Q.CancelJobRequest(job_id=job_id, requested_by="bob", reason="oops"))
    assert job.error == "cancelled by bob: oops"
    with registry.sessions() as session:
        assert (EventKind.JOB_CANCELLED, "bob") in [(e.kind, e.actor) for e in list_events(session, job_id=job_id)]


def test_publish_without_tokens_records_the_quantizer_as_before(start_quantizer, store, registry_url, registry,
                                                                small_model, request_for):
    quantizer = start_quantizer(store, registry_url, create_bucket=True)
    job = quantizer.stub.Publish(request_for(small_model))
    with registry.sessions() as session:
        queued = [e.actor for e in list_events(session, job_id=job.job_id) if e.kind == EventKind.JOB_QUEUED]
    assert queued == [quantizer.config.owner]
    quantizer.follow(job.job_id)


def test_a_warning_when_listening_beyond_loopback_without_tokens(start_quantizer, store, registry_url, caplog):
    with caplog.at_level(logging.WARNING, logger="services.quantizer.server"):
        start_quantizer(store, registry_url, create_bucket=True, listen="0.0.0.0:0")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "QSERVE_QUANTIZER_TOKENS" in r.getMessage()]
    assert len(warnings) == 1 and "anyone who can reach this port can publish" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="services.quantizer.server"):
        start_quantizer(store, registry_url, create_bucket=True, listen="0.0.0.0:0", tokens=TOKENS)
        start_quantizer(store, registry_url, create_bucket=True)  # loopback
    assert not [r for r in caplog.records if "QSERVE_QUANTIZER_TOKENS" in r.getMessage()]


@pytest.mark.parametrize("listen, loopback", [("127.0.0.1:50061", True), ("127.0.0.2:1", True),
                                              ("localhost:50061", True), ("[::1]:50061", True),
                                              ("0.0.0.0:50061", False), ("[::]:50061", False),
                                              ("10.0.0.5:50061", False), ("quantizer:50061", False)])
def test_is_loopback(listen, loopback):
    assert is_loopback(listen) is loopback

"""A worker whose engine stops moving (a hung GPU: the process, its heartbeats and its health answers
carry on) must stop taking traffic: new requests refused UNAVAILABLE (the gateway retries elsewhere),
draining in its heartbeats, NOT_SERVING to health checks; and take traffic again once a step completes."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.worker.server import SERVICE_NAME
from shared.rpc.refusal import REFUSAL_KEY
from tests.worker.conftest import stub
from tests.worker.hanging import hang_steps
from tests.worker.test_service import _idle, _request, _wait_for


def _health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                     timeout=5).status


def test_a_stalled_engine_takes_no_new_work_until_it_moves_again(start_worker):
    w = start_worker("fp16", stall_timeout_s=0.5)
    runner = w.server.served.engine.runner
    hang, release = hang_steps(runner)
    channel, client = stub(w)
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    stream = iter(client.Generate(_request(ignore_eos=True, max_new_tokens=40), timeout=60))
    next(stream)
    hang.set()  # the next step blocks, as a step on a hung device would
    _wait_for(lambda: _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 10.0, "NOT_SERVING")
    assert w.server._load()[1], "the gateways were not told to route elsewhere"
    with pytest.raises(grpc.RpcError) as refused:
        list(client.Generate(_request(max_new_tokens=2), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "no progress" in refused.value.details()
    assert REFUSAL_KEY not in dict(refused.value.trailing_metadata())  # a failure, not a routine refusal

    hang.clear()
    release.set()  # the device answers again
    assert len([t for m in stream for t in m.token_ids]) == 39  # the stalled request finishes
    _wait_for(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING, 10.0, "SERVING again")
    assert not w.server._load()[1]
    assert list(client.Generate(_request(max_new_tokens=2), timeout=30))[-1].finish.generated_tokens == 2
    _wait_for(lambda: _idle(client), 5.0, "idle")
    channel.close()


def test_an_idle_engine_is_never_stalled(start_worker):
    """No request in flight: however long since the last step, the engine is waiting, not stuck."""
    w = start_worker("fp16", stall_timeout_s=0.2)
    channel, client = stub(w)
    list(client.Generate(_request(max_new_tokens=2), timeout=30))
    _wait_for(lambda: w.server.served.engine.stalled_s() == 0.0, 5.0, "idle")
    threading.Event().wait(0.6)
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING and not w.server.servicer.stalled
    list(client.Generate(_request(max_new_tokens=2), timeout=30))  # work after a long idle is not stalled
    channel.close()


def test_a_hung_step_keeps_the_engine_stalled_after_its_requests_are_aborted(start_worker):
    """The gateway ends a stalled worker's streams (their Abort empties the engine): with nothing in flight
    the engine read as idle, the worker as healthy within a second, and new requests went into the hang."""
    w = start_worker("fp16", stall_timeout_s=0.3)
    engine = w.server.served.engine
    hang, release = hang_steps(engine.runner)
    channel, client = stub(w)
    stream = client.Generate(_request(ignore_eos=True, max_new_tokens=40), timeout=60)
    next(iter(stream))
    hang.set()
    _wait_for(lambda: _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING, 10.0, "NOT_SERVING")
    stream.cancel()  # as the gateway does: the worker aborts the request
    _wait_for(lambda: engine.num_in_flight == 0, 5.0, "the request aborted")
    threading.Event().wait(1.0)  # several stall timeouts and health-watch rounds
    assert engine.stalled_s() > 0.3 and w.server.servicer.stalled
    assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as refused:
        list(client.Generate(_request(max_new_tokens=2), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    hang.clear()
    release.set()
    _wait_for(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING, 10.0, "SERVING again")
    assert list(client.Generate(_request(max_new_tokens=2), timeout=30))[-1].finish.generated_tokens == 2
    channel.close()

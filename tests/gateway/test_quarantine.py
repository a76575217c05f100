"""A worker that fails request after request while it heartbeats is quarantined: its heartbeats leave it
unhealthy for a while, longer each time it fails again before finishing a request. Only a worker with a
healthy peer serving its artifact is quarantined: the last one keeps failing in the open, where the canary
guard and the fallback budget see its artifact's failures."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time

import grpc
import pytest

from services.gateway.config import ConfigError, FallbackBudget, GatewayConfig, Quarantine
from services.gateway.pool import Health, WorkerPool
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, WORKER, Stack, gateway_stack, run
from tests.gateway.fake_worker import VOCAB, FakeWorker, FakeWorkerServer
from tests.gateway.test_heartbeat_expiry import ARTIFACT
from tests.gateway.test_stalled_workers import _heartbeat
from tests.test_service_config import _refusal

FAILURE = r"127\.0\.0\.1:\d+: UNAVAILABLE: fake worker failing before the first token"


async def _health(stack: Stack, server: FakeWorkerServer) -> int:
    listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
    return {w.worker_id: w.health for w in listed.workers}[server.worker_id]


async def _bad_and_peer(stack: Stack, artifact_id: str) -> tuple[FakeWorkerServer, FakeWorkerServer]:
    bad = await stack.add_worker(artifact_id, tokens=2)
    peer = await stack.add_worker(artifact_id, tokens=2)
    bad.worker.fail_before_first = True
    await _heartbeat(stack, peer, running=5)  # loaded: a request tries `bad` first whenever it is healthy
    return bad, peer


async def _request(stack: Stack, bad: FakeWorkerServer, *, tried: bool) -> list[gateway_pb2.GatewayGenerateResponse]:
    """One request, which the client gets whole; `tried`: whether `bad` was sent it (and failed it, or not)."""
    started = len(bad.worker.started)
    replies = await stack.generate()
    assert replies[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
    assert len(bad.worker.started) == started + tried, "tried on the bad worker" if not tried else "not tried"
    return replies


async def _fail_in_a_row(stack: Stack, bad: FakeWorkerServer, count: int) -> None:
    """`count` requests that `bad` fails, each after a heartbeat (as a worker sends them) made it healthy."""
    for _ in range(count):
        await _heartbeat(stack, bad)
        assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY
        await _request(stack, bad, tried=True)


def test_a_worker_failing_every_request_among_a_healthy_peer_is_quarantined_then_put_on_probation(artifacts, caplog):
    first_s = 0.5

    async def scenario():
        quarantine = Quarantine(after_failures=3, first_s=first_s, max_s=60)
        async with gateway_stack(artifacts, quarantine=quarantine) as stack:
            bad, peer = await _bad_and_peer(stack, artifacts.stable)
            worker = stack.gateway.pool.get(bad.worker_id)
            await _fail_in_a_row(stack, bad, 3)
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY
            assert worker.failure_streak == 3 and worker.quarantined_until > time.monotonic()
            assert re.fullmatch(rf"quarantined for 0\.5 s after 3 consecutive failed requests: {FAILURE}",
                                worker.failed_reason), worker.failed_reason
            listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
            reasons = {w.worker_id: w.health_reason for w in listed.workers}
            assert reasons[bad.worker_id] == worker.failed_reason and reasons[peer.worker_id] == ""  # qctl workers

            # its heartbeats do not bring it back while the quarantine lasts: every request goes to the peer
            for _ in range(3):
                await _heartbeat(stack, bad)
                assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY
                assert worker.failed_reason.startswith("quarantined for 0.5 s after 3 consecutive")
                await _request(stack, bad, tried=False)
            assert time.monotonic() < worker.quarantined_until, "too slow a machine: the quarantine ended meanwhile"

            # over: the next heartbeat makes it healthy, on probation; its next failure doubles the quarantine
            await asyncio.sleep(max(0.0, worker.quarantined_until - time.monotonic()) + 0.05)
            await _fail_in_a_row(stack, bad, 1)
            assert re.fullmatch(rf"quarantined for 1 s after 4 consecutive failed requests: {FAILURE}",
                                worker.failed_reason), worker.failed_reason
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY
            await _request(stack, bad, tried=False)

            # mended: after the quarantine it finishes a request, which clears its record
            bad.worker.fail_before_first = False
            await asyncio.sleep(max(0.0, worker.quarantined_until - time.monotonic()) + 0.05)
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY
            finished = len(bad.worker.finished)
            await _request(stack, bad, tried=True)
            assert len(bad.worker.finished) == finished + 1
            assert (worker.failure_streak, worker.quarantines, worker.quarantined_until) == (0, 0, 0.0)

    with caplog.at_level(logging.WARNING, logger="services.gateway.pool"):
        run(scenario())
    messages = [r.getMessage() for r in caplog.records if r.name == "services.gateway.pool"]
    assert sum("quarantined for" in m for m in messages) == 2, messages
    assert sum("its quarantine is over; taking requests on probation" in m for m in messages) == 2, messages


def test_a_finished_request_resets_the_streak(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, quarantine=Quarantine(after_failures=3, first_s=30, max_s=60)) as stack:
            bad, _ = await _bad_and_peer(stack, artifacts.stable)
            worker = stack.gateway.pool.get(bad.worker_id)
            await _fail_in_a_row(stack, bad, 2)
            bad.worker.fail_before_first = False
            await _heartbeat(stack, bad)
            await _request(stack, bad, tried=True)  # finished
            bad.worker.fail_before_first = True
            await _fail_in_a_row(stack, bad, 2)  # four failures out of five, never three in a row
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY
            await _fail_in_a_row(stack, bad, 1)  # the third in a row since the finished one
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY
            assert worker.failure_streak == 3 and worker.quarantines == 1

    run(scenario())


@pytest.mark.parametrize("answer", ["full", "refused"])
def test_a_full_worker_or_a_refusal_of_the_clients_request_neither_counts_nor_resets(artifacts, answer):
    """RESOURCE_EXHAUSTED: the worker is busy, not failing. INVALID_ARGUMENT: it validated the request and
    said no, before its engine ran; no evidence either way of whether it can generate."""
    async def scenario():
        async with gateway_stack(artifacts, quarantine=Quarantine(after_failures=3, first_s=30, max_s=60)) as stack:
            bad, peer = await _bad_and_peer(stack, artifacts.stable)
            worker = stack.gateway.pool.get(bad.worker_id)
            await _fail_in_a_row(stack, bad, 2)
            bad.worker.fail_before_first = False
            await _heartbeat(stack, bad)
            for _ in range(4):
                started = len(bad.worker.started)
                if answer == "full":
                    bad.worker.full = True
                    await _request(stack, bad, tried=True)  # served by the peer
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as raised:
                        await stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(
                            deployment=DEPLOYMENT, token_ids=common_pb2.TokenIds(ids=[VOCAB + 1]))).read()
                    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert len(bad.worker.started) == started + 1
                assert worker.health is Health.HEALTHY  # counted, the 3rd would have quarantined it
            bad.worker.full = False
            bad.worker.fail_before_first = True
            await _fail_in_a_row(stack, bad, 1)  # the third failure in a row, the refusals between
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY  # not reset by them either
            assert worker.failure_streak == 3 and worker.quarantined_until > time.monotonic()

    run(scenario())


def test_a_canarys_only_worker_failing_every_request_is_never_quarantined_and_the_guard_aborts_it(artifacts):
    """Quarantined, it would send every canary request to the stable: no more canary failures, and the
    guard, which judges the canary by them, would never abort it."""
    requests = 6

    async def scenario():
        budget = FallbackBudget(max_error_rate=0.5, window_s=60.0, min_requests=requests)
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=0.05,
                                 quarantine=Quarantine(after_failures=2, first_s=30, max_s=60)) as stack:
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            bad = await stack.add_worker(artifacts.canary, tokens=2)
            bad.worker.fail_before_first = True
            await stack.add_worker(artifacts.stable, tokens=2)
            worker = stack.gateway.pool.get(bad.worker_id)
            for i in range(requests):
                await _heartbeat(stack, bad)
                assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY, f"request {i}"
                replies = await _request(stack, bad, tried=True)
                assert replies[-1].arm == gateway_pb2.ARM_STABLE  # the canary's request, served by the stable
            assert worker.failure_streak == requests and not worker.quarantined_until
            canary = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0)
            assert (canary.requests, canary.errors) == (requests, requests)  # every failure is the canary's
            for _ in range(200):  # the guard checks every 0.05 s
                if not (await stack.deployment()).HasField("canary"):
                    break
                await asyncio.sleep(0.025)
            assert not (await stack.deployment()).HasField("canary"), "the guard did not abort the canary"
            events = await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT), metadata=ADMIN)
            abort = next(e for e in events.events if e.kind == "abort")
            reason = json.loads(abort.detail)["reason"]
            assert abort.actor == "auto" and f"canary {artifacts.canary} error rate" in reason, reason

    run(scenario())


def test_the_last_healthy_worker_of_an_artifact_is_quarantined_only_once_it_has_a_healthy_peer(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, quarantine=Quarantine(after_failures=2, first_s=30, max_s=60)) as stack:
            bad = await stack.add_worker(artifacts.stable, tokens=2)
            bad.worker.fail_before_first = True
            await stack.add_worker(artifacts.baseline, tokens=2)
            worker = stack.gateway.pool.get(bad.worker_id)
            for _ in range(4):  # alone: it keeps failing in the open, each request moving to the baseline
                await _heartbeat(stack, bad)
                assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY
                replies = await _request(stack, bad, tried=True)
                assert replies[-1].arm == gateway_pb2.ARM_BASELINE
            stable = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert stable.errors == 4  # its failures count against the stable, for the fallback budget

            # a healthy peer registers: the next failure quarantines it, and its requests go to the peer
            peer = await stack.add_worker(artifacts.stable, tokens=2)
            await _heartbeat(stack, peer, running=5)
            await _fail_in_a_row(stack, bad, 1)
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY
            assert worker.failed_reason.startswith("quarantined for 30 s after 5 consecutive failed requests")
            replies = await _request(stack, bad, tried=False)
            assert replies[-1].arm == gateway_pb2.ARM_STABLE

            # the peer drains away: the quarantined worker is the last of its artifact again, so its next
            # heartbeat lifts the quarantine rather than leave the stable without a worker
            await _heartbeat(stack, peer, draining=True)
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY
            assert not worker.quarantined_until and worker.failure_streak == 5  # on probation
            replies = await _request(stack, bad, tried=True)
            assert replies[-1].arm == gateway_pb2.ARM_BASELINE

    run(scenario())


def test_a_worker_registering_again_starts_with_a_clean_record(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, quarantine=Quarantine(after_failures=2, first_s=30, max_s=60)) as stack:
            bad, _ = await _bad_and_peer(stack, artifacts.stable)
            worker = stack.gateway.pool.get(bad.worker_id)
            await _fail_in_a_row(stack, bad, 2)
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_UNHEALTHY  # quarantined
            # a new process at the address (restarted, its GPU reset): it registers
            reply = await stack.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                address=bad.address, artifact_id=artifacts.stable), metadata=WORKER)
            assert reply.worker_id == bad.worker_id and stack.gateway.pool.get(bad.worker_id) is worker
            assert (worker.failure_streak, worker.quarantines, worker.quarantined_until) == (0, 0, 0.0)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY
            await _fail_in_a_row(stack, bad, 1)  # one failure, not the third in a row
            await _heartbeat(stack, bad)
            assert await _health(stack, bad) == gateway_pb2.WORKER_HEALTH_HEALTHY

    run(scenario())


def test_quarantines_double_up_to_the_cap_and_zero_failures_turns_them_off():
    async def scenario():
        servers = [await FakeWorkerServer(FakeWorker(ARTIFACT.artifact_id)).start() for _ in range(2)]
        pools = [WorkerPool(heartbeat_timeout_s=6.0, quarantine=Quarantine(after_failures=2, first_s=5, max_s=12)),
                 WorkerPool(heartbeat_timeout_s=6.0, quarantine=Quarantine(after_failures=0))]
        try:
            pool = pools[0]
            bad, _ = [await pool.add(s.address, ARTIFACT, capacity=4) for s in servers]

            def beat() -> Health:
                pool.heartbeat(bad.worker_id, 0, 0, 8, draining=False)
                return bad.health

            pool.mark_failed(bad, "boom")
            assert beat() is Health.HEALTHY
            seconds = []
            for _ in range(4):
                pool.mark_failed(bad, "boom")
                seconds.append(float(re.match(r"quarantined for (\S+) s", bad.failed_reason).group(1)))
                assert beat() is Health.UNHEALTHY and bad.failed_reason.endswith(": boom")
                pool.mark_failed(bad, "in flight")  # a request still open on it fails: no new quarantine
                assert bad.failed_reason.endswith(": boom")
                bad.quarantined_until = time.monotonic() - 0.001  # its time is over
                assert beat() is Health.HEALTHY and bad.failed_reason == ""
            assert seconds == [5, 10, 12, 12]
            pool.mark_succeeded(bad)
            pool.mark_failed(bad, "boom")
            pool.mark_failed(bad, "boom")
            assert bad.failed_reason.startswith("quarantined for 5 s after 2 consecutive")

            off = pools[1]
            worker, _ = [await off.add(s.address, ARTIFACT, capacity=4) for s in servers]
            for _ in range(10):
                off.mark_failed(worker, "boom")
                off.heartbeat(worker.worker_id, 0, 0, 8, draining=False)
                assert worker.health is Health.HEALTHY
        finally:
            for pool in pools:
                await pool.close()
            for server in servers:
                await server.stop(0)

    run(scenario())


def test_quarantine_flags(tmp_path, capsys):
    base = ["--registry-url", f"sqlite:///{tmp_path}/registry.db"]
    defaults = GatewayConfig.from_args(base, environ={}).quarantine
    assert defaults == Quarantine(after_failures=3, first_s=5.0, max_s=300.0) and defaults.enabled
    config = GatewayConfig.from_args([*base, "--quarantine-after-failures", "5", "--quarantine-s", "2",
                                      "--quarantine-max-s", "60"], environ={})
    assert config.quarantine == Quarantine(after_failures=5, first_s=2.0, max_s=60.0)
    off = GatewayConfig.from_args([*base, "--quarantine-after-failures", "0"], environ={}).quarantine
    assert not off.enabled
    refusals = [
        (["--quarantine-after-failures", "1.5"], "--quarantine-after-failures"),
        (["--quarantine-after-failures", "-1"], "--quarantine-after-failures -1 must be"),
        (["--quarantine-s", "0"], "--quarantine-s 0.0 must be a positive number of seconds"),
        (["--quarantine-s", "nan"], "--quarantine-s nan must be"),
        (["--quarantine-max-s", "inf"], "--quarantine-max-s inf must be"),
        (["--quarantine-s", "10", "--quarantine-max-s", "5"], "--quarantine-max-s 5.0 is shorter than --quarantine-s"),
    ]
    for argv, says in refusals:
        message = _refusal("gateway", [*base, *argv], capsys)
        assert says in message, (argv, message)
    with pytest.raises(ConfigError):
        GatewayConfig(registry_url="sqlite://", quarantine=Quarantine(after_failures=True))

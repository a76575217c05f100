"""Requests a worker never answers: a worker that took the request and hung before its first token, or a
request (or the connection under it) lost on the way while the worker's heartbeats, on another connection,
carry on. The gateway ends such a stream and retries the request elsewhere (--first-reply-timeout-s; two
heartbeats in a row that say the worker runs nothing), and a client that gives up before its first token is
recorded as having waited that long for it, so the TTFT budget (and, past the first-reply timeout, the error
budget) sees a canary that never answers."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.gateway.config import ConfigError, FallbackBudget, GatewayConfig
from services.gateway.pool import KEEPALIVE_TIME_MS, UNHEARD_REASON, Health, WorkerPool
from services.gateway.router import Arm, Route
from services.gateway.servicer_gateway import Trace
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, WORKER, Stack, gateway_stack, run, tokens_of
from tests.gateway.fake_worker import FakeWorkerServer, expected_tokens, pool_of_one
from tests.gateway.test_heartbeat_expiry import ARTIFACT

PROMPT = "abc"
TOKENS = 3
WITHIN_S = 10.0  # generous: without the fixes these streams would wait for ever
# gRPC's server default: pings more often than this, while the server sends nothing, are abuse (GOAWAY)
SERVER_MIN_PING_INTERVAL_MS = 300_000


async def _heartbeat(stack: Stack, server: FakeWorkerServer, running: int = 0) -> None:
    await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=server.worker_id, running_requests=running),
                                metadata=WORKER)


async def _until(predicate, timeout_s: float = WITHIN_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _hung_and_spare(stack: Stack) -> tuple[FakeWorkerServer, FakeWorkerServer]:
    """A stable worker that takes every request and never answers, and a spare the first request avoids."""
    hung = await stack.add_worker(stack.artifacts.stable, tokens=TOKENS)
    spare = await stack.add_worker(stack.artifacts.stable, tokens=TOKENS)
    hung.worker.hang_after = 0
    await _heartbeat(stack, spare, running=5)  # loaded: the request goes to `hung` first
    return hung, spare


def _request(text: str = PROMPT) -> gateway_pb2.GatewayGenerateRequest:
    return gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text=text)


# ---------------------------------------------------------------- a client that leaves before its first token


def test_a_client_leaving_before_its_first_token_is_a_ttft_sample_not_an_error(artifacts):
    """It was recorded as a success without a TTFT: a canary that never answers showed neither errors nor a
    TTFT for the budget. Under the first-reply timeout it is not an error: a client's short deadline on a
    healthy but busy worker must not count against the worker or its arm."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:  # the first-reply timeout at its default (120 s)
            hung = await stack.add_worker(artifacts.stable, tokens=TOKENS)
            hung.worker.hang_after = 0
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in stack.gw.Generate(_request(), timeout=0.3):
                    pass
            assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            metrics = stack.gateway.metrics
            await _until(lambda: metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0).requests == 1)
            stats = metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert (stats.requests, stats.errors, stats.ttft_samples) == (1, 0, 1)
            assert stats.ttft_p95_s >= 0.15  # about what it waited (a lower bound on its TTFT)
            pooled = stack.gateway.pool.get(hung.worker_id)
            assert pooled.health is Health.HEALTHY and pooled.failure_streak == 0

    run(scenario())


def test_a_canary_that_never_answers_breaks_the_ttft_budget_through_the_clients_that_leave(artifacts):
    """The audit's case: every canary request hangs until the client's deadline, the canary's heartbeats say it
    is busy. The canary must be aborted on its TTFT, though no request of it ever got a first token."""
    budget = FallbackBudget(max_error_rate=0.05, max_tpot_p95_s=10.0, max_ttft_p95_s=0.2, window_s=60.0,
                            min_requests=3)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=TOKENS)
            canary = await stack.add_worker(artifacts.canary, tokens=TOKENS)
            canary.worker.hang_after = 0
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            await _heartbeat(stack, canary, running=1)  # alive, and it knows of its requests
            for i in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    async for _ in stack.gw.Generate(_request(f"p{i}"), timeout=0.5):
                        pass
                assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            deployment = await _deployment_once(stack, lambda d: not d.HasField("canary"))
            assert not deployment.HasField("canary") and not deployment.fallback
            events = (await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT),
                                                   metadata=ADMIN)).events
            assert (events[0].kind, events[0].actor) == ("abort", "auto") and "time to first token" in events[0].detail

    run(scenario())


async def _deployment_once(stack: Stack, done) -> gateway_pb2.Deployment:
    """The deployment once done(deployment), or as it is after WITHIN_S."""
    deadline = asyncio.get_running_loop().time() + WITHIN_S
    while not done(deployment := await stack.deployment()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return deployment


def test_a_wait_past_the_first_reply_timeout_is_an_error_and_counts_from_the_arms_start():
    """The time a client that left waited is counted as an error past the first-reply timeout (never with the
    timeout off), and from when its arm took the request: a canary slow to fail must not put its delay on the
    stable it moved to (Trace.move_to)."""
    def left_after(waited_s: float, timeout_s: float, moved_s_ago: float | None = None) -> Trace:
        trace = Trace(arrival=time.monotonic() - waited_s, route=Route(Arm.CANARY, ARTIFACT))
        if moved_s_ago is not None:
            trace.move_to(Route(Arm.STABLE, ARTIFACT))
            trace.arm_since = time.monotonic() - moved_s_ago
        trace.client_left(timeout_s)
        return trace

    slow = left_after(waited_s=5.0, timeout_s=2.0).outcome()
    assert slow.server_error  # a failure of its arm: not judged on its latency
    within = left_after(waited_s=1.0, timeout_s=2.0).outcome()
    assert not within.server_error and 1.0 <= within.ttft_s < 2.0 and within.tpot_s is None and within.tokens == 0
    off = left_after(waited_s=500.0, timeout_s=0.0).outcome()
    assert not off.server_error and off.ttft_s >= 500.0
    moved = left_after(waited_s=5.0, timeout_s=2.0, moved_s_ago=1.0).outcome()
    assert not moved.server_error and 1.0 <= moved.ttft_s < 2.0

    answered = Trace(arrival=time.monotonic() - 3.0, route=Route(Arm.STABLE, ARTIFACT))
    answered.first_token_at = answered.arrival + 0.5
    answered.delivered = 1
    answered.client_left(2.0)  # after its first token: nothing changes
    outcome = answered.outcome()
    assert not outcome.server_error and outcome.ttft_s == pytest.approx(0.5)


# ---------------------------------------------------------------- the first-reply timeout


def test_a_worker_silent_past_the_first_reply_timeout_fails_and_the_request_is_retried(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, first_reply_timeout_s=0.5) as stack:
            hung, spare = await _hung_and_spare(stack)
            replies = await asyncio.wait_for(stack.generate(PROMPT), WITHIN_S)  # no client deadline
            assert tokens_of(replies) == expected_tokens(list(PROMPT.encode()), TOKENS)
            assert len(hung.worker.started) == 1 and len(spare.worker.finished) == 1
            # its call cancelled and Worker.Abort sent, as for a client that leaves
            await _until(lambda: hung.worker.cancelled and hung.worker.aborts and not stack.gateway.gateway._aborts)
            assert hung.worker.cancelled == hung.worker.started == hung.worker.aborts
            pooled = stack.gateway.pool.get(hung.worker_id)
            assert pooled.health is Health.UNHEALTHY and pooled.failure_streak == 1  # towards its quarantine
            assert "first-reply timeout of 0.5 s" in pooled.failed_reason
            stats = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert (stats.requests, stats.errors) == (2, 1)  # the failed attempt counted against its arm
            assert pooled.in_flight == 0 and not pooled.stream_enders and not pooled.silent_streams

    run(scenario())


def test_the_first_reply_timeout_ends_with_the_first_reply(artifacts):
    """A stream slower in all than the timeout, but quick to its first token, is not cut."""
    async def scenario():
        async with gateway_stack(artifacts, first_reply_timeout_s=0.5) as stack:
            slow = await stack.add_worker(artifacts.stable, tokens=8, delay_s=0.1)
            replies = await asyncio.wait_for(stack.generate(PROMPT), WITHIN_S)
            assert tokens_of(replies) == expected_tokens(list(PROMPT.encode()), 8)
            assert slow.worker.cancelled == [] and len(slow.worker.started) == 1
            assert stack.gateway.pool.get(slow.worker_id).failure_streak == 0

    run(scenario())


def test_the_first_reply_timeout_setting(tmp_path):
    base = ["--registry-url", f"sqlite:///{tmp_path}/registry.db"]
    assert GatewayConfig.from_args(base, environ={}).first_reply_timeout_s == 120.0
    assert GatewayConfig.from_args([*base, "--first-reply-timeout-s", "0"], environ={}).first_reply_timeout_s == 0
    assert GatewayConfig.from_args([*base, "--first-reply-timeout-s", "2.5"], environ={}).first_reply_timeout_s == 2.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="--first-reply-timeout-s"):
            GatewayConfig.from_args([*base, "--first-reply-timeout-s", bad], environ={})


# ---------------------------------------------------------------- streams the worker knows nothing of


def test_streams_with_no_reply_across_two_idle_heartbeats_are_ended_and_retried(artifacts):
    """The worker's heartbeats say it runs nothing while the gateway waits on it: the request, or the
    connection, was lost on the way (the first-reply timeout is off here)."""
    async def scenario():
        async with gateway_stack(artifacts, first_reply_timeout_s=0) as stack:
            hung, spare = await _hung_and_spare(stack)
            pooled = stack.gateway.pool.get(hung.worker_id)
            call = asyncio.ensure_future(stack.generate(PROMPT))
            await _until(lambda: hung.worker.hung)
            await _heartbeat(stack, hung)  # one idle beat: it may have been taken before the request arrived
            await _heartbeat(stack, hung, running=1)  # busy: starts the count again
            await _heartbeat(stack, hung)
            await asyncio.sleep(0.1)
            assert not call.done() and spare.worker.started == [] and pooled.in_flight == 1
            await _heartbeat(stack, hung)  # the second idle beat in a row
            replies = await asyncio.wait_for(call, WITHIN_S)
            assert tokens_of(replies) == expected_tokens(list(PROMPT.encode()), TOKENS)
            assert len(spare.worker.finished) == 1
            await _until(lambda: hung.worker.aborts and not stack.gateway.gateway._aborts)
            assert hung.worker.cancelled == hung.worker.started == hung.worker.aborts
            assert pooled.failure_streak == 1 and UNHEARD_REASON in pooled.failed_reason
            assert pooled.in_flight == 0 and not pooled.stream_enders and not pooled.silent_streams

    run(scenario())


def test_a_stream_that_had_a_reply_is_not_ended_by_idle_heartbeats(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, first_reply_timeout_s=0) as stack:
            server = await stack.add_worker(artifacts.stable, tokens=TOKENS)
            server.worker.hang_after = 1  # one token, then a long wait (its heartbeats' count aside)
            call = stack.gw.Generate(_request())
            assert (await call.read()).token_ids
            await _until(lambda: server.worker.hung)
            for _ in range(3):
                await _heartbeat(stack, server)
            await asyncio.sleep(0.1)
            pooled = stack.gateway.pool.get(server.worker_id)
            assert server.worker.cancelled == [] and pooled.in_flight == 1 and pooled.failure_streak == 0
            call.cancel()
            await _until(lambda: pooled.in_flight == 0)

    run(scenario())


def test_the_pool_ends_a_silent_stream_after_two_idle_beats_in_a_row_once():
    async def scenario():
        async with pool_of_one(ARTIFACT) as (pool, worker):
            ended: list[str] = []
            answered: list[str] = []
            pool.acquire(worker, ended.append)
            pool.acquire(worker, answered.append)
            pool.heard_from(worker, answered.append)
            pool.heartbeat(worker.worker_id, 0, 0, 8, draining=False)
            pool.heartbeat(worker.worker_id, 0, 1, 8, draining=False)  # one waiting: the count starts again
            pool.heartbeat(worker.worker_id, 0, 0, 8, draining=False)
            late: list[str] = []
            pool.acquire(worker, late.append)  # opened between the beats: it needs two of its own
            assert ended == []
            pool.heartbeat(worker.worker_id, 0, 0, 8, draining=True)  # draining or not
            assert ended == [UNHEARD_REASON] and late == [] and answered == []
            assert worker.stream_enders == {answered.append, late.append}
            pool.heartbeat(worker.worker_id, 0, 0, 8, draining=False)
            assert ended == [UNHEARD_REASON] and late == [UNHEARD_REASON] and answered == []
            for end in (ended.append, late.append, answered.append):
                await pool.release(worker, end)
            assert worker.in_flight == 0 and not worker.stream_enders and not worker.silent_streams

    run(scenario())


def test_worker_channels_send_keepalive_pings_no_more_often_than_a_worker_accepts(monkeypatch):
    """A connection whose peer vanished without a word is otherwise never noticed by a stream that reads it;
    pings more frequent than a worker's gRPC server takes would have it close the connection instead."""
    dialled: list[dict] = []
    real_dial = WorkerPool.dial

    def dial(self, address, options=()):
        dialled.append(dict(options))
        return real_dial(self, address, options)

    monkeypatch.setattr(WorkerPool, "dial", dial)

    async def scenario():
        async with pool_of_one(ARTIFACT):
            pass

    run(scenario())
    options = dialled[0]
    assert SERVER_MIN_PING_INTERVAL_MS <= options["grpc.keepalive_time_ms"] == KEEPALIVE_TIME_MS
    assert 0 < options["grpc.keepalive_timeout_ms"] < options["grpc.keepalive_time_ms"]

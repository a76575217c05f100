"""A worker that will not finish the streams open on it, because its heartbeat says its engine stalled or
because its heartbeats stopped: the gateway ends them at once instead of leaving them to the client's
deadline. A request with no token delivered yet moves to another worker; one with tokens delivered ends
UNAVAILABLE with the count. A draining worker's streams are left to finish. Every stream's registration
with the pool is gone once the stream is."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import grpc
import pytest

from services.gateway.pool import Health, WorkerPool
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, WORKER, Stack, gateway_stack, run
from tests.gateway.fake_worker import FakeWorkerServer, expected_tokens, pool_of_one
from tests.gateway.test_heartbeat_expiry import ARTIFACT

TOKENS = 6
PROMPT = "abc"
ENDED_WITHIN_S = 5.0  # without the gateway ending them, these streams would wait forever


async def _heartbeat(stack: Stack, server: FakeWorkerServer, *, running: int = 0, draining: bool = False,
                     stalled: bool = False) -> None:
    await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(
        worker_id=server.worker_id, running_requests=running, draining=draining, stalled=stalled), metadata=WORKER)


@contextlib.asynccontextmanager
async def _heartbeating(stack: Stack, server: FakeWorkerServer, interval_s: float, **load):
    """Heartbeats as the worker would, every interval_s, until the block ends (the first one before it starts)."""
    async def beat():
        while True:
            await asyncio.sleep(interval_s)
            await _heartbeat(stack, server, **load)

    await _heartbeat(stack, server, **load)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _stuck_and_spare(stack: Stack, hang_after: int) -> tuple[FakeWorkerServer, FakeWorkerServer]:
    stuck = await stack.add_worker(stack.artifacts.stable, tokens=TOKENS)
    spare = await stack.add_worker(stack.artifacts.stable, tokens=TOKENS)
    stuck.worker.hang_after = hang_after
    await _heartbeat(stack, spare, running=5)  # loaded: the request goes to `stuck` first
    return stuck, spare


async def _start_stuck_stream(stack: Stack, stuck: FakeWorkerServer, delivered: int):
    """A stream on `stuck`, once the worker hangs and the client has received `delivered` tokens."""
    call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text=PROMPT))
    received: list[int] = []
    while len(received) < delivered:
        received.extend((await call.read()).token_ids)
    await _until(lambda: stuck.worker.hung)
    return call, received


async def _read_rest(call, received: list[int]) -> None:
    while (reply := await call.read()) is not grpc.aio.EOF:
        received.extend(reply.token_ids)


async def _check_ended(stack: Stack, call, received: list[int], delivered: int, stuck: FakeWorkerServer,
                       spare: FakeWorkerServer, why: str) -> None:
    """The stream on `stuck` was ended promptly: retried on `spare` before any token, else UNAVAILABLE."""
    expected = expected_tokens(list(PROMPT.encode()), TOKENS)
    if delivered:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await asyncio.wait_for(_read_rest(call, received), ENDED_WITHIN_S)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        details = raised.value.details()
        assert re.search(rf"after {delivered} tokens were delivered", details) and why in details, details
        assert received == expected[:delivered] and spare.worker.started == []  # never replayed elsewhere
    else:
        await asyncio.wait_for(_read_rest(call, received), ENDED_WITHIN_S)
        assert received == expected and len(spare.worker.finished) == 1
    # the worker's call cancelled and Worker.Abort sent (and returned), as for a client that leaves
    await _until(lambda: stuck.worker.cancelled and stuck.worker.aborts and not stack.gateway.gateway._aborts)
    assert stuck.worker.cancelled == stuck.worker.started == stuck.worker.aborts
    stats = stack.gateway.metrics.stats(DEPLOYMENT, stack.artifacts.stable, since=0.0)
    assert (stats.requests, stats.errors) == ((1, 1) if delivered else (2, 1))  # the failed attempt counted
    _assert_no_stream_left(stack.gateway.pool)


def _assert_no_stream_left(pool: WorkerPool) -> None:
    for worker in pool.workers.values():
        assert worker.in_flight == 0 and not worker.stream_enders, f"{worker.address} still holds a stream"


async def _served_by(stack: Stack, server: FakeWorkerServer) -> None:
    finished = len(server.worker.finished)
    replies = await stack.generate("again")
    assert replies[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
    assert len(server.worker.finished) == finished + 1, "the recovered worker got no new request"


@pytest.mark.parametrize("delivered", [0, 3], ids=["before-the-first-token", "after-tokens"])
def test_the_streams_of_a_worker_reported_stalled_are_ended(artifacts, delivered):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stuck, spare = await _stuck_and_spare(stack, hang_after=delivered)
            call, received = await _start_stuck_stream(stack, stuck, delivered)
            await _heartbeat(stack, stuck, draining=True, stalled=True)  # what a stalled worker reports
            await _check_ended(stack, call, received, delivered, stuck, spare, "stalled")
            pool = stack.gateway.pool
            assert pool.get(stuck.worker_id).health is Health.STALLED
            listed = {w.worker_id: w.health for w in
                      (await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers}
            assert listed[stuck.worker_id] == gateway_pb2.WORKER_HEALTH_UNHEALTHY  # not DRAINING
            reasons = {w.worker_id: w.health_reason for w in
                       (await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers}
            assert reasons[stuck.worker_id] == "its engine stalled (no progress with requests in flight)"

            # its engine moves again: new traffic, as before the stall
            stuck.worker.hang_after = None
            await _heartbeat(stack, stuck)
            assert pool.get(stuck.worker_id).health is Health.HEALTHY
            await _served_by(stack, stuck)
            _assert_no_stream_left(pool)

    run(scenario())


@pytest.mark.parametrize("delivered", [0, 3], ids=["before-the-first-token", "after-tokens"])
def test_the_streams_of_a_worker_whose_heartbeats_stop_are_ended(artifacts, delivered):
    interval_s = 0.05

    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=interval_s, heartbeat_timeout_s=0.3) as stack:
            stuck, spare = await _stuck_and_spare(stack, hang_after=delivered)
            async with _heartbeating(stack, spare, interval_s, running=5):
                async with _heartbeating(stack, stuck, interval_s):
                    call, received = await _start_stuck_stream(stack, stuck, delivered)
                # `stuck` falls silent (the whole process hung, or cut off from the gateway)
                await _check_ended(stack, call, received, delivered, stuck, spare, "no heartbeat for")
                pool = stack.gateway.pool
                assert pool.get(stuck.worker_id).health is Health.UNHEALTHY

                stuck.worker.hang_after = None
                async with _heartbeating(stack, stuck, interval_s):  # back
                    assert pool.get(stuck.worker_id).health is Health.HEALTHY
                    await _served_by(stack, stuck)
            _assert_no_stream_left(pool)

    run(scenario())


def test_a_pause_of_the_gateway_itself_does_not_expire_its_workers_nor_end_their_streams(artifacts):
    """The gateway's own event loop held up past the heartbeat timeout (a paused process, a starved host):
    its workers' heartbeats wait in its queue behind the expiry pass, which found every worker silent and
    ended every stream the gateway had open."""
    interval_s = 0.05

    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=interval_s, heartbeat_timeout_s=0.3) as stack:
            server = await stack.add_worker(artifacts.stable, tokens=TOKENS)
            server.worker.hang_after = 2  # a long generation, still running when the gateway pauses
            async with _heartbeating(stack, server, interval_s):
                call, _ = await _start_stuck_stream(stack, server, 2)
                time.sleep(0.8)  # the whole event loop stops: nothing runs, nothing is heard
                await asyncio.sleep(0.5)  # the expiry passes after the pause, with the heartbeats resuming
                worker = stack.gateway.pool.get(server.worker_id)
                assert worker.health is Health.HEALTHY and server.worker.cancelled == []
                assert len(worker.stream_enders) == 1, "the open stream was ended"
            call.cancel()
            await _until(lambda: stack.gateway.pool.get(server.worker_id).in_flight == 0)

    run(scenario())


def test_a_draining_workers_streams_are_left_to_finish(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            draining = await stack.add_worker(artifacts.stable, tokens=10, delay_s=0.03)
            call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text=PROMPT))
            received = list((await call.read()).token_ids)
            await _heartbeat(stack, draining, draining=True)
            assert stack.gateway.pool.get(draining.worker_id).health is Health.DRAINING
            await _read_rest(call, received)
            assert received == expected_tokens(list(PROMPT.encode()), 10)
            assert draining.worker.finished == draining.worker.started
            assert draining.worker.cancelled == [] and draining.worker.aborts == []
            _assert_no_stream_left(stack.gateway.pool)

    run(scenario())


def test_every_stream_unregisters_from_the_pool_however_it_ends(artifacts):
    """Finished, failed by the worker, refused as full, cancelled by the client: none leaves its callback
    in the pool (a leak, and a call to cancel a long-gone stream at the worker's next stall)."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            pool = stack.gateway.pool
            server = await stack.add_worker(artifacts.stable, tokens=20, delay_s=0.02)
            worker = pool.get(server.worker_id)
            call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text=PROMPT))
            await call.read()
            assert len(worker.stream_enders) == 1 and worker.in_flight == 1  # registered while open
            call.cancel()
            await _until(lambda: worker.in_flight == 0)
            _assert_no_stream_left(pool)

            await stack.generate(max_new_tokens=2)  # finished
            _assert_no_stream_left(pool)

            server.worker.fail_after = 1
            with pytest.raises(grpc.aio.AioRpcError):
                await stack.generate()
            _assert_no_stream_left(pool)

            server.worker.fail_after = None
            await _heartbeat(stack, server)  # healthy again after the failure
            server.worker.full = True
            with pytest.raises(grpc.aio.AioRpcError):
                await stack.generate()
            _assert_no_stream_left(pool)

    run(scenario())


def test_the_pool_ends_each_stream_once_and_only_for_a_stall_or_silence():
    async def scenario():
        async with pool_of_one(ARTIFACT) as (pool, worker):
            ended: list[str] = []
            pool.acquire(worker, ended.append)
            pool.heartbeat(worker.worker_id, 1, 0, 8, draining=True)
            pool.expire()
            assert ended == [] and worker.stream_enders == {ended.append}  # draining, heartbeating: left alone

            pool.heartbeat(worker.worker_id, 1, 0, 8, draining=True, stalled=True)
            pool.heartbeat(worker.worker_id, 1, 0, 8, draining=True, stalled=True)
            assert len(ended) == 1 and "stalled" in ended[0] and not worker.stream_enders
            await pool.release(worker, ended.append)  # what the ended stream does last
            assert worker.in_flight == 0 and not worker.stream_enders

            # a worker marked unhealthy by a failed request (one with a healthy peer: the last healthy worker of
            # an artifact keeps its requests, WorkerPool.mark_failed), whose heartbeats then stop
            pool.heartbeat(worker.worker_id, 1, 0, 8, draining=False)
            pool.acquire(worker, ended.append)
            worker.health = Health.UNHEALTHY
            worker.last_heartbeat_mono -= 10.0
            assert pool.expire() == []  # already unhealthy: not newly marked...
            assert len(ended) == 2 and "no heartbeat" in ended[1]  # ...but its streams are ended all the same
            pool.expire()
            assert len(ended) == 2
            await pool.release(worker, ended.append)
            assert worker.in_flight == 0 and not worker.stream_enders

    run(scenario())

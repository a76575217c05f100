"""Worker failures before and after the first token, client cancellation, admission."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from services.gateway.config import Quarantine
from services.gateway.pool import Health
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, gateway_stack, run, tokens_of
from tests.gateway.fake_worker import expected_tokens


def test_a_worker_failing_before_the_first_token_is_retried_on_another(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            broken = await stack.add_worker(artifacts.stable, tokens=3)
            healthy = await stack.add_worker(artifacts.stable, tokens=3)
            broken.worker.fail_before_first = True
            for i in range(4):
                replies = await stack.generate(f"p{i}")
                assert tokens_of(replies) == expected_tokens(list(f"p{i}".encode()), 3)
            # the broken worker was tried at most once, then marked unhealthy
            assert len(broken.worker.started) <= 1 and len(healthy.worker.started) == 4
            listed = {w.worker_id: w for w in
                      (await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers}
            if broken.worker.started:
                assert listed[broken.worker_id].health == gateway_pb2.WORKER_HEALTH_UNHEALTHY

    run(scenario())


def test_the_last_worker_failing_before_the_first_token_sends_the_request_to_the_baseline(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            broken = await stack.add_worker(artifacts.stable, tokens=2)
            broken.worker.fail_before_first = True
            await stack.add_worker(artifacts.baseline, tokens=2)
            replies = await stack.generate()
            assert replies[-1].artifact_id == artifacts.baseline and replies[-1].arm == gateway_pb2.ARM_BASELINE
            assert len(broken.worker.started) == 1

    run(scenario())


@pytest.mark.parametrize("how", ["error", "killed"])
def test_a_worker_failing_after_tokens_ends_the_stream_unavailable_with_the_count(artifacts, how):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            failing = await stack.add_worker(artifacts.stable, tokens=10, delay_s=0.05)
            spare = await stack.add_worker(artifacts.stable, tokens=10)
            failing.worker.fail_after = 3 if how == "error" else None
            await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=spare.worker_id, running_requests=5),
                                        metadata=ADMIN)  # loaded: the first request goes to `failing`
            request = gateway_pb2.GatewayGenerateRequest(deployment="chat", text="abc")
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for reply in stack.gw.Generate(request):
                    received.extend(reply.token_ids)
                    if how == "killed" and len(received) == 3:
                        await failing.stop(0)  # the worker process dies mid-stream
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert received == expected_tokens(list(b"abc"), 10)[:3]  # no duplicate, no gap
            assert re.search(r"after 3 tokens were delivered", raised.value.details()), raised.value.details()
            assert spare.worker.started == []  # never replayed elsewhere

    run(scenario())


def test_a_client_that_cancels_aborts_the_request_on_the_worker(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = (await stack.add_worker(artifacts.stable, tokens=50, delay_s=0.05)).worker
            call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment="chat", text="long"))
            seen = 0
            async for reply in call:
                seen += len(reply.token_ids)
                if seen == 2:
                    call.cancel()
                    break
            for _ in range(50):  # the Worker.Abort holds the worker until it returns
                if worker.aborts and worker.cancelled and not stack.gateway.gateway._aborts:
                    break
                await asyncio.sleep(0.02)
            assert worker.aborts == worker.started  # Worker.Abort named the request the worker was running
            assert worker.cancelled == worker.started and worker.finished == []
            assert worker.running == 0
            listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
            assert listed.workers[0].in_flight == 0

    run(scenario())


def test_streams_beyond_the_gateway_limit_are_resource_exhausted(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, max_concurrent_streams=2) as stack:
            await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.3)
            open_streams = [asyncio.create_task(stack.generate(f"p{i}")) for i in range(2)]
            while stack.gateway.gateway.open_streams < 2:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate("third")
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_streams" in raised.value.details() and "2" in raised.value.details()
            for replies in await asyncio.gather(*open_streams):
                assert replies[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
            assert len(await stack.generate("now there is room")) == 3

    run(scenario())


def test_workers_that_answer_full_are_tried_in_turn_and_stay_healthy(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            full = await stack.add_worker(artifacts.stable, tokens=2)
            spare = await stack.add_worker(artifacts.stable, tokens=2)
            full.worker.full = True
            for i in range(3):
                assert len(await stack.generate(f"p{i}")) == 2
            assert len(spare.worker.finished) == 3
            spare.worker.full = True
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate("both full")
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "admission limit" in raised.value.details()
            listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
            assert {w.health for w in listed.workers} == {gateway_pb2.WORKER_HEALTH_HEALTHY}

    run(scenario())


def test_a_worker_refusing_as_it_begins_to_drain_is_not_counted_as_failing(artifacts):
    """Between the start of a worker's drain and the heartbeat that says so, the gateway may send it a request;
    its refusal (UNAVAILABLE marked draining) sends the request elsewhere, is no error of the arm (a routine
    drain would count against a canary's guard) and leaves the worker draining, not unhealthy. An UNAVAILABLE
    without the mark is a failure, counted."""
    async def scenario():
        async with gateway_stack(artifacts, quarantine=Quarantine(after_failures=1, first_s=30, max_s=60)) as stack:
            leaving = await stack.add_worker(artifacts.stable, tokens=2, capacity=2)
            other = await stack.add_worker(artifacts.stable, tokens=2, capacity=2)
            stack.gateway.pool.acquire(stack.gateway.pool.get(other.worker_id))  # half full: the other is picked first
            leaving.worker.refuse_draining = True
            assert len(await stack.generate("p")) == 2
            assert len(leaving.worker.started) == 1
            assert await stack.generate("q") and len(leaving.worker.started) == 1  # not asked again
            stable = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert (stable.requests, stable.errors) == (2, 0)
            pooled = stack.gateway.pool.get(leaving.worker_id)
            assert pooled.health is Health.DRAINING and pooled.failure_streak == 0 and not pooled.quarantined_until
            # the heartbeat that follows says draining; once it serves again, an unmarked UNAVAILABLE counts
            stack.gateway.pool.heartbeat(leaving.worker_id, 0, 0, 1, draining=False)
            leaving.worker.refuse_draining, leaving.worker.fail_before_first = False, True
            assert len(await stack.generate("r")) == 2
            stable = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert (stable.requests, stable.errors) == (4, 1)
            assert pooled.failure_streak == 1

    run(scenario())


def test_a_request_the_worker_aborts_itself_is_a_failed_attempt_not_a_finish(artifacts):
    """A worker whose drain's grace ran out (or whose engine stops) ends the streams it still holds with an OK final
    message of reason ABORT. It was relayed as a finished request: an empty stream to the client while a healthy
    worker could serve it, cut-short text taken for a whole one, and the worker's record cleared as a success.
    Before any token the request goes to another worker; after tokens the stream ends UNAVAILABLE with the count,
    as for any worker failing mid-stream. The worker, leaving, gets no new requests; no error of its arm."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            leaving = await stack.add_worker(artifacts.stable, tokens=5, capacity=4)
            other = await stack.add_worker(artifacts.stable, tokens=5, capacity=4)
            pool = stack.gateway.pool
            pool.acquire(pool.get(other.worker_id))  # busier: the leaving worker is picked first
            leaving.worker.abort_after = 0
            replies = await stack.generate("p")
            assert tokens_of(replies) == expected_tokens(list(b"p"), 5)
            assert replies[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
            assert (len(leaving.worker.started), len(other.worker.started)) == (1, 1)
            assert pool.get(leaving.worker_id).health is Health.DRAINING
            stable = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert (stable.requests, stable.errors) == (1, 0)

            pool.heartbeat(leaving.worker_id, 0, 0, 4, draining=False)  # serving again, then aborting after 2 tokens
            leaving.worker.abort_after = 2
            pool.acquire(pool.get(other.worker_id))
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for reply in stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT,
                                                                                        text="abc")):
                    received.extend(reply.token_ids)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "after 2 tokens were delivered" in raised.value.details(), raised.value.details()
            assert received == expected_tokens(list(b"abc"), 5)[:2]
            assert (len(leaving.worker.started), len(other.worker.started)) == (2, 1)  # not replayed elsewhere

    run(scenario())


def test_a_failure_before_the_other_workers_turned_out_full_still_counts_against_its_arm(artifacts):
    """The canary's one free worker fails the request before any token and its other worker is at capacity:
    the client is told to retry later (RESOURCE_EXHAUSTED), and the failure still counts as the canary's
    error, or a canary failing under load would be invisible to the guard and to RolloutStatus."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            broken = await stack.add_worker(artifacts.canary, capacity=4)
            broken.worker.fail_before_first = True
            busy = await stack.add_worker(artifacts.canary, capacity=1)
            stack.gateway.pool.acquire(stack.gateway.pool.get(busy.worker_id))  # a stream open on it
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate()
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert len(broken.worker.started) == 1 and not busy.worker.started
            canary = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0)
            assert (canary.requests, canary.errors) == (1, 1)

    run(scenario())


class _InProcessContext:
    """The servicer context of a Generate driven in-process (no api keys configured)."""

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_a_stream_closed_at_a_yield_releases_its_worker_at_once(artifacts):
    """grpc closes a servicer's stream generator where it waits at a yield (the client went away while
    a reply was being written). The inner generators must run their finally right then (worker call
    cancelled, Worker.Abort sent, pool slot released), not when the garbage collector reaches them."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = (await stack.add_worker(artifacts.stable, tokens=50, delay_s=0.05)).worker
            servicer, pool = stack.gateway.gateway, stack.gateway.pool
            stream = servicer.Generate(gateway_pb2.GatewayGenerateRequest(deployment="chat", text="long"),
                                       _InProcessContext())
            first = await stream.__anext__()
            assert first.token_ids
            pooled = pool.get(stack.workers[0].worker_id)
            assert pooled.in_flight == 1 and servicer.open_streams == 1
            await stream.aclose()  # no loop turn after this before the checks
            # the stream's slot is released; the Worker.Abort it sent holds the worker until it returns
            assert not pooled.stream_enders and pooled.in_flight == len(servicer._aborts) == 1
            assert servicer.open_streams == 0
            for _ in range(50):
                if worker.aborts and pooled.in_flight == 0:
                    break
                await asyncio.sleep(0.02)
            assert worker.aborts == worker.started and pooled.in_flight == 0

    run(scenario())

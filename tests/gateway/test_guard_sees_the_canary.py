"""The canary guard gets to see a failing canary, and only the canary's own failures: its only worker keeps
its requests while failing them, a ramp of the same canary keeps what was measured, and a request the canary
refused is judged by the stable alone."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.gateway.config import FallbackBudget
from services.gateway.router import bucket_of
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, gateway_stack, run

# Session keys the router sends to the canary at any percentage from 1 (their bucket is under 1%), and one it
# sends to the stable at 10%.
CANARY_KEYS = [k for k in (f"k{i}" for i in range(20000)) if bucket_of(DEPLOYMENT, k) < 100]
STABLE_KEY = next(k for k in (f"s{i}" for i in range(5000)) if bucket_of(DEPLOYMENT, k) >= 1000)


async def _start(stack, canary: str, percent: int) -> None:
    await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
        deployment=DEPLOYMENT, canary_artifact_id=canary, canary_percent=percent), metadata=ADMIN)


async def _send(stack, n: int, first: int = 0) -> None:
    for key in CANARY_KEYS[first : first + n]:
        try:
            await stack.generate("x", session_key=key)
        except grpc.aio.AioRpcError:
            pass


def test_a_canary_whose_only_worker_fails_every_request_is_aborted(artifacts):
    """Each failure took the worker out until its next heartbeat: its share went to the stable meanwhile, the
    guard saw one failure per heartbeat (15 in a 30 s window under the defaults) and never judged it (20)."""

    async def body():
        async with gateway_stack(artifacts, budget=FallbackBudget(), fallback_check_s=3600) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            canary = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
            canary.worker.fail_after = 1  # every request fails after its first token
            await _start(stack, artifacts.canary, 5)
            await _send(stack, 24)  # no heartbeat meanwhile
            assert stack.gateway.pool.get(canary.worker_id).failure_streak == 24  # every one reached it
            assert await stack.gateway.fallback.check() == [DEPLOYMENT]
            assert not (await stack.deployment()).HasField("canary")

    run(body())


def test_a_worker_with_a_healthy_peer_is_still_taken_out_after_a_failure(artifacts):
    async def body():
        async with gateway_stack(artifacts) as stack:
            first = await stack.add_worker(artifacts.canary)
            second = await stack.add_worker(artifacts.canary)
            pool = stack.gateway.pool
            pool.mark_failed(pool.get(first.worker_id), "boom")
            assert [w.worker_id for w in pool.healthy(artifacts.canary)] == [second.worker_id]
            pool.mark_failed(pool.get(second.worker_id), "boom")  # now the last one: it keeps its requests
            assert [w.worker_id for w in pool.healthy(artifacts.canary)] == [second.worker_id]

    run(body())


def test_ramping_the_same_canary_keeps_what_the_guard_measured(artifacts):
    """Each percentage change restarted the window: ramped every 12 requests, a canary failing all of its
    requests reached 100% without ever being judged (20 requests needed)."""

    async def body():
        async with gateway_stack(artifacts, budget=FallbackBudget(), fallback_check_s=3600) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            canary = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
            canary.worker.fail_after = 1
            percent, acted = 5, []
            await _start(stack, artifacts.canary, percent)
            for step in range(4):
                await _send(stack, 12, first=12 * step)
                acted = await stack.gateway.fallback.check()
                if acted:
                    break
                percent = min(100, percent * 3)
                await _start(stack, artifacts.canary, percent)
            assert acted == [DEPLOYMENT] and step == 1  # judged once 20 requests were in, across the ramp
            assert not (await stack.deployment()).HasField("canary")

    run(body())


def test_a_refusal_the_busy_stable_could_not_judge_is_the_clients_and_charges_no_one(artifacts):
    """The stable full, the canary's refusal went on to the fp16 baseline, which served it: the canary, as strict as
    the stable, was charged an error for each and aborted."""

    async def body():
        budget = FallbackBudget(max_error_rate=0.2, window_s=30.0, min_requests=10)
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=3600) as stack:
            stable = await stack.add_worker(artifacts.stable, capacity=1, tokens=2, delay_s=0.05)
            canary = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
            stable.worker.max_prompt_tokens = canary.worker.max_prompt_tokens = 4
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            await _start(stack, artifacts.canary, 10)
            busy = asyncio.create_task(stack.generate("ok", session_key=STABLE_KEY, max_new_tokens=200))
            await asyncio.sleep(0.3)  # the stable's one slot is taken
            codes = []
            for key in CANARY_KEYS[:12]:
                try:
                    await stack.generate("a prompt that is too long", session_key=key)
                    codes.append("served")
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code().name)
            assert codes == ["INVALID_ARGUMENT"] * 12
            assert stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, 0, 2e9).errors == 0
            assert await stack.gateway.fallback.check() == []
            busy.cancel()

    run(body())


def test_a_guard_aborted_canary_needs_force_even_after_another_rollout(artifacts):
    """Only the deployment's last rollout event was looked at: a canary the guard aborted, then another canary
    started and aborted by hand, and the first started again without --force."""

    async def body():
        budget = FallbackBudget(max_error_rate=0.2, window_s=30.0, min_requests=10)
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=3600) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            canary = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
            canary.worker.fail_after = 1
            await _start(stack, artifacts.canary, 10)
            await _send(stack, 12)
            assert await stack.gateway.fallback.check() == [DEPLOYMENT]
            await _start(stack, artifacts.baseline, 10)  # another READY artifact of the model, aborted by hand
            await stack.admin.AbortRollout(gateway_pb2.AbortRolloutRequest(deployment=DEPLOYMENT, reason="not now"),
                                           metadata=ADMIN)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _start(stack, artifacts.canary, 10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "aborted by the automatic guard" in refused.value.details()
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=10, force=True),
                metadata=ADMIN)
            assert (await stack.deployment()).canary.artifact_id == artifacts.canary

    run(body())

"""Canary rollouts: the sticky split, promote and abort, the metrics of RolloutStatus."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, arm_of, gateway_stack, run

KEYS = [f"user-{i}" for i in range(400)]


async def arms_by_key(stack, keys, batch: int = 50) -> dict[str, int]:
    arms = {}
    for start in range(0, len(keys), batch):
        chunk = keys[start:start + batch]
        results = await asyncio.gather(*(stack.generate("q", session_key=k, max_new_tokens=1) for k in chunk))
        arms.update({k: arm_of(r) for k, r in zip(chunk, results)})
    return arms


async def start_rollout(stack, canary: str, percent: int) -> gateway_pb2.Deployment:
    return await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
        deployment=DEPLOYMENT, canary_artifact_id=canary, canary_percent=percent), metadata=ADMIN)


def test_canary_split_is_near_its_percent_and_sticky_per_session_key(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            stable = await stack.add_worker(artifacts.stable, tokens=1, max_running=64)
            canary = await stack.add_worker(artifacts.canary, tokens=1, max_running=64)
            deployment = await start_rollout(stack, artifacts.canary, 20)
            assert deployment.canary.artifact_id == artifacts.canary and deployment.canary_percent == 20
            first = await arms_by_key(stack, KEYS)
            share = sum(arm == gateway_pb2.ARM_CANARY for arm in first.values()) / len(KEYS)
            assert 0.15 <= share <= 0.25, share
            assert len(canary.worker.started) == round(share * 400) and len(stable.worker.started) == 400 - len(
                canary.worker.started)
            again = await arms_by_key(stack, KEYS)
            assert again == first  # every key reached the same version both times
            # a larger share keeps every canary key on the canary (buckets are only added)
            await start_rollout(stack, artifacts.canary, 50)
            wider = await arms_by_key(stack, KEYS)
            assert all(wider[k] == gateway_pb2.ARM_CANARY for k, arm in first.items() if arm == gateway_pb2.ARM_CANARY)
            assert 0.43 <= sum(a == gateway_pb2.ARM_CANARY for a in wider.values()) / len(KEYS) <= 0.57

    run(scenario(), timeout_s=60)


def test_without_a_session_key_the_split_is_drawn_per_request(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable, tokens=1, max_running=64)
            await stack.add_worker(artifacts.canary, tokens=1, max_running=64)
            await start_rollout(stack, artifacts.canary, 50)
            results = await asyncio.gather(*(stack.generate("same prompt", max_new_tokens=1) for _ in range(60)))
            canary = sum(arm_of(r) == gateway_pb2.ARM_CANARY for r in results)
            assert 10 <= canary <= 50, canary  # 50% of 60: far outside this range once in ~10^5 runs

    run(scenario())


def test_promote_and_abort_take_effect_at_once_and_are_logged(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable, tokens=1, max_running=64)
            await stack.add_worker(artifacts.canary, tokens=1, max_running=64)
            await start_rollout(stack, artifacts.canary, 30)
            aborted = await stack.admin.AbortRollout(gateway_pb2.AbortRolloutRequest(
                deployment=DEPLOYMENT, reason="canary looks slow"), metadata=ADMIN)
            assert not aborted.HasField("canary") and aborted.canary_percent == 0
            assert set((await arms_by_key(stack, KEYS[:100])).values()) == {gateway_pb2.ARM_STABLE}
            await start_rollout(stack, artifacts.canary, 30)
            await arms_by_key(stack, KEYS[:100])  # a canary is promoted once it has served requests
            promoted = await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT),
                                                        metadata=ADMIN)
            assert promoted.stable.artifact_id == artifacts.canary and not promoted.HasField("canary")
            results = await asyncio.gather(*(stack.generate("q", session_key=k, max_new_tokens=1) for k in KEYS[:100]))
            assert {r[0].artifact_id for r in results} == {artifacts.canary}
            assert {arm_of(r) for r in results} == {gateway_pb2.ARM_STABLE}
            events = (await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT),
                                                   metadata=ADMIN)).events
            assert [e.kind for e in events] == ["promote", "rollout_start", "abort", "rollout_start",
                                                "deployment_create"]  # newest first
            assert {e.actor for e in events} == {"ops"}
            assert json.loads(events[2].detail)["reason"] == "canary looks slow"
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT),
                                                 metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    run(scenario())


def test_a_promote_naming_the_reviewed_canary_is_refused_once_another_canary_replaced_it(artifacts):
    """Operator A reviews canary X; meanwhile B (or the guard) aborts X and B starts Y. A's promote of X
    must not make the untested Y the stable."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await start_rollout(stack, artifacts.canary, 10)
            await stack.admin.AbortRollout(gateway_pb2.AbortRolloutRequest(deployment=DEPLOYMENT), metadata=ADMIN)
            await start_rollout(stack, artifacts.baseline, 10)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(
                    deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, force=True), metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert artifacts.baseline in raised.value.details() and artifacts.canary in raised.value.details()
            unchanged = await stack.deployment()
            assert unchanged.stable.artifact_id == artifacts.stable and unchanged.canary.artifact_id == artifacts.baseline
            promoted = await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.baseline, force=True), metadata=ADMIN)
            assert promoted.stable.artifact_id == artifacts.baseline and not promoted.HasField("canary")

    run(scenario())


def test_a_canary_a_person_aborted_can_be_started_again_without_force(artifacts):
    """Only the automatic guard's abort asks for force: an operator's own abort is their decision."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await start_rollout(stack, artifacts.canary, 10)
            await stack.admin.AbortRollout(gateway_pb2.AbortRolloutRequest(deployment=DEPLOYMENT), metadata=ADMIN)
            assert (await start_rollout(stack, artifacts.canary, 20)).canary_percent == 20

    run(scenario())


def test_start_rollout_rejects_what_cannot_be_a_canary(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            cases = ((artifacts.canary, 0, grpc.StatusCode.INVALID_ARGUMENT),
                     (artifacts.canary, 101, grpc.StatusCode.INVALID_ARGUMENT),
                     ("", 10, grpc.StatusCode.INVALID_ARGUMENT),
                     ("f" * 32, 10, grpc.StatusCode.NOT_FOUND),
                     (artifacts.pending, 10, grpc.StatusCode.FAILED_PRECONDITION),
                     (artifacts.other_model, 10, grpc.StatusCode.FAILED_PRECONDITION),
                     (artifacts.stable, 10, grpc.StatusCode.FAILED_PRECONDITION))
            for canary, percent, code in cases:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await start_rollout(stack, canary, percent)
                assert raised.value.code() == code, (canary, percent, raised.value.details())
            await start_rollout(stack, artifacts.canary, 10)
            with pytest.raises(grpc.aio.AioRpcError) as raised:  # another canary while one is in progress
                await start_rollout(stack, artifacts.baseline, 10)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "promote or abort" in raised.value.details()

    run(scenario())


def test_rollout_status_shows_both_arms_side_by_side(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable, tokens=4, max_running=64)
            broken_canary = await stack.add_worker(artifacts.canary, tokens=4, max_running=64)
            await start_rollout(stack, artifacts.canary, 50)
            broken_canary.worker.fail_after = 1  # every canary request fails after one token
            results = await asyncio.gather(*(stack.generate("q", session_key=k) for k in KEYS[:40]),
                                           return_exceptions=True)
            failed = sum(isinstance(r, grpc.aio.AioRpcError) for r in results)
            status = await stack.admin.RolloutStatus(gateway_pb2.RolloutStatusRequest(deployment=DEPLOYMENT),
                                                     metadata=ADMIN)
            assert status.stable.artifact.artifact_id == artifacts.stable
            assert status.canary.artifact.artifact_id == artifacts.canary
            assert status.baseline.artifact.artifact_id == artifacts.baseline
            assert status.stable.requests + status.canary.requests == 40
            assert status.canary.errors == status.canary.requests == failed > 0
            assert status.canary.error_rate == 1.0 and status.stable.errors == 0
            assert status.stable.generated_tokens == 4 * status.stable.requests
            assert status.stable.ttft_p95.ToNanoseconds() >= status.stable.ttft_p50.ToNanoseconds() > 0
            assert status.stable.healthy_workers == 1 and status.baseline.healthy_workers == 0
            assert status.window_start.ToSeconds() > 0

    run(scenario())


def test_a_promote_that_would_send_all_traffic_to_an_artifact_no_worker_serves_is_refused(artifacts):
    """A canary whose workers all died (RolloutStatus: no requests, no healthy workers) was promoted all
    the same, and its traffic went to the baseline or was refused. Refused now, unless forced."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)
            await start_rollout(stack, artifacts.canary, 10)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT),
                                                 metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"no healthy worker serves artifact {artifacts.canary}" in raised.value.details()
            assert (await stack.deployment()).stable.artifact_id == artifacts.stable  # nothing changed
            await stack.add_worker(artifacts.canary)
            await arms_by_key(stack, KEYS[:100])
            promoted = await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT),
                                                        metadata=ADMIN)
            assert promoted.stable.artifact_id == artifacts.canary

    run(scenario())


def test_a_canary_that_has_served_no_request_is_not_promoted_unless_forced(artifacts):
    """Promoted at once, a canary at a small percentage that had got no request yet, or one answering every
    request "full" (its traffic served by the stable; no error counted against it), took all of the traffic."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)
            canary = await stack.add_worker(artifacts.canary)
            canary.worker.full = True
            await start_rollout(stack, artifacts.canary, 50)
            arms = await arms_by_key(stack, KEYS[:40])
            assert set(arms.values()) == {gateway_pb2.ARM_STABLE} and canary.worker.started  # it was asked
            promote = gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.PromoteRollout(promote, metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"canary {artifacts.canary} has served no request" in raised.value.details()
            assert (await stack.deployment()).canary.artifact_id == artifacts.canary  # nothing changed
            canary.worker.full = False
            await arms_by_key(stack, KEYS[:40])
            assert (await stack.admin.PromoteRollout(promote, metadata=ADMIN)).stable.artifact_id == artifacts.canary

            await start_rollout(stack, artifacts.stable, 1)  # back, at 1%: none of it served yet
            forced = await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(
                deployment=DEPLOYMENT, force=True), metadata=ADMIN)
            assert forced.stable.artifact_id == artifacts.stable

    run(scenario())


def test_a_forced_promote_goes_through_without_workers(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await start_rollout(stack, artifacts.canary, 10)
            promoted = await stack.admin.PromoteRollout(gateway_pb2.PromoteRolloutRequest(
                deployment=DEPLOYMENT, force=True), metadata=ADMIN)
            assert promoted.stable.artifact_id == artifacts.canary

    run(scenario())

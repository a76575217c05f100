"""The fallback switch: by hand (within a second, also through another gateway process sharing the
registry); and the automatic guard on the error-rate, time-per-output-token and TTFT budgets (a bad canary
is aborted, a bad quantized stable falls back to the baseline)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
import pytest

from services.gateway.config import FallbackBudget
from services.gateway.fallback import AutoFallback
from services.gateway.metrics import Outcome
from shared import registry as reg
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, arm_of, gateway_stack, run

KEYS = [f"k{i}" for i in range(30)]


async def set_fallback(stack, enabled: bool, reason: str, force: bool = False) -> gateway_pb2.Deployment:
    return await stack.admin.SetFallback(gateway_pb2.SetFallbackRequest(
        deployment=DEPLOYMENT, enabled=enabled, reason=reason, force=force), metadata=ADMIN)


async def events(stack) -> list[gateway_pb2.Event]:
    return list((await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT),
                                              metadata=ADMIN)).events)


def test_fallback_switch_moves_all_traffic_to_the_baseline_and_back(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable, tokens=1, max_running=64)
            await stack.add_worker(artifacts.canary, tokens=1, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=1, max_running=64)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=50), metadata=ADMIN)
            on = await set_fallback(stack, True, "incident 42")
            assert on.fallback and on.fallback_reason == "incident 42"
            results = await asyncio.gather(*(stack.generate("q", session_key=k, max_new_tokens=1) for k in KEYS))
            assert {arm_of(r) for r in results} == {gateway_pb2.ARM_BASELINE}
            assert {r[0].artifact_id for r in results} == {artifacts.baseline}
            again = await set_fallback(stack, True, "said twice")  # idempotent: logs nothing new
            assert again.fallback_reason == "incident 42"
            off = await set_fallback(stack, False, "resolved")
            assert not off.fallback and off.fallback_reason == "resolved"
            results = await asyncio.gather(*(stack.generate("q", session_key=k, max_new_tokens=1) for k in KEYS))
            assert {arm_of(r) for r in results} == {gateway_pb2.ARM_STABLE, gateway_pb2.ARM_CANARY}
            log = [(e.kind, e.actor, json.loads(e.detail).get("reason")) for e in await events(stack)][:2]
            assert log == [("fallback_off", "ops", "resolved"), ("fallback_on", "ops", "incident 42")]

    run(scenario())


def test_a_switch_made_through_another_gateway_takes_effect_within_a_second(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as serving, gateway_stack(artifacts, create_deployment=False) as other:
            await serving.add_worker(artifacts.stable, tokens=1)
            await serving.add_worker(artifacts.baseline, tokens=1)
            assert arm_of(await serving.generate(max_new_tokens=1)) == gateway_pb2.ARM_STABLE
            switched = time.monotonic()
            await set_fallback(other, True, "from the other gateway", force=True)  # its pool is empty
            while arm_of(await serving.generate(max_new_tokens=1)) != gateway_pb2.ARM_BASELINE:
                assert time.monotonic() - switched < 1.0, "fallback did not take effect within a second"
                await asyncio.sleep(0.02)
            await set_fallback(other, False, "back")
            while arm_of(await serving.generate(max_new_tokens=1)) != gateway_pb2.ARM_STABLE:
                assert time.monotonic() - switched < 2.0, "fallback off did not take effect within a second"
                await asyncio.sleep(0.02)

    run(scenario())


async def _drive_failing_canary(stack, artifacts, requests: int = 12):
    """A canary at 100% whose worker fails after one token; each request heartbeats it first so
    the pool keeps it healthy and every request reaches it."""
    failing = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
    failing.worker.fail_after = 1
    await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
        deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
    for i in range(requests):
        await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=failing.worker_id), metadata=ADMIN)
        try:
            await stack.generate(f"p{i}")
        except grpc.aio.AioRpcError:
            pass


async def _until(stack, done, seconds: float = 2.0) -> gateway_pb2.Deployment:
    deployment = await stack.deployment()
    for _ in range(int(seconds / 0.05)):
        if done(deployment):
            break
        await asyncio.sleep(0.05)
        deployment = await stack.deployment()
    return deployment


def test_a_canary_breaking_the_error_budget_is_aborted_and_the_stable_keeps_serving(artifacts):
    """A bad canary is taken out by itself; the vetted stable keeps its traffic (no fallback)."""
    budget = FallbackBudget(max_error_rate=0.2, max_tpot_p95_s=10.0, window_s=30.0, min_requests=10)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            await _drive_failing_canary(stack, artifacts)
            deployment = await _until(stack, lambda d: not d.HasField("canary"))
            assert not deployment.HasField("canary") and not deployment.fallback
            newest = await events(stack)
            assert (newest[0].kind, newest[0].actor) == ("abort", "auto")
            reason = json.loads(newest[0].detail)["reason"]
            assert "error rate" in reason and artifacts.canary in reason
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_STABLE

            # A start (or a percentage change meant for the canary just aborted) does not bring it back
            # unless forced: the guard's decision is undone only on purpose.
            restart = gateway_pb2.StartRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary,
                                                      canary_percent=50)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.admin.StartRollout(restart, metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "aborted by the automatic guard" in raised.value.details() and "error rate" in raised.value.details()
            assert not (await stack.deployment()).HasField("canary")
            restart.force = True
            assert (await stack.admin.StartRollout(restart, metadata=ADMIN)).canary_percent == 50

    run(scenario())


def test_a_canary_failing_before_the_first_token_is_aborted_though_its_requests_succeed_elsewhere(artifacts):
    """Every canary request fails before any token and is served by the stable instead: the client sees
    no error, but each failed attempt counts against the canary, so the guard still takes it out."""
    budget = FallbackBudget(max_error_rate=0.2, max_tpot_p95_s=10.0, window_s=30.0, min_requests=10)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            broken = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
            broken.worker.fail_before_first = True
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            for i in range(12):
                await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=broken.worker_id), metadata=ADMIN)
                assert arm_of(await stack.generate(f"p{i}")) == gateway_pb2.ARM_STABLE
            assert len(broken.worker.started) >= 10
            deployment = await _until(stack, lambda d: not d.HasField("canary"))
            assert not deployment.HasField("canary") and not deployment.fallback
            newest = await events(stack)
            assert (newest[0].kind, newest[0].actor) == ("abort", "auto")
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_STABLE

    run(scenario())


# A stable worker that answers at 50 ms per token breaks this 20 ms TPOT budget.
SLOW_STABLE_BUDGET = FallbackBudget(max_error_rate=0.5, max_tpot_p95_s=0.02, window_s=30.0, min_requests=5)


def test_a_stable_over_budget_falls_back_and_aborts_the_canary_too(artifacts):
    """The quantized stable itself breaks the budget while a canary runs: everything to the baseline."""
    async def scenario():
        async with gateway_stack(artifacts, budget=SLOW_STABLE_BUDGET, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.05, max_running=64)
            await stack.add_worker(artifacts.canary, tokens=3, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=3, max_running=64)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=10), metadata=ADMIN)
            # session keys that stay on the stable (90% of buckets), enough to pass min_requests
            await asyncio.gather(*(stack.generate(f"p{i}", session_key=f"s{i}") for i in range(30)))
            deployment = await _until(stack, lambda d: d.fallback)
            assert deployment.fallback and not deployment.HasField("canary")
            assert "stable" in deployment.fallback_reason and "time per output token p95" in deployment.fallback_reason
            kinds = [(e.kind, e.actor) for e in await events(stack)]
            assert kinds[:2] == [("fallback_on", "auto"), ("abort", "auto")]
            abort = json.loads((await events(stack))[1].detail)
            assert abort["judged"] is False and abort["reason"].startswith("the stable fell back to the baseline: ")
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_BASELINE
            # The canary was never found over budget (it may be the stable's fix): once the fallback is off it
            # starts again without force, unlike a canary the guard aborted for its own breach.
            await set_fallback(stack, False, "stable fixed")
            restarted = await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=10), metadata=ADMIN)
            assert restarted.canary.artifact_id == artifacts.canary

    run(scenario())


def test_a_canary_slow_to_fail_is_aborted_and_its_delay_is_not_the_stables_ttft(artifacts):
    """Requests a canary fails before its first token (after 150 ms each: dying in prefill) are served by the
    stable; measured from their arrival, the stable's TTFT carried the canary's delay, and the guard (which
    judges the stable first) fell the whole deployment back to fp16 for the canary's fault."""
    budget = FallbackBudget(max_error_rate=0.1, max_tpot_p95_s=10.0, max_ttft_p95_s=0.1, window_s=30.0,
                            min_requests=10, enabled=False)  # judged by hand below
    async def scenario():
        async with gateway_stack(artifacts, budget=budget) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=2, max_running=64)
            canary = await stack.add_worker(artifacts.canary, tokens=2, max_running=64)
            canary.worker.fail_before_first, canary.worker.fail_delay_s = True, 0.15
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=20), metadata=ADMIN)
            for i in range(60):
                stack.gateway.pool.heartbeat(canary.worker_id, 0, 0, 1, draining=False)  # failing, yet alive
                await stack.generate(f"p{i}", session_key=f"user-{i}")  # every client served, by the stable
            stable = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0.0)
            assert stable.requests == 60 and stable.ttft_p95_s < 0.1
            assert stack.gateway.metrics.stats(DEPLOYMENT, artifacts.canary, since=0.0).errors >= 5
            await stack.gateway.fallback.check()
            deployment = await stack.deployment()
            assert not deployment.fallback and not deployment.HasField("canary")  # the canary alone aborted
            abort = json.loads((await events(stack))[0].detail)
            assert abort["canary"] == artifacts.canary and abort.get("judged", True)

    run(scenario(), timeout_s=60)


def test_a_latency_p95_is_judged_only_over_enough_samples(artifacts):
    """min_requests counted every finished request, while a p95 is taken over those with that time: among 19
    one-token requests (scoring traffic: no TPOT), one slow generation made the TPOT "p95" and fell a healthy
    stable back to fp16. With min_requests slow samples it does."""
    budget = FallbackBudget(max_error_rate=0.1, max_tpot_p95_s=0.5, window_s=30.0, min_requests=20, enabled=False)

    def served(tpot_s, tokens):
        return Outcome(at=time.time(), server_error=False, ttft_s=0.05, tpot_s=tpot_s, tokens=tokens)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget) as stack:
            await stack.add_worker(artifacts.stable)
            await stack.add_worker(artifacts.baseline)
            metrics = stack.gateway.metrics
            for _ in range(19):
                metrics.record(DEPLOYMENT, "stable", artifacts.stable, served(None, 1))
            metrics.record(DEPLOYMENT, "stable", artifacts.stable, served(0.6, 50))
            assert await stack.gateway.fallback.check() == [] and not (await stack.deployment()).fallback
            for _ in range(19):
                metrics.record(DEPLOYMENT, "stable", artifacts.stable, served(0.6, 50))
            assert await stack.gateway.fallback.check() == [DEPLOYMENT]
            assert "time per output token p95" in (await stack.deployment()).fallback_reason

    run(scenario())


def test_a_stable_breaking_the_tpot_budget_triggers_fallback_once(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, budget=SLOW_STABLE_BUDGET, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.05, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=3, max_running=64)
            await asyncio.gather(*(stack.generate(f"p{i}") for i in range(4)))
            await asyncio.sleep(0.3)
            assert not (await stack.deployment()).fallback  # 4 requests: below min_requests, no verdict yet
            await stack.generate("p5")
            deployment = await _until(stack, lambda d: d.fallback)
            assert deployment.fallback and "time per output token p95" in deployment.fallback_reason
            # an operator turns it off: what was measured before does not trip it again
            await set_fallback(stack, False, "checked, fine")
            await asyncio.sleep(0.3)
            assert not (await stack.deployment()).fallback
            kinds = [(e.kind, e.actor) for e in await events(stack)]
            assert kinds[:2] == [("fallback_off", "ops"), ("fallback_on", "auto")]

    run(scenario())


def test_healthy_traffic_within_budget_never_falls_back(artifacts):
    budget = FallbackBudget(max_error_rate=0.1, max_tpot_p95_s=1.0, window_s=30.0, min_requests=5)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=3, max_running=64)
            await stack.add_worker(artifacts.baseline, tokens=3, max_running=64)
            await asyncio.gather(*(stack.generate(f"p{i}") for i in range(20)))
            await asyncio.sleep(0.3)
            assert not (await stack.deployment()).fallback

    run(scenario())


def test_the_guard_does_not_act_on_a_deployment_changed_since_its_verdict(artifacts):
    """The guard judges a cached snapshot (up to deployment_cache_s old, changes made through another
    gateway arrive late). A canary breached its budget; the operator aborted it and started another
    canary meanwhile. The guard must not abort the new canary for the old one's figures."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)  # somewhere to send an aborted canary's traffic
            with stack.gateway.registry.transaction() as session:
                version = reg.register_model_version(session, "tiny", "e" * 64, label="v3")
                other = reg.reserve_artifact(session, version.id, "w4a8kv4-g128", "cpu").artifact
                other_canary = reg.mark_artifact_ready(session, other.id, manifest_sha256="b" * 64,
                                                       content_digest=uuid.uuid4().hex, actor="test").id
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=50), metadata=ADMIN)
            await asyncio.sleep(0.01)
            for _ in range(5):  # the canary fails every request
                stack.gateway.metrics.record(DEPLOYMENT, "canary", artifacts.canary, Outcome(
                    at=time.time(), server_error=True, ttft_s=None, tpot_s=None, tokens=0))
            cache = stack.gateway.deployments
            stale = await cache.get(DEPLOYMENT)
            assert stale.canary.artifact_id == artifacts.canary
            # through another gateway: abort the bad canary, start another one
            with stack.gateway.registry.transaction() as session:
                reg.abort_rollout(session, DEPLOYMENT, actor="ops", reason="bad")
                reg.start_rollout(session, DEPLOYMENT, canary_artifact_id=other_canary, percent=5, actor="ops")
            cache.put(stale)  # this gateway has not seen that change yet
            guard = AutoFallback(stack.gateway.registry, cache, stack.gateway.metrics,
                                 FallbackBudget(max_error_rate=0.1, max_tpot_p95_s=10.0, window_s=30.0, min_requests=3),
                                 stack.gateway.pool)
            await guard.check()
            deployment = await stack.deployment()
            assert deployment.canary.artifact_id == other_canary and deployment.canary_percent == 5, \
                "the guard aborted a canary it never measured"

    run(scenario())


def _failures(stack, arm: str, artifact_id: str, count: int) -> None:
    """Requests of this arm that failed on the serving side, as the gateway records them."""
    for _ in range(count):
        stack.gateway.metrics.record(DEPLOYMENT, arm, artifact_id, Outcome(
            at=time.time(), server_error=True, ttft_s=None, tpot_s=None, tokens=0))


# Checked by hand (guard.check()), so that what a pass decides does not depend on when the loop runs.
HAND_RUN_GUARD = FallbackBudget(max_error_rate=0.1, max_tpot_p95_s=10.0, window_s=30.0, min_requests=3,
                                enabled=False)


def test_the_guard_does_not_fall_back_to_a_baseline_no_worker_serves(artifacts):
    """A quantized stable over budget, and the fp16 baseline has no worker: fallback would turn a
    degraded deployment into one that refuses every request. The guard holds off, and falls back once
    a baseline worker is there."""
    async def scenario():
        async with gateway_stack(artifacts, budget=HAND_RUN_GUARD) as stack:
            await stack.add_worker(artifacts.stable)
            await asyncio.sleep(0.01)  # the failures below come after the deployment's last change
            _failures(stack, "stable", artifacts.stable, 5)
            guard = stack.gateway.fallback
            assert await guard.check() == []
            assert not (await stack.deployment()).fallback
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_STABLE
            await stack.add_worker(artifacts.baseline)
            assert await guard.check() == [DEPLOYMENT]
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_BASELINE

    run(scenario())


def test_the_guard_does_not_abort_a_canary_when_nothing_else_can_serve_its_traffic(artifacts):
    """A canary at 100% over budget while neither the stable nor the baseline has a worker: aborting it
    would send all of its traffic nowhere. Held off; aborted once a stable worker is there."""
    async def scenario():
        async with gateway_stack(artifacts, budget=HAND_RUN_GUARD) as stack:
            await stack.add_worker(artifacts.canary)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            await asyncio.sleep(0.01)
            _failures(stack, "canary", artifacts.canary, 5)
            guard = stack.gateway.fallback
            assert await guard.check() == []
            assert (await stack.deployment()).canary.artifact_id == artifacts.canary
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_CANARY
            await stack.add_worker(artifacts.stable)
            assert await guard.check() == [DEPLOYMENT]
            assert not (await stack.deployment()).HasField("canary")
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_STABLE

    run(scenario())


def test_fallback_on_is_refused_while_no_worker_serves_the_baseline_unless_forced(artifacts):
    """With fallback on, every request goes to the baseline: with no baseline worker, every request is
    refused. The switch is refused (FAILED_PRECONDITION, naming the remedies) unless forced."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await set_fallback(stack, True, "drill")
            assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"no healthy worker serves artifact {artifacts.baseline}" in raised.value.details()
            assert "force" in raised.value.details()
            assert not (await stack.deployment()).fallback
            assert arm_of(await stack.generate(max_new_tokens=1)) == gateway_pb2.ARM_STABLE
            assert (await set_fallback(stack, True, "drill", force=True)).fallback
            await set_fallback(stack, False, "back")
            await stack.add_worker(artifacts.baseline)
            assert (await set_fallback(stack, True, "drill")).fallback

    run(scenario())


@pytest.mark.parametrize("ttft_budget_s", [0.02, 0.0])
def test_a_canary_slow_to_its_first_token_is_aborted_when_a_ttft_budget_is_set(artifacts, ttft_budget_s):
    """A canary answering at 50 ms a token: within the 10 s TPOT budget, over a 20 ms TTFT budget. Unset (0), TTFT
    is not judged and the canary stays."""
    budget = FallbackBudget(max_error_rate=0.5, max_tpot_p95_s=10.0, max_ttft_p95_s=ttft_budget_s, window_s=30.0,
                            min_requests=5)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget, fallback_check_s=0.05) as stack:
            await stack.add_worker(artifacts.stable, tokens=2, max_running=64)
            await stack.add_worker(artifacts.canary, tokens=2, delay_s=0.05, max_running=64)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=100), metadata=ADMIN)
            await asyncio.gather(*(stack.generate(f"p{i}") for i in range(6)))
            deployment = await _until(stack, lambda d: not d.HasField("canary"), seconds=1.0)
            if ttft_budget_s:
                assert not deployment.HasField("canary") and not deployment.fallback
                abort = next(e for e in await events(stack) if e.kind == "abort")
                assert abort.actor == "auto" and "time to first token p95" in abort.detail, abort.detail
            else:
                assert deployment.HasField("canary")

    run(scenario())


def test_a_canary_failing_at_low_traffic_is_judged_on_its_whole_run(artifacts):
    """Fewer than min_requests in any one window (a request every few seconds at the defaults): a canary failing
    every request it got was never judged, however many it had failed since its rollout started."""
    budget = FallbackBudget(max_error_rate=0.1, max_tpot_p95_s=10.0, window_s=0.2, min_requests=3, enabled=False)

    async def scenario():
        async with gateway_stack(artifacts, budget=budget) as stack:
            await stack.add_worker(artifacts.stable)
            await stack.add_worker(artifacts.canary)
            await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
                deployment=DEPLOYMENT, canary_artifact_id=artifacts.canary, canary_percent=10), metadata=ADMIN)
            guard = stack.gateway.fallback
            for failed in range(1, 4):  # one failure per window
                await asyncio.sleep(0.3)
                _failures(stack, "canary", artifacts.canary, 1)
                if failed < 3:
                    assert await guard.check() == []  # too few so far, in the window and since the start
            await asyncio.sleep(0.3)  # none in the last window now
            assert await guard.check() == [DEPLOYMENT]
            assert not (await stack.deployment()).HasField("canary")
            assert any(event.kind == "abort" and "(3/3)" in event.detail for event in await events(stack))

    run(scenario())

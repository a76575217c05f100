"""Several gateway replicas over one registry (SQLite file or PostgreSQL): an admin change made
through one replica is honoured by the other's routing within the deployment cache's bound, and the
automatic guard running on both replicas acts once and never undoes what the other did.

The bound: DeploymentCache stamps each snapshot with the time its read *started* and re-reads a
snapshot older than deployment_cache_s before routing on it (refresh() also re-reads every
deployment_cache_s / 2), so a request that starts deployment_cache_s after a change committed routes
on a snapshot read after the commit; READ_SLACK_S covers the read itself."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

import pytest

from services.gateway.config import FallbackBudget
from services.gateway.fleet import CLOCK_MARGIN_S
from services.gateway.router import bucket_of
from shared.registry import ArmSecond, create_registry, write_arm_seconds
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import (ADMIN, DEPLOYMENT, WORKER, Artifacts, FakeWorkerServer, Stack, arm_of,
                                    gateway_stack, run)

CACHE_S = 0.2  # deployment_cache_s of both replicas
READ_SLACK_S = 0.1
# Session keys outside the first 1% of buckets: on the stable arm at canary_percent 1, on the canary at 100.
KEYS = [k for k in (f"key-{i}" for i in range(200)) if bucket_of(DEPLOYMENT, k) >= 100][:8]
STABLE, CANARY, BASELINE = gateway_pb2.ARM_STABLE, gateway_pb2.ARM_CANARY, gateway_pb2.ARM_BASELINE


@pytest.fixture
def artifacts(artifacts_on_each_backend: Artifacts) -> Artifacts:
    return artifacts_on_each_backend


@asynccontextmanager
async def two_replicas(artifacts: Artifacts, **overrides) -> AsyncIterator[tuple[Stack, Stack]]:
    async with gateway_stack(artifacts, deployment_cache_s=CACHE_S, **overrides) as a, \
            gateway_stack(artifacts, create_deployment=False, deployment_cache_s=CACHE_S, **overrides) as b:
        yield a, b


async def worker_on_both(a: Stack, b: Stack, artifact_id: str, **fake) -> FakeWorkerServer:
    """One fake worker registered with both replicas, as a worker announcing itself to each."""
    server = await a.add_worker(artifact_id, **fake)
    await b.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(address=server.address, artifact_id=artifact_id),
                                 metadata=WORKER)
    return server


async def routes(stack: Stack) -> set[tuple[int, str]]:
    """(arm, artifact) of one request per session key."""
    results = await asyncio.gather(*(stack.generate("q", session_key=k, max_new_tokens=1) for k in KEYS))
    return {(arm_of(r), r[0].artifact_id) for r in results}


async def change_then_route(a: Stack, b: Stack, change) -> list[set[tuple[int, str]]]:
    """change() makes an admin call through replica a; once the bound has passed, how each replica routes."""
    await routes(b)  # b's cache holds the snapshot from before the change
    await change()
    changed = time.monotonic()
    await asyncio.sleep(CACHE_S + READ_SLACK_S - (time.monotonic() - changed))
    return [await routes(a), await routes(b)]


def rollout(percent: int, canary: str) -> gateway_pb2.StartRolloutRequest:
    return gateway_pb2.StartRolloutRequest(deployment=DEPLOYMENT, canary_artifact_id=canary, canary_percent=percent)


def test_admin_changes_through_one_replica_route_on_the_other_within_the_cache_bound(artifacts):
    async def scenario():
        async with two_replicas(artifacts) as (a, b):
            art = artifacts
            for artifact_id in (art.stable, art.canary, art.baseline):
                await worker_on_both(a, b, artifact_id, tokens=1, max_running=64)
            canary_worker = a.workers[1].worker
            on_stable, on_canary = {(STABLE, art.stable)}, {(CANARY, art.canary)}

            def call(method, request):  # made inside change_then_route: a call object starts at once
                return lambda: getattr(a.admin, method)(request, metadata=ADMIN)

            assert await change_then_route(a, b, call("StartRollout", rollout(100, art.canary))) \
                == [on_canary, on_canary]
            assert await change_then_route(a, b, call("StartRollout", rollout(1, art.canary))) \
                == [on_stable, on_stable]
            assert await change_then_route(a, b, call("StartRollout", rollout(100, art.canary))) \
                == [on_canary, on_canary]
            served_by_canary = len(canary_worker.started)
            abort = call("AbortRollout", gateway_pb2.AbortRolloutRequest(deployment=DEPLOYMENT, reason="bad"))
            assert await change_then_route(a, b, abort) == [on_stable, on_stable]
            # b routed KEYS once before the abort (to the canary): nothing after the bound
            assert len(canary_worker.started) == served_by_canary + len(KEYS)

            switch_on = call("SetFallback", gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT, enabled=True))
            assert await change_then_route(a, b, switch_on) == [{(BASELINE, art.baseline)}] * 2
            switch_off = call("SetFallback", gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT, enabled=False))
            assert await change_then_route(a, b, switch_off) == [on_stable, on_stable]

            await a.admin.StartRollout(rollout(100, art.canary), metadata=ADMIN)
            await routes(a)  # a canary promoted only once it has served a request
            promote = call("PromoteRollout", gateway_pb2.PromoteRolloutRequest(deployment=DEPLOYMENT))
            assert await change_then_route(a, b, promote) == [{(STABLE, art.canary)}] * 2

    run(scenario())


async def events(stack: Stack) -> list[tuple[str, str]]:
    listed = await stack.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT), metadata=ADMIN)
    return [(e.kind, e.actor) for e in reversed(listed.events)]


async def failing_traffic(stack: Stack, worker: FakeWorkerServer, worker_id: str, requests: int = 12) -> None:
    """Requests that the failing worker ends with an error; a heartbeat before each keeps it healthy."""
    for i in range(requests):
        await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=worker_id), metadata=WORKER)
        try:
            await stack.generate(f"p{i}")
        except Exception:  # noqa: BLE001 - the failure is the point
            pass


async def worker_id_on(stack: Stack, address: str) -> str:
    listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
    return next(w.worker_id for w in listed.workers if w.address == address)


# The guard's loop would not run in these tests (first pass after 60 s): each pass is run by hand, both
# replicas' at once, so that both judge the same revision.
GUARD = dict(budget=FallbackBudget(max_error_rate=0.2, max_tpot_p95_s=10.0, window_s=30.0, min_requests=10),
             fallback_check_s=60.0)


async def failing_canary_on_both(a: Stack, b: Stack, artifacts: Artifacts) -> FakeWorkerServer:
    """A healthy stable and a canary at 100 % whose worker fails every request after a token, on both replicas;
    returns once both route on the rollout."""
    await worker_on_both(a, b, artifacts.stable, tokens=2, max_running=64)
    failing = await worker_on_both(a, b, artifacts.canary, tokens=2, max_running=64)
    failing.worker.fail_after = 1
    await a.admin.StartRollout(rollout(100, artifacts.canary), metadata=ADMIN)
    await asyncio.sleep(CACHE_S + READ_SLACK_S)
    return failing


def test_the_guard_on_two_replicas_aborts_a_bad_canary_once(artifacts):
    async def scenario():
        async with two_replicas(artifacts, **GUARD) as (a, b):
            failing = await failing_canary_on_both(a, b, artifacts)
            for stack in (a, b):
                await failing_traffic(stack, failing, await worker_id_on(stack, failing.address))
            acted = await asyncio.gather(a.gateway.fallback.check(), b.gateway.fallback.check())
            assert sorted(map(len, acted)) == [0, 1]
            await asyncio.sleep(CACHE_S + READ_SLACK_S)
            assert await asyncio.gather(a.gateway.fallback.check(), b.gateway.fallback.check()) == [[], []]
            assert (await events(a))[-2:] == [("rollout_start", "ops"), ("abort", "auto")]
            assert await routes(b) == {(STABLE, artifacts.stable)}

    run(scenario())


def test_the_guard_on_two_replicas_falls_back_once_and_leaves_the_operators_switch_alone(artifacts):
    async def scenario():
        async with two_replicas(artifacts, **GUARD) as (a, b):
            failing = await worker_on_both(a, b, artifacts.stable, tokens=2, max_running=64)
            failing.worker.fail_after = 1
            await worker_on_both(a, b, artifacts.baseline, tokens=2, max_running=64)
            for stack in (a, b):
                await failing_traffic(stack, failing, await worker_id_on(stack, failing.address))
            acted = await asyncio.gather(a.gateway.fallback.check(), b.gateway.fallback.check())
            assert sorted(map(len, acted)) == [0, 1]
            # the operator turns it off through b: neither replica's guard turns it on again on what it
            # measured before, and neither turns anything off by itself
            await b.admin.SetFallback(gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT, enabled=False,
                                                                     reason="fixed"), metadata=ADMIN)
            for _ in range(3):
                await asyncio.sleep(CACHE_S / 2)
                assert await asyncio.gather(a.gateway.fallback.check(), b.gateway.fallback.check()) == [[], []]
            kinds = [kind for kind, _ in await events(a)]
            assert kinds.count("fallback_on") == 1 and kinds[-2:] == ["fallback_on", "fallback_off"]
            assert (await events(a))[-2:] == [("fallback_on", "auto"), ("fallback_off", "ops")]

    run(scenario())


def test_a_replica_whose_clock_is_behind_does_not_let_the_guard_undo_the_operator(artifacts, monkeypatch):
    """The guard's window starts at the deployment's last change, written with the clock of the replica
    that made it. The operator turns fallback off through b, whose clock runs 30 s behind a's: a must
    not judge the stable again on the failures it measured before that change and turn it back on."""
    async def scenario():
        async with two_replicas(artifacts, **GUARD) as (a, b):
            failing = await worker_on_both(a, b, artifacts.stable, tokens=2, max_running=64)
            failing.worker.fail_after = 1
            await worker_on_both(a, b, artifacts.baseline, tokens=2, max_running=64)
            await failing_traffic(a, failing, await worker_id_on(a, failing.address))
            assert await a.gateway.fallback.check() == [DEPLOYMENT]
            with monkeypatch.context() as clock:
                clock.setattr("shared.registry.models.datetime", _ClockBehind)  # b's clock
                await b.admin.SetFallback(gateway_pb2.SetFallbackRequest(deployment=DEPLOYMENT, enabled=False,
                                                                         reason="fixed"), metadata=ADMIN)
            await asyncio.sleep(CACHE_S + READ_SLACK_S)
            assert await a.gateway.fallback.check() == []
            assert [kind for kind, _ in await events(a)][-2:] == ["fallback_on", "fallback_off"]

    run(scenario())


class _ClockBehind(datetime):
    """datetime whose now() runs 30 s behind: the registry's clock (models.utcnow) on the replica b."""

    @classmethod
    def now(cls, tz=None):
        return datetime.now(tz) - timedelta(seconds=30)


def test_a_replica_that_first_sees_a_rollout_after_a_ramp_judges_the_canary_from_its_start(artifacts):
    """A replica started mid-rollout (or asked for the deployment only then) dated the canary's run from the
    deployment's last change of any kind, a ramp: the failures the fleet reported before it were never judged,
    and a canary failing every request went on, while RolloutStatus showed them all as what the guard judges."""
    async def scenario():
        async with gateway_stack(artifacts, deployment_cache_s=CACHE_S, budget=FallbackBudget(enabled=False),
                                 fallback_check_s=60.0) as b, \
                gateway_stack(artifacts, create_deployment=False, deployment_cache_s=CACHE_S, **GUARD) as a:
            stable = await b.add_worker(artifacts.stable, tokens=2, max_running=64)
            await a.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                address=stable.address, artifact_id=artifacts.stable), metadata=WORKER)  # where a abort sends
            failing = await b.add_worker(artifacts.canary, tokens=2, max_running=64)
            failing.worker.fail_after = 1
            await b.admin.StartRollout(rollout(100, artifacts.canary), metadata=ADMIN)
            await asyncio.sleep(math.ceil(time.time() + CLOCK_MARGIN_S) - time.time() + 0.05)  # see fleet.py
            await failing_traffic(b, failing, failing.worker_id, requests=8)
            await b.admin.StartRollout(rollout(99, artifacts.canary), metadata=ADMIN)  # a ramp
            await failing_traffic(b, failing, failing.worker_id, requests=4)
            assert await b.gateway.fleet.publish(time.time() + 1.01)
            await a.deployment()  # a's first sight of the deployment
            assert await a.gateway.fallback.check() == [DEPLOYMENT]
            assert (await events(a))[-1] == ("abort", "auto")

    run(scenario())


def test_the_guard_judges_an_arm_on_the_traffic_of_every_replica(artifacts):
    """Behind a load balancer each replica relays part of a failing canary's requests, fewer than the guard's
    minimum (10): judged alone, neither replica would ever act. Each writes what it served to the registry
    (per second) and judges on its own requests plus the others': the canary is aborted, once."""
    async def scenario():
        async with two_replicas(artifacts, **GUARD) as (a, b):
            failing = await failing_canary_on_both(a, b, artifacts)
            # The reports are per second, and the other replicas' are counted from a second after the rollout
            # began (fleet.CLOCK_MARGIN_S: they may hold requests from before it): the traffic starts then.
            await asyncio.sleep(math.ceil(time.time() + CLOCK_MARGIN_S) - time.time() + 0.05)
            for stack in (a, b):
                await failing_traffic(stack, failing, await worker_id_on(stack, failing.address), requests=6)
            assert await asyncio.gather(a.gateway.fallback.check(), b.gateway.fallback.check()) == [[], []]
            later = time.time() + 1.01  # the seconds of those requests have ended
            assert all(await asyncio.gather(a.gateway.fleet.publish(later), b.gateway.fleet.publish(later)))
            status = await a.admin.RolloutStatus(gateway_pb2.RolloutStatusRequest(deployment=DEPLOYMENT),
                                                 metadata=ADMIN)
            canary = status.canary  # a's own requests, and the fleet's as the guard counts them
            assert (canary.requests, canary.errors, canary.fleet_requests, canary.fleet_errors) == (6, 6, 12, 12)
            acted = await asyncio.gather(a.gateway.fallback.check(), b.gateway.fallback.check())
            assert sorted(map(len, acted)) == [0, 1]
            assert (await events(a))[-2:] == [("rollout_start", "ops"), ("abort", "auto")]
            reason = (await a.admin.ListEvents(gateway_pb2.ListEventsRequest(deployment=DEPLOYMENT),
                                               metadata=ADMIN)).events[0].detail
            assert "(12/12)" in reason, reason  # both replicas' requests

    run(scenario())


def test_rollout_status_shows_the_fleet_latencies_the_guard_holds_to_its_budget(artifacts):
    """Another replica's report of slow tokens on the canary: RolloutStatus' fleet figures are what the guard
    judges (its TTFT and TPOT p95 included), while the replica's own columns stay its own (no requests here)."""
    async def scenario():
        async with two_replicas(artifacts, **GUARD) as (a, b):
            await worker_on_both(a, b, artifacts.stable, tokens=2, max_running=64)
            await worker_on_both(a, b, artifacts.canary, tokens=2, max_running=64)
            await a.admin.StartRollout(rollout(50, artifacts.canary), metadata=ADMIN)
            second = math.ceil(time.time() + CLOCK_MARGIN_S)
            registry = create_registry(artifacts.url)
            try:
                with registry.transaction() as session:  # a third replica's second: 4 requests, 1 failed
                    write_arm_seconds(session, "c" * 32,
                                      [ArmSecond(DEPLOYMENT, artifacts.canary, second, 4, 1, {2500: 2, 100: 1},
                                                 {1200: 3})])
            finally:
                registry.close()
            await asyncio.sleep(max(0.0, second - time.time()) + 0.05)
            status = await a.admin.RolloutStatus(gateway_pb2.RolloutStatusRequest(deployment=DEPLOYMENT),
                                                 metadata=ADMIN)
            canary = status.canary
            assert (canary.requests, canary.fleet_requests, canary.fleet_errors) == (0, 4, 1)
            assert canary.fleet_tpot_p95.ToNanoseconds() == 250_000_000  # 2500 steps of 0.1 ms
            assert canary.fleet_ttft_p95.ToNanoseconds() == 1_200_000_000  # 1200 steps of 1 ms
            assert canary.tpot_p95.ToNanoseconds() == 0

    run(scenario())


def test_a_replica_without_the_guard_still_reports_what_it_served(artifacts):
    """Only the replicas whose own guard runs published their arm reports: a replica started with the guard
    off (a flag rolled across the fleet, or one replica meant to act) served its share of a failing canary
    where no other replica's guard could see it."""
    async def scenario():
        async with gateway_stack(artifacts, deployment_cache_s=CACHE_S, budget=GUARD["budget"],
                                 fallback_check_s=0.1) as a, \
                gateway_stack(artifacts, create_deployment=False, deployment_cache_s=CACHE_S,
                              budget=FallbackBudget(enabled=False), fallback_check_s=0.1) as b:
            failing = await failing_canary_on_both(a, b, artifacts)
            await asyncio.sleep(math.ceil(time.time() + CLOCK_MARGIN_S) - time.time() + 0.05)
            for stack in (a, b):  # 6 each: under the minimum of 10 for either alone
                await failing_traffic(stack, failing, await worker_id_on(stack, failing.address), requests=6)
            deadline = time.monotonic() + 10
            while (await a.deployment()).HasField("canary"):  # a's guard, on its own loop, sees b's reports
                assert time.monotonic() < deadline, "the guarded replica never saw the other replica's requests"
                await asyncio.sleep(0.1)
            assert (await events(a))[-1] == ("abort", "auto")

    run(scenario())

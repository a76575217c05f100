"""The fleet view of an arm (services/gateway/fleet.py): this replica's requests and the others' reports."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from services.gateway.fleet import FleetView, with_others
from services.gateway.metrics import GatewayMetrics, Outcome, stats_of
from shared.registry import ArmSecond, ArmTotals, create_registry, fleet_arm_totals, sqlite_url, write_arm_seconds


def test_the_others_requests_are_added_and_the_p95_taken_over_all_of_them():
    local = [Outcome(at=1.0, server_error=False, ttft_s=0.2, tpot_s=0.01, tokens=5),
             Outcome(at=1.0, server_error=False, ttft_s=0.2, tpot_s=0.01, tokens=5),
             Outcome(at=1.0, server_error=True, ttft_s=None, tpot_s=None, tokens=0)]
    merged = with_others(local, ArmTotals(requests=17, errors=2, tpot_counts={5000: 15}, ttft_counts={1500: 15}))
    assert (merged.requests, merged.errors, merged.generated_tokens) == (20, 3, 10)
    assert math.isclose(merged.tpot_p95_s, 0.5) and math.isclose(merged.tpot_p50_s, 0.5)
    assert math.isclose(merged.ttft_p95_s, 1.5) and math.isclose(merged.ttft_p50_s, 1.5)
    older = with_others(local, ArmTotals(requests=4, errors=0, tpot_counts={5000: 4}))  # reports without TTFTs
    assert math.isclose(older.ttft_p95_s, 0.2) and older.requests == 7
    assert with_others(local, ArmTotals()) == stats_of(local)  # no other replica: exactly as before


class _Unreachable:
    def transaction(self):
        raise ConnectionError("registry down")


def test_reports_wait_in_memory_while_the_registry_is_away_then_go_out(tmp_path, caplog):
    metrics = GatewayMetrics()
    now = time.time()
    fleet = FleetView(_Unreachable(), metrics, gateway_id="a" * 32)
    fleet._written_until = math.floor(now) - 5
    for error in (False, True, False):
        metrics.record("chat", "c1", "c1", Outcome(at=now - 3, server_error=error, ttft_s=0.1, tpot_s=0.02, tokens=4))

    async def scenario():
        with caplog.at_level(logging.WARNING, logger="services.gateway.fleet"):
            assert await fleet.publish(now) == 0 and await fleet.publish(now) == 0
        assert len([r for r in caplog.records if "could not write" in r.getMessage()]) == 1  # once per outage
        registry = create_registry(sqlite_url(tmp_path / "registry.db"))
        fleet.registry = registry
        assert await fleet.publish(now) == 1
        with registry.sessions() as session:
            totals = fleet_arm_totals(session, "chat", "c1", 0, math.floor(now))
        assert (totals.requests, totals.errors, totals.tpot_counts) == (3, 1, {200: 2})
        assert await fleet.publish(now) == 0  # nothing new
        registry.close()

    asyncio.run(scenario())


def test_another_replicas_first_second_after_a_change_is_not_counted(tmp_path):
    """A window that starts at a change: the other replicas' seconds count from CLOCK_MARGIN_S after it, so a
    replica whose clock runs a little ahead cannot bring in requests of before the change."""
    registry = create_registry(sqlite_url(tmp_path / "registry.db"))
    with registry.transaction() as session:
        write_arm_seconds(session, "b" * 32, [ArmSecond("chat", "c1", 1000, 5, 5), ArmSecond("chat", "c1", 1002, 3, 1)])
    fleet = FleetView(registry, GatewayMetrics(), gateway_id="a" * 32)
    try:
        assert asyncio.run(fleet.others("chat", "c1", since=999.5, until=1010.0)).requests == 3
        assert asyncio.run(fleet.others("chat", "c1", since=998.5, until=1010.0)).requests == 8
    finally:
        registry.close()


def test_a_sliding_window_counts_every_ended_second_of_the_others_inside_it(tmp_path):
    """The clock margin keeps a window that starts at a change free of the requests of before it; applied to a
    plain sliding window too, it dropped a second or more of the other replicas' traffic on every pass (all of
    it with --fallback-window-s 2: the only second left was the one not yet written)."""
    registry = create_registry(sqlite_url(tmp_path / "registry.db"))
    with registry.transaction() as session:  # replica b: second 999 has ended
        write_arm_seconds(session, "b" * 32, [ArmSecond("chat", "c1", 999, 30, 30)])
    fleet = FleetView(registry, GatewayMetrics(), gateway_id="a" * 32)
    try:
        now = 1000.4  # a window of 2 s: [998.4, 1000.4]
        sliding = asyncio.run(fleet.others("chat", "c1", since=now - 2.0, until=now, since_change=False))
        assert sliding.requests == 30
        # A window that starts at a change at 998.4: second 999 began within the margin, maybe before the change.
        assert asyncio.run(fleet.others("chat", "c1", since=now - 2.0, until=now)).requests == 0
    finally:
        registry.close()


def test_the_guard_asks_for_the_margin_only_when_its_window_starts_at_a_change():
    from types import SimpleNamespace

    from services.gateway.config import FallbackBudget
    from services.gateway.fallback import AutoFallback

    asked = []

    class Fleet:
        async def others(self, deployment, artifact_id, since, until, since_change=True):
            asked.append(since_change)
            return ArmTotals()

    changes = {"recent": time.time() - 5, "long ago": time.time() - 3600}
    deployments = SimpleNamespace(arm_since=lambda view, arm: changes[view.name])
    guard = AutoFallback(None, deployments, GatewayMetrics(), FallbackBudget(window_s=30.0), None, Fleet())
    canary = SimpleNamespace(artifact_id="c1")
    for name in ("recent", "long ago"):
        view = SimpleNamespace(name=name, fallback=False, stable=None, baseline=None, canary=canary)
        asyncio.run(guard._others(view, time.time()))
    assert asked == [True, False, False]  # the latter short of min_requests: its run read too, no margin either

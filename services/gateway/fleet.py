"""The fleet's view of each arm, for the automatic guard: this replica's requests from memory (exact, up to
now) plus what the other replicas reported to the registry (shared/registry/arm_reports.py, per second).

Behind a load balancer N replicas each relay 1/N of the traffic. Judged alone, an arm reaches the guard's
minimum of requests in a window at N times the traffic a single gateway needs, and a canary failing at a
rate that one gateway would catch could serve its errors for good. Each replica therefore writes the seconds
that have ended (publish, at every guard pass) and adds the others' to its own when it judges (totals).

A registry that cannot be reached keeps the reports in memory (up to KEEP_S) and the guard on this replica's
own requests: the fleet view is an addition, never a condition of the guard."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Mapping

from services.gateway.metrics import ArmStats, GatewayMetrics, Outcome, quantile, stats_of
from shared.registry import (ArmSecond, ArmTotals, Registry, fleet_arm_totals, purge_arm_reports,
                             write_arm_seconds)
from shared.registry.arm_reports import TPOT_STEP_S, TTFT_STEP_S, tpot_step, ttft_step

log = logging.getLogger(__name__)
KEEP_S = 3600.0  # reports are kept this long, in the registry and (unwritten) in memory
# Another replica's seconds are counted from this long after the window starts: a window that starts at a
# change (an operator turning fallback off) must not take in the requests of before it from a replica whose
# clock runs a little ahead. Clocks in step to within it (NTP) are assumed.
CLOCK_MARGIN_S = 1.0
PURGE_EVERY_S = 60.0


class FleetView:
    def __init__(self, registry: Registry, metrics: GatewayMetrics, gateway_id: str | None = None):
        self.registry = registry
        self.metrics = metrics
        self.gateway_id = gateway_id or uuid.uuid4().hex
        self._written_until = math.floor(time.time())  # seconds before this one are written (or being)
        self._unwritten: list[ArmSecond] = []
        self._last_purge = 0.0
        self._failing = False  # logged once per outage

    async def run(self, interval_s: float) -> None:
        """Publishes this replica's reports every interval_s, whether or not its own guard runs: a replica with
        the guard off still serves traffic the other replicas' guards must see."""
        while True:
            await asyncio.sleep(interval_s)
            await self.publish()  # never raises: an unreachable registry keeps them for later

    async def publish(self, now: float | None = None) -> int:
        """Writes the seconds that have ended since the last call; returns how many arm-seconds."""
        now = time.time() if now is None else now
        until = math.floor(now)
        if until > self._written_until:
            self._unwritten.extend(_per_second(self.metrics.outcomes(self._written_until, until)))
            self._written_until = until
        self._unwritten = [r for r in self._unwritten if r.second >= now - KEEP_S]
        purge = now - self._last_purge >= PURGE_EVERY_S
        if not self._unwritten and not purge:
            return 0
        reports = list(self._unwritten)
        try:
            written = await asyncio.to_thread(self._write, reports, math.floor(now - KEEP_S) if purge else None)
        except Exception as exc:  # the registry is away: keep them for the next pass
            if not self._failing:
                log.warning("could not write this gateway's arm reports to the registry (the guard judges on "
                            "this replica's requests alone meanwhile): %s", exc)
            self._failing = True
            return 0
        if self._failing:
            log.info("arm reports written to the registry again")
        self._failing = False
        self._unwritten = self._unwritten[len(reports):]
        if purge:
            self._last_purge = now
        return written

    def _write(self, reports: list[ArmSecond], purge_before: int | None) -> int:
        with self.registry.transaction() as session:
            written = write_arm_seconds(session, self.gateway_id, reports)
            if purge_before is not None:
                purge_arm_reports(session, purge_before)
        return written

    async def others(self, deployment: str, artifact_id: str, since: float, until: float,
                     since_change: bool = True) -> ArmTotals:
        """The other replicas' reports of [since, until] for the arm, in whole seconds, from the first that
        begins at or after `since`, or CLOCK_MARGIN_S after it when the window starts at a change
        (`since_change`; a sliding window's start has no before to keep out); none when the registry cannot
        be read."""
        first = math.ceil(since + CLOCK_MARGIN_S) if since_change else math.ceil(since)

        def read() -> ArmTotals:
            with self.registry.sessions() as session:
                return fleet_arm_totals(session, deployment, artifact_id, first, math.floor(until),
                                        exclude_gateway=self.gateway_id)
        try:
            return await asyncio.to_thread(read)
        except Exception as exc:
            log.debug("could not read the other replicas' reports: %s", exc)
            return ArmTotals()


def with_others(outcomes: list[Outcome], others: ArmTotals) -> ArmStats:
    """The stats of an arm over this replica's requests (`outcomes`) and the other replicas' reports: counts
    summed, TTFT and TPOT p50 / p95 over all of them (the local times in the reports' steps, so that every
    request weighs the same)."""
    local = stats_of(outcomes)
    if not others.requests:
        return local
    local_tpots, local_ttfts = _step_counts(outcomes)
    ttfts = _in_steps(others.ttft_counts, local_ttfts, TTFT_STEP_S)
    tpots = _in_steps(others.tpot_counts, local_tpots, TPOT_STEP_S)
    return ArmStats(requests=local.requests + others.requests, errors=local.errors + others.errors,
                    ttft_p50_s=quantile(ttfts, 0.5), ttft_p95_s=quantile(ttfts, 0.95),
                    tpot_p50_s=quantile(tpots, 0.5), tpot_p95_s=quantile(tpots, 0.95),
                    generated_tokens=local.generated_tokens, ttft_samples=len(ttfts), tpot_samples=len(tpots))


def _in_steps(reported: Mapping[int, int], local: Mapping[int, int], step_s: float) -> list[float]:
    """Every request's time, sorted: the reports' counts and this replica's, in the same step."""
    counts = Counter(reported)
    counts.update(local)
    return [step * step_s for step in sorted(counts) for _ in range(counts[step])]


def _step_counts(outcomes: list[Outcome]) -> tuple[Counter[int], Counter[int]]:
    """(TPOT, TTFT) counts in the reports' steps of the requests not failed on the serving side."""
    ok = [o for o in outcomes if not o.server_error]
    return (Counter(tpot_step(o.tpot_s) for o in ok if o.tpot_s is not None),
            Counter(ttft_step(o.ttft_s) for o in ok if o.ttft_s is not None))


def _per_second(outcomes: list[tuple[str, str, Outcome]]) -> list[ArmSecond]:
    groups: dict[tuple[str, str, int], list[Outcome]] = defaultdict(list)
    for deployment, artifact_id, outcome in outcomes:
        groups[(deployment, artifact_id, math.floor(outcome.at))].append(outcome)
    reports = []
    for (deployment, artifact_id, second), group in sorted(groups.items()):
        errors = sum(o.server_error for o in group)
        tpots, ttfts = _step_counts(group)
        reports.append(ArmSecond(deployment, artifact_id, second, len(group), errors, dict(tpots), dict(ttfts)))
    return reports

"""The automatic guard over a deployment's arms, judged on error rate, time per output token (p95) and, when
its budget is set, time to the first token (p95) over a window, once an arm has served enough requests:

* a canary over budget is aborted (its traffic goes back to the stable), whatever its format:
  a bad new artifact is taken out without touching what was vetted;
* a quantized stable over budget turns the deployment's fallback switch on (everything to the
  fp16 baseline; any canary is aborted too), when there is a baseline to fall back to.

An arm is judged on the requests of every gateway replica (fleet.py): this replica's own, and what the others
reported to the registry for the same window.

Each action is taken as actor "auto" with the measured figures as the reason, in the registry's
event log. Turning fallback back off is a person's decision (`qctl fallback off`).

An action is held off while the arm the traffic would move to has no healthy worker in this gateway's
pool (fallback: the baseline; a canary's abort: the stable, else the baseline): a deployment whose fp16
baseline runs no workers would otherwise go from over budget to refusing every request (UNAVAILABLE).
It is taken on the first pass after such a worker registers, if the arm is still over budget.

The window starts no earlier than the change that began the arm's run (DeploymentCache.arm_since), so what
was measured before an operator turned fallback off (or before a promote or a new canary) does not trip the
guard again, while a ramp of the same canary keeps its failures so far. The change's time in the registry is
the clock of whichever replica made it; the window also starts no earlier than when this replica's cache first
saw that run, so a replica whose clock runs behind cannot make another judge its arms on what they did before
the change.

An arm with fewer than min_requests in that window (low traffic: under min_requests per window_s) is judged on
its whole run instead, up to RUN_WINDOW_S back: a canary failing every request it gets, one every few seconds,
was never judged however many it had failed."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field

from services.gateway.config import FallbackBudget
from services.gateway.deployments import ArtifactRefView, DeploymentCache, DeploymentView, view_of
from services.gateway.fleet import KEEP_S, FleetView, with_others
from services.gateway.metrics import GatewayMetrics
from services.gateway.pool import WorkerPool
from shared import registry as reg
from shared.registry import ArmTotals, Registry, RegistryError

log = logging.getLogger(__name__)
ACTOR = "auto"
# How far back an arm short of min_requests in the window is judged: as long as the replicas' reports are kept.
RUN_WINDOW_S = KEEP_S


@dataclass(frozen=True)
class OtherReplicas:
    """The other gateway replicas' requests of an arm: in the guard's window, and over the arm's run (read only
    where the window holds fewer than min_requests across the fleet; None otherwise)."""

    window: ArmTotals = field(default_factory=ArmTotals)
    run: ArmTotals | None = None


class GuardAction(enum.Enum):
    """What the guard does to a deployment over budget."""

    FALLBACK = "fallback"  # the quantized stable: everything to the fp16 baseline (and any canary aborted)
    ABORT = "canary abort"  # the canary: its traffic back to the stable


class AutoFallback:
    HELD_OFF_LOG_S = 30.0  # how often an action held off for want of workers is logged, per deployment

    def __init__(self, registry: Registry, deployments: DeploymentCache, metrics: GatewayMetrics,
                 budget: FallbackBudget, pool: WorkerPool, fleet: FleetView | None = None):
        self.registry = registry
        self.deployments = deployments
        self.metrics = metrics
        self.budget = budget
        self.pool = pool
        self.fleet = fleet  # the other replicas' requests (fleet.py); None: this replica's alone
        self._held_off_logged: dict[tuple[str, GuardAction], float] = {}  # -> when last logged (monotonic)

    def window_start(self, view: DeploymentView, now: float, arm: str) -> float:
        """The last window_s, from no earlier than the arm's current run began (DeploymentCache.arm_since: a
        new stable or canary, a fallback switched; not a ramp of the same canary, whose failures so far count)."""
        return max(now - self.budget.window_s, self.deployments.arm_since(view, arm))

    def run_start(self, view: DeploymentView, now: float, arm: str) -> float:
        """Where the arm's run began (see window_start), up to RUN_WINDOW_S back."""
        return max(now - RUN_WINDOW_S, self.deployments.arm_since(view, arm))

    def arm_breach(self, view: DeploymentView, arm: str, now: float | None = None,
                   others: OtherReplicas | None = None) -> str | None:
        """Why this arm ("stable" or "canary") of the deployment is over budget, or None when it is not.
        `others`: the other gateway replicas' requests of the arm, added to this one's."""
        ref = view.stable if arm == "stable" else view.canary
        if ref is None:
            return None
        now = time.time() if now is None else now
        others = others or OtherReplicas()
        since = self.window_start(view, now, arm)
        stats = with_others(self.metrics.window(view.name, ref.artifact_id, since, now), others.window)
        if stats.requests < self.budget.min_requests:
            since = self.run_start(view, now, arm)
            stats = with_others(self.metrics.window(view.name, ref.artifact_id, since, now),
                                others.run or ArmTotals())
            if stats.requests < self.budget.min_requests:
                return None
        if stats.error_rate > self.budget.max_error_rate:
            return (f"{arm} {ref.artifact_id} error rate {stats.error_rate:.1%} ({stats.errors}/{stats.requests}) "
                    f"over the budget {self.budget.max_error_rate:.1%} in the last {now - since:.0f} s")
        latencies = (("time per output token", stats.tpot_p95_s, stats.tpot_samples, self.budget.max_tpot_p95_s),
                     ("time to first token", stats.ttft_p95_s, stats.ttft_samples, self.budget.max_ttft_p95_s))
        for what, p95, samples, budget in latencies:
            # A budget of 0: not judged. A p95 of fewer than min_requests samples (mostly one-token or refused
            # requests) is not judged either: it could be a single slow request.
            if budget and samples >= self.budget.min_requests and p95 > budget:
                return (f"{arm} {ref.artifact_id} {what} p95 {p95 * 1000:.1f} ms over the budget {budget * 1000:.1f} "
                        f"ms in the last {now - since:.0f} s ({stats.requests} requests)")
        return None

    def verdict(self, view: DeploymentView, now: float | None = None,
                others: dict[str, OtherReplicas] | None = None) -> tuple[GuardAction, str] | None:
        """(action, reason), or None: what the guard does to this deployment now. `others`: by arm, the
        other replicas' requests (see arm_breach)."""
        others = others or {}
        if view.fallback:
            return None  # everything already goes to the baseline
        if _judges_stable(view):
            reason = self.arm_breach(view, "stable", now, others.get("stable"))
            if reason is not None and self._can_take(view, GuardAction.FALLBACK, reason, [view.baseline]):
                return GuardAction.FALLBACK, reason
        reason = self.arm_breach(view, "canary", now, others.get("canary"))
        if reason is not None and self._can_take(view, GuardAction.ABORT, reason, [view.stable, view.baseline]):
            return GuardAction.ABORT, reason
        return None

    def _can_take(self, view: DeploymentView, action: GuardAction, reason: str,
                  destinations: list[ArtifactRefView | None]) -> bool:
        """Whether a healthy worker serves one of the artifacts the action moves traffic to (in routing
        order); when none does, the action would refuse every moved request, so it is held off (and
        logged now and then: the check runs twice a second)."""
        targets = [ref for ref in destinations if ref is not None]
        if any(self.pool.healthy(ref.artifact_id) for ref in targets):
            return True
        now = time.monotonic()
        key = (view.name, action)
        if now - self._held_off_logged.get(key, -self.HELD_OFF_LOG_S) >= self.HELD_OFF_LOG_S:
            self._held_off_logged[key] = now
            log.warning("deployment %s: automatic %s held off: no healthy worker serves %s, so it would refuse "
                        "every moved request; over budget: %s", view.name, action.value,
                        " nor ".join(ref.artifact_id for ref in targets), reason)
        return False

    async def check(self) -> list[str]:
        """One pass over the deployments this gateway serves; returns the names it acted on."""
        acted = []
        for name in self.deployments.names():
            try:
                view = await self.deployments.get(name)
            except RegistryError:
                continue  # deleted meanwhile
            now = time.time()
            verdict = self.verdict(view, now, await self._others(view, now))
            if verdict is None:
                continue
            action, reason = verdict
            changed = await asyncio.to_thread(self._act, name, action, reason, view.revision)
            if changed is None:  # changed since the snapshot was read: judged again on the next pass
                log.info("deployment %s changed since revision %d; automatic %s not taken", name, view.revision,
                         action.value)
                continue
            log.warning("deployment %s: automatic %s: %s", name, action.value, reason)
            self.deployments.put(changed)
            acted.append(name)
        return acted

    async def _others(self, view: DeploymentView, now: float) -> dict[str, OtherReplicas]:
        """The other replicas' requests of the deployment's stable and canary in the guard's window, and over
        the arm's run where the window is short of min_requests (arm_breach)."""
        if self.fleet is None or view.fallback:
            return {}
        found = {}
        for arm, ref in (("stable", view.stable if _judges_stable(view) else None), ("canary", view.canary)):
            if ref is None:
                continue
            since = self.window_start(view, now, arm)
            window = await self.fleet.others(view.name, ref.artifact_id, since, now,
                                             since_change=since > now - self.budget.window_s)
            run = None
            here = len(self.metrics.window(view.name, ref.artifact_id, since, now))
            start = self.run_start(view, now, arm)
            if here + window.requests < self.budget.min_requests and start < since:
                run = await self.fleet.others(view.name, ref.artifact_id, start, now,
                                              since_change=start > now - RUN_WINDOW_S)
            found[arm] = OtherReplicas(window, run)
        return found

    def _act(self, name: str, action: GuardAction, reason: str, revision: int) -> DeploymentView | None:
        """Takes the action, unless the deployment is no longer at the revision that was judged (a
        change made meanwhile, e.g. through another gateway: a new canary must not pay for the old one)."""
        with self.registry.transaction() as session:
            deployment = reg.get_deployment(session, name, for_update=True)
            if deployment.revision != revision:
                return None
            if deployment.canary_artifact_id is not None:
                # With a fallback the canary goes too (everything goes to the baseline), unjudged: it may be
                # the fix for the stable, and is started again without --force.
                falling_back = action is GuardAction.FALLBACK
                deployment = reg.abort_rollout(
                    session, name, actor=ACTOR, judged=not falling_back,
                    reason=f"the stable fell back to the baseline: {reason}" if falling_back else reason)
            if action is GuardAction.FALLBACK:
                deployment = reg.set_fallback(session, name, True, actor=ACTOR, reason=reason)
            return view_of(session, deployment)

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:  # a registry outage must not end the monitor; the next pass retries
                log.exception("automatic fallback check failed")


def _judges_stable(view: DeploymentView) -> bool:
    """The guard judges a stable that is quantized and has a baseline to fall back to."""
    return view.baseline is not None and view.stable is not None and view.stable.format != "fp16"

"""The automatic fallback: when the quantized path of a deployment (its stable and canary arms,
unless they are fp16) breaks the error-rate or time-per-output-token budget over the window, the
gateway turns the deployment's fallback switch on and aborts its canary, as actor "auto", with the
measured figures as the reason. Turning it back off is a person's decision (`qctl fallback off`).

The window starts no earlier than the deployment's last change, so what was measured before an
operator turned fallback off (or before a promote) does not trip the switch again."""

from __future__ import annotations

import asyncio
import logging
import time

from services.gateway.config import FallbackBudget
from services.gateway.deployments import DeploymentCache, DeploymentView, view_of
from services.gateway.metrics import GatewayMetrics
from shared import registry as reg
from shared.registry import Registry, RegistryError

log = logging.getLogger(__name__)
ACTOR = "auto"


class AutoFallback:
    def __init__(self, registry: Registry, deployments: DeploymentCache, metrics: GatewayMetrics,
                 budget: FallbackBudget):
        self.registry = registry
        self.deployments = deployments
        self.metrics = metrics
        self.budget = budget

    def breach(self, view: DeploymentView, now: float | None = None) -> str | None:
        """Why the quantized path of this deployment is over budget, or None when it is not."""
        now = time.time() if now is None else now
        since = max(now - self.budget.window_s, view.updated_at.timestamp())
        arms = (("stable", view.stable), ("canary", view.canary))
        for arm, ref in arms:
            if ref is None or ref.format == "fp16":
                continue
            stats = self.metrics.stats(view.name, ref.artifact_id, since, now)
            if stats.requests < self.budget.min_requests:
                continue
            if stats.error_rate > self.budget.max_error_rate:
                return (f"{arm} {ref.artifact_id} error rate {stats.error_rate:.1%} ({stats.errors}/{stats.requests}) "
                        f"over the budget {self.budget.max_error_rate:.1%} in the last {now - since:.0f} s")
            if stats.tpot_p95_s > self.budget.max_tpot_p95_s:
                return (f"{arm} {ref.artifact_id} time per output token p95 {stats.tpot_p95_s * 1000:.1f} ms over "
                        f"the budget {self.budget.max_tpot_p95_s * 1000:.1f} ms in the last {now - since:.0f} s "
                        f"({stats.requests} requests)")
        return None

    async def check(self) -> list[str]:
        """One pass over the deployments this gateway serves; returns the names it switched."""
        switched = []
        for name in self.deployments.names():
            try:
                view = await self.deployments.get(name)
            except RegistryError:
                continue  # deleted meanwhile
            if view.fallback or view.baseline is None:
                continue
            reason = self.breach(view)
            if reason is None:
                continue
            log.warning("deployment %s: automatic fallback: %s", name, reason)
            self.deployments.put(await asyncio.to_thread(self._switch, name, reason))
            switched.append(name)
        return switched

    def _switch(self, name: str, reason: str) -> DeploymentView:
        with self.registry.transaction() as session:
            deployment = reg.get_deployment(session, name)
            if deployment.canary_artifact_id is not None:
                reg.abort_rollout(session, name, actor=ACTOR, reason=reason)
            deployment = reg.set_fallback(session, name, True, actor=ACTOR, reason=reason)
            return view_of(session, deployment)

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:  # a registry outage must not end the monitor; the next pass retries
                log.exception("automatic fallback check failed")

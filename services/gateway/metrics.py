"""What the gateway measures per request: Prometheus series per artifact (and arm, deployment), and
a windowed record per (deployment, artifact) that RolloutStatus and the automatic fallback read."""

from __future__ import annotations

import collections
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from services.gateway.config import ApiKey

RECORDS_KEPT = 20_000  # per (deployment, artifact): the newest requests; older ones fall out of every window
# From ms-scale TPOT to a TTFT behind a long queue: the gateway's TTFT holds the worker's (whose buckets
# reach 60 s) plus routing, and past the last finite bucket histogram_quantile only answers its bound.
# The values of qserve_gateway_workers' health label (PooledWorker.health_label), each exported even at 0.
WORKER_HEALTH_LABELS = ("healthy", "draining", "stalled", "quarantined", "unhealthy")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished request as the gateway saw it."""

    at: float  # wall-clock seconds (time.time()) when it finished
    server_error: bool  # ended non-OK because of the serving side (not the client's input or cancel)
    # None when no token was delivered; for a client that left before its first token, the time it waited (a
    # lower bound: without it a canary that never answers would show no TTFT for the budget to judge)
    ttft_s: float | None
    tpot_s: float | None  # None when fewer than two tokens were delivered
    tokens: int


@dataclass(frozen=True, slots=True)
class ArmStats:
    requests: int = 0
    errors: int = 0
    ttft_p50_s: float = 0.0
    ttft_p95_s: float = 0.0
    tpot_p50_s: float = 0.0
    tpot_p95_s: float = 0.0
    generated_tokens: int = 0
    # The requests each quantile is taken over (those with that time: not failed, a first token or a client that
    # left waiting for it, two or more tokens): a p95 of few samples says little, whatever the request count.
    ttft_samples: int = 0
    tpot_samples: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile; 0 for no values."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


UNNAMED_CLIENT = "unnamed"  # the client label of API keys given without a name
# An artifact that served no request of a deployment for this long (retired by a rollout, most often) has its
# series and its window of requests forgotten: kept, every rollout left ~44 series and up to RECORDS_KEPT
# requests in memory for the life of the gateway.
FORGET_IDLE_S = 86400.0


def client_label(key: ApiKey) -> str:
    return key.name or UNNAMED_CLIENT


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # one per gateway, so that gateways in one process do not clash
        labels = ("deployment", "arm", "artifact")
        self.requests = Counter("qserve_gateway_requests", "Finished Generate requests, and attempts that failed "
                                "before the request moved to another worker (counted as errors of their arm)", labels, registry=self.registry)
        self.errors = Counter("qserve_gateway_errors", "Requests that failed on the serving side", labels,
                              registry=self.registry)
        self.ttft = Histogram("qserve_gateway_time_to_first_token_seconds", "Arrival to first token sent (to the "
                              "client's leaving, for one that left before it), of requests not failed on the "
                              "serving side", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("qserve_gateway_time_per_output_token_seconds", "Mean gap between tokens after the "
                              "first, per request not failed on the serving side", labels, buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.tokens = Counter("qserve_gateway_generated_tokens", "Tokens delivered to clients", labels,
                              registry=self.registry)
        self.open_streams = Gauge("qserve_gateway_open_streams", "Generate streams open now", registry=self.registry)
        # By status code only (never deployment or request text, which a client chooses): load shed at the
        # gateway (RESOURCE_EXHAUSTED), bad keys, bad input and unknown deployments show nowhere else.
        self.rejected = Counter("qserve_gateway_rejected_requests", "Generate calls the gateway ended with an error "
                                "status, by status code", ("code",), registry=self.registry)
        # By API key name (QSERVE_API_KEYS; "unnamed" for a key given without one), only where keys are
        # required: who sends the traffic, who gets the tokens, who is held to --max-streams-per-client.
        client = ("client",)
        self.client_requests = Counter("qserve_gateway_client_requests", "Generate streams admitted, by API key",
                                       client, registry=self.registry)
        self.client_tokens = Counter("qserve_gateway_client_generated_tokens", "Tokens delivered, by API key",
                                     client, registry=self.registry)
        self.client_limited = Counter("qserve_gateway_client_limited_requests", "Generate calls refused because "
                                      "their API key had max_streams_per_client streams open", client,
                                      registry=self.registry)
        self._windows: dict[tuple[str, str], deque[Outcome]] = {}
        self._arms: dict[tuple[str, str], set[str]] = {}  # the arms each (deployment, artifact) was recorded in

    def watch_workers(self, health_labels: Callable[[], Iterable[str]]) -> None:
        """Exports qserve_gateway_workers{health}, counted at each scrape from health_labels() (one label
        per registered worker, WORKER_HEALTH_LABELS)."""
        self.registry.register(_WorkersByHealth(health_labels))

    def record(self, deployment: str, arm: str, artifact_id: str, outcome: Outcome) -> None:
        labels = (deployment, arm, artifact_id)
        self.requests.labels(*labels).inc()
        # Touched on every request, so a healthy arm exports 0 errors: an error-rate query then reads 0,
        # not "no data", which an alert cannot tell from a failed scrape.
        errors = self.errors.labels(*labels)
        if outcome.server_error:
            errors.inc()
        else:
            self._observe_latency(labels, outcome)
        self.tokens.labels(*labels).inc(outcome.tokens)
        window = self._windows.setdefault((deployment, artifact_id), deque(maxlen=RECORDS_KEPT))
        window.append(outcome)
        self._arms.setdefault((deployment, artifact_id), set()).add(arm)

    def forget_idle(self, now: float | None = None) -> int:
        """Forgets the series and window of each (deployment, artifact) without a request for FORGET_IDLE_S;
        returns how many. Called by the gateway's periodic pass (on the event loop, as record is)."""
        cutoff = (time.time() if now is None else now) - FORGET_IDLE_S
        idle = [key for key, window in self._windows.items() if not window or window[-1].at < cutoff]
        for deployment, artifact_id in idle:
            for arm in self._arms.pop((deployment, artifact_id), ()):
                for metric in (self.requests, self.errors, self.ttft, self.tpot, self.tokens):
                    try:
                        metric.remove(deployment, arm, artifact_id)
                    except KeyError:  # never touched with these labels (a histogram of a request that failed)
                        pass
            del self._windows[(deployment, artifact_id)]
        return len(idle)

    def _observe_latency(self, labels: tuple[str, str, str], outcome: Outcome) -> None:
        """Latencies of a request that did not fail on the serving side, as stats() counts them: a broken
        stream's token gaps run up to the failure (a dead worker's can be a keepalive timeout), and
        would make the histograms judge a canary otherwise than RolloutStatus and the guard do."""
        if outcome.ttft_s is not None:
            self.ttft.labels(*labels).observe(outcome.ttft_s)
        if outcome.tpot_s is not None:
            self.tpot.labels(*labels).observe(outcome.tpot_s)

    def window(self, deployment: str, artifact_id: str, since: float, until: float) -> list[Outcome]:
        """Requests of this deployment served by this artifact that finished in [since, until]."""
        return [o for o in self._windows.get((deployment, artifact_id), ()) if since <= o.at <= until]

    def outcomes(self, since: float, until: float) -> list[tuple[str, str, Outcome]]:
        """(deployment, artifact, outcome) of every request that finished in [since, until), whatever its arm."""
        found = []
        for (deployment, artifact_id), window in list(self._windows.items()):
            for outcome in reversed(window):  # appended as they finish: the newest last
                if outcome.at < since:
                    break
                if outcome.at < until:
                    found.append((deployment, artifact_id, outcome))
        return found

    def stats(self, deployment: str, artifact_id: str, since: float, until: float | None = None) -> ArmStats:
        """Requests of this deployment served by this artifact that finished in [since, until]."""
        until = time.time() if until is None else until
        return stats_of(self.window(deployment, artifact_id, since, until))


def stats_of(outcomes: list[Outcome]) -> ArmStats:
    """Counts and latency quantiles of these requests (latencies of those not failed on the serving side)."""
    if not outcomes:
        return ArmStats()
    ok = [o for o in outcomes if not o.server_error]
    ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
    tpots = sorted(o.tpot_s for o in ok if o.tpot_s is not None)
    return ArmStats(
        requests=len(outcomes), errors=len(outcomes) - len(ok),
        ttft_p50_s=quantile(ttfts, 0.5), ttft_p95_s=quantile(ttfts, 0.95),
        tpot_p50_s=quantile(tpots, 0.5), tpot_p95_s=quantile(tpots, 0.95),
        generated_tokens=sum(o.tokens for o in outcomes), ttft_samples=len(ttfts), tpot_samples=len(tpots),
    )


class _WorkersByHealth:
    """A collector rather than a Gauge kept up to date: health changes in many places (heartbeats, failed
    requests, expiry, quarantines running out), and a count taken at scrape time cannot miss one."""

    def __init__(self, health_labels: Callable[[], Iterable[str]]):
        self._health_labels = health_labels

    def collect(self):
        family = GaugeMetricFamily("qserve_gateway_workers", "Workers registered with this gateway, by health "
                                   "(stalled: its engine stopped moving; quarantined: failing request after "
                                   "request among healthy peers)", labels=["health"])
        counts = collections.Counter(self._health_labels())
        for label in WORKER_HEALTH_LABELS:
            family.add_metric([label], counts.get(label, 0))
        yield family

"""Prometheus metrics of one worker, on their own registry (several workers may share a process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.worker.config import ConfigError
from services.worker.engine.outputs import EngineStats, FinishInfo
from shared.rpc.serving import serve_metrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A batch-1 decode step (~2 ms on an H200) to a long prompt step on the CPU backend (seconds).
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


_GAUGES = {
    "qserve_worker_running_requests": ("Sequences in the running batch.", lambda s: s.running),
    "qserve_worker_waiting_requests": ("Requests waiting for admission.", lambda s: s.waiting),
    "qserve_worker_kv_blocks_used": ("KV cache blocks in use.", lambda s: s.kv_blocks_used),
    "qserve_worker_kv_blocks_free": ("KV cache blocks free.", lambda s: s.kv_blocks_free),
    "qserve_worker_kv_usage_ratio": ("Used fraction of the KV cache.",
                                     lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0),
    "qserve_worker_kv_blocks_cached": ("KV cache blocks holding a cached prompt prefix (in use, or free and kept "
                                       "until the space is needed).", lambda s: s.kv_blocks_cached),
}

# Counted by the engine since it started, as counters are.
_COUNTERS = {
    # A preempted sequence gave its KV blocks back to be recomputed later: the sign of a cache too small for the load.
    "qserve_worker_preemptions": ("Sequences preempted: KV blocks taken back, recomputed later.",
                                  lambda s: s.preemptions),
    # hit / queried is the prefix cache's hit rate: the share of prompt tokens not computed again.
    "qserve_worker_prefix_cache_queried_tokens": ("Prompt tokens looked up in the prefix cache at admission.",
                                                  lambda s: s.prefix_cache_queried_tokens),
    "qserve_worker_prefix_cache_hit_tokens": ("Prompt tokens found in the prefix cache (their K/V reused).",
                                              lambda s: s.prefix_cache_hit_tokens),
}


class _EngineCollector(Collector):
    """The engine's state, from one stats() call per scrape: read once per gauge, the engine moves
    between the reads and used + free need not add up to the total on the same page."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        for name, (doc, read) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=read(s))
        for name, (doc, read) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc, value=read(s))

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # Names only, without calling stats(): registering must not read an engine that may not run yet.
        for name, (doc, _read) in _GAUGES.items():
            yield GaugeMetricFamily(name, doc)
        for name, (doc, _read) in _COUNTERS.items():
            yield CounterMetricFamily(name, doc)


class WorkerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], probe_error: float | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        if probe_error is not None:  # measured at start-up (services/worker/probe_check.py); absent when not
            # Alerting on it shows a GPU, driver or kernel change drifting toward --probe-max-error before a
            # worker is refused for it.
            Gauge("qserve_worker_probe_relative_error", "The start-up probe's mean relative L2 error of this "
                  "worker's logits against the artifact's reference logits.", registry=r).set(probe_error)
        self.ttft = Histogram("qserve_worker_time_to_first_token_seconds", "Arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("qserve_worker_time_per_output_token_seconds", "Mean gap between generated tokens.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.queue = Histogram("qserve_worker_queue_time_seconds", "Arrival to the first scheduling step.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("qserve_worker_requests", "Finished requests by finish reason (error: ended by an "
                                "engine error; non_finite_logits: by NaN / inf logits).", ["reason"], registry=r)
        self.rejected = Counter("qserve_worker_rejected_requests", "Generate calls refused, by status code.",
                                ["code"], registry=r)
        self.generated = Counter("qserve_worker_generated_tokens", "Tokens generated.", registry=r)
        self.step = Histogram("qserve_worker_step_seconds", "Model steps, launch to tokens on the host, by kind "
                              "(decode: one new token per sequence; prompt: prompt tokens in the step).", ["kind"],
                              buckets=_STEP_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))
        self._server = None

    def observe_step(self, kind: str, seconds: float) -> None:
        """Engine.on_step: runs on the engine's thread (prometheus_client's metrics are thread-safe)."""
        self.step.labels(kind).observe(seconds)

    def observe_error(self, non_finite: bool = False, generated_tokens: int = 0) -> None:
        # Apart from other engine errors: NaN / inf logits on an artifact that passed its start-up self-check
        # point at the device (or at prompts its numerics cannot take), the alert a failing GPU needs.
        self.finished.labels("non_finite_logits" if non_finite else "error").inc()
        # Streamed before the error: left out, a failing GPU's token rate read low, and unlike the gateway's.
        self.generated.inc(generated_tokens)

    def observe_cancelled_before_admission(self) -> None:
        """A caller gone while its prompt was tokenized: it never reached the engine, which counts the rest."""
        self.finished.labels("abort").inc()

    def observe_finish(self, finish: FinishInfo) -> None:
        self.finished.labels(finish.reason.name.lower()).inc()
        self.generated.inc(finish.generated_tokens)
        self.queue.observe(finish.queue_s)
        if finish.generated_tokens:
            self.ttft.observe(finish.time_to_first_token_s)
        if finish.generated_tokens >= 2:
            self.tpot.observe(finish.time_per_output_token_s)

    def serve(self, host: str, port: int) -> int:
        """Starts the /metrics HTTP server (a daemon thread); returns its port (ConfigError when it
        cannot be opened)."""
        self._server = serve_metrics(self.registry, host, port, "--metrics-port", ConfigError)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

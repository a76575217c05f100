"""The worker's /metrics page as Prometheus scrapes it, after real Generate traffic: naming, one count
per finished / aborted / refused request under the right label, one histogram sample per request in
seconds, and gauges back at idle once the work is over."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from prometheus_client import generate_latest

from services.worker.engine.outputs import EngineStats
from services.worker.metrics import WorkerMetrics
from shared.rpc.qserve.v1 import common_pb2, worker_pb2
from tests.prometheus_scrape import bucket_bounds, check_conventions, families, scrape_text, value
from tests.worker.test_service import _wait_for, client, worker  # noqa: F401 (the same small worker fixtures)

PROMPT = [17, 300, 42, 9, 1200, 77]
HISTOGRAMS = ("qserve_worker_time_to_first_token_seconds", "qserve_worker_time_per_output_token_seconds",
              "qserve_worker_queue_time_seconds")


def _request(request_id="", **sampling) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(request_id=request_id, token_ids=common_pb2.TokenIds(ids=PROMPT),
                                      sampling=common_pb2.SamplingParams(**sampling))


@pytest.fixture
def scrape(worker):
    return lambda: families(scrape_text(worker.server.metrics_port))


def _counts(fams: dict) -> dict[str, float]:
    """Every counter sample and histogram count, by sample name and labels."""
    out = {}
    for family in fams.values():
        for s in family.samples:
            if s.name.endswith(("_total", "_count")):
                out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def _delta(before: dict, after: dict) -> dict[str, float]:
    keys = set(before) | set(after)
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys if after.get(k, 0.0) != before.get(k, 0.0)}


def _idle(fams: dict) -> bool:
    return all(value(fams, name) == 0 for name in (
        "qserve_worker_running_requests", "qserve_worker_waiting_requests", "qserve_worker_kv_blocks_used"))


def test_a_finished_request_is_one_count_and_one_sample_of_each_histogram(client, scrape):
    before = scrape()
    messages = list(client.Generate(_request(max_new_tokens=4, ignore_eos=True), timeout=60))
    assert messages[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
    after = scrape()
    check_conventions(after, "qserve_worker_")
    assert _delta(_counts(before), _counts(after)) == {
        "qserve_worker_requests_total[('reason', 'length')]": 1,
        "qserve_worker_generated_tokens_total[]": 4,
        **{f"{h}_count[]": 1 for h in HISTOGRAMS},
        # one step prefills the 6-token prompt and samples token 1, three decode steps the rest
        "qserve_worker_step_seconds_count[('kind', 'prompt')]": 1,
        "qserve_worker_step_seconds_count[('kind', 'decode')]": 3,
        # its 6 prompt tokens looked up in the prefix cache (none found: no block of 4 was cached before)
        "qserve_worker_prefix_cache_queried_tokens_total[]": 6,
    }
    timings = messages[-1].finish.timings
    ttft = timings.time_to_first_token.ToTimedelta().total_seconds()
    growth = value(after, "qserve_worker_time_to_first_token_seconds_sum") - \
        value(before, "qserve_worker_time_to_first_token_seconds_sum")
    assert growth == pytest.approx(ttft, abs=1e-6)  # seconds, as the Finish message says
    _wait_for(lambda: _idle(scrape()), what="idle gauges")
    idle = scrape()
    assert value(idle, "qserve_worker_kv_usage_ratio") == 0 and value(idle, "qserve_worker_kv_blocks_free") == 64


def test_aborted_and_cancelled_requests_count_once_as_abort_and_gauges_return_to_idle(client, scrape):
    before = _counts(scrape())
    call = client.Generate(_request(request_id="to-abort", ignore_eos=True), timeout=60)
    stream = iter(call)
    next(stream)
    assert client.Abort(worker_pb2.AbortRequest(request_id="to-abort"), timeout=10).found
    list(stream)
    cancelled = client.Generate(_request(ignore_eos=True), timeout=60)
    next(iter(cancelled))
    cancelled.cancel()
    _wait_for(lambda: _idle(scrape()), what="idle gauges after the abort and the cancel")
    _wait_for(lambda: _counts(scrape()).get("qserve_worker_requests_total[('reason', 'abort')]", 0)
              == before.get("qserve_worker_requests_total[('reason', 'abort')]", 0) + 2, what="both aborts counted")
    delta = _delta(before, _counts(scrape()))
    assert delta["qserve_worker_requests_total[('reason', 'abort')]"] == 2
    assert not [k for k in delta if k.startswith("qserve_worker_rejected")]
    assert delta["qserve_worker_queue_time_seconds_count[]"] == 2


def test_each_refusal_is_one_count_of_its_code_and_no_finish(client, scrape):
    before = _counts(scrape())
    with pytest.raises(grpc.RpcError):
        list(client.Generate(_request(temperature=-1.0), timeout=10))
    running = client.Generate(_request(request_id="dup", ignore_eos=True), timeout=60)
    next(iter(running))
    with pytest.raises(grpc.RpcError):
        list(client.Generate(_request(request_id="dup"), timeout=10))
    waiting = client.Generate(_request(request_id="second", max_new_tokens=2), timeout=60)
    _wait_for(lambda: value(scrape(), "qserve_worker_waiting_requests") == 1, what="the second request to wait")
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(_request(request_id="third", max_new_tokens=2), timeout=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    running.cancel()
    list(waiting)
    _wait_for(lambda: _idle(scrape()), what="idle gauges")
    after = scrape()
    delta = _delta(before, _counts(after))
    rejected = {k: v for k, v in delta.items() if k.startswith("qserve_worker_rejected")}
    assert rejected == {"qserve_worker_rejected_requests_total[('code', 'INVALID_ARGUMENT')]": 1,
                        "qserve_worker_rejected_requests_total[('code', 'ALREADY_EXISTS')]": 1,
                        "qserve_worker_rejected_requests_total[('code', 'RESOURCE_EXHAUSTED')]": 1}
    finished = {k: v for k, v in delta.items() if k.startswith("qserve_worker_requests_total")}
    assert finished == {"qserve_worker_requests_total[('reason', 'abort')]": 1,
                        "qserve_worker_requests_total[('reason', 'length')]": 1}
    # No request id (nor any other per-request value) became a label.
    for family in after.values():
        for s in family.samples:
            assert not {"dup", "second", "third", "to-abort"} & set(s.labels.values()), s


def _metrics(**stats) -> WorkerMetrics:
    base = dict(running=0, waiting=0, kv_blocks_total=10, kv_blocks_free=10, kv_blocks_used=0, preemptions=0)
    base.update(stats)
    return WorkerMetrics(lambda: EngineStats(**base))


def test_preemptions_are_exported_as_a_counter():
    """A preempted sequence gives its KV blocks back and is recomputed later: the sign of a cache too
    small for the load, which an operator must see (the engine counts them since start)."""
    fams = families(generate_latest(_metrics(preemptions=3).registry).decode())
    assert fams["qserve_worker_preemptions"].type == "counter"
    assert value(fams, "qserve_worker_preemptions_total") == 3
    check_conventions(fams, "qserve_worker_")


def test_gauges_read_one_snapshot_of_the_engine_per_scrape():
    """Used + free must add up to the total on every scrape: read from one stats() call, not one each."""
    calls = []

    def stats():
        calls.append(1)
        n = len(calls)  # the engine moves between two reads
        return EngineStats(running=1, waiting=0, kv_blocks_total=10, kv_blocks_free=10 - n, kv_blocks_used=n,
                           preemptions=0)

    fams = families(generate_latest(WorkerMetrics(stats).registry).decode())
    assert value(fams, "qserve_worker_kv_blocks_used") + value(fams, "qserve_worker_kv_blocks_free") == 10
    assert value(fams, "qserve_worker_kv_usage_ratio") == value(fams, "qserve_worker_kv_blocks_used") / 10
    assert len(calls) == 1


def test_latency_buckets_reach_from_milliseconds_to_a_minute():
    fams = families(generate_latest(_metrics().registry).decode())
    for name in HISTOGRAMS:
        bounds = bucket_bounds(fams, name)
        assert bounds[-1] >= 60 or name.endswith("per_output_token_seconds"), (name, bounds)
        assert bounds[0] <= 0.005, (name, bounds)
    assert bucket_bounds(fams, "qserve_worker_time_per_output_token_seconds")[0] <= 0.001


def test_requests_failed_by_non_finite_logits_are_counted_apart(worker, client, scrape):
    """A GPU turning out NaNs after start-up (the self-check passed) showed as a generic engine error."""
    list(client.Generate(_request(max_new_tokens=1), timeout=60))  # its prompt's first block is cached now
    assert value(scrape(), "qserve_worker_kv_blocks_cached") > 0
    runner = worker.server.served.engine.runner
    step = runner.step
    runner.step = lambda batch: step(batch).fill_(float("nan"))
    before = scrape()
    with pytest.raises(grpc.RpcError) as failed:
        list(client.Generate(_request(max_new_tokens=4), timeout=60))
    assert failed.value.code() == grpc.StatusCode.INTERNAL and "non-finite logits" in failed.value.details()
    runner.step = step
    after = scrape()
    delta = _delta(_counts(before), _counts(after))
    assert delta == {"qserve_worker_requests_total[('reason', 'non_finite_logits')]": 1,
                     "qserve_worker_step_seconds_count[('kind', 'prompt')]": 1,
                     "qserve_worker_prefix_cache_queried_tokens_total[]": 6,
                     "qserve_worker_prefix_cache_hit_tokens_total[]": 4}, delta
    # The cached prefixes may hold the K/V that gave the NaNs: forgotten, no later request reuses them.
    assert value(after, "qserve_worker_kv_blocks_cached") == 0


def test_time_to_first_token_and_queue_time_count_tokenizing(worker, client, scrape, monkeypatch):
    """They started when the engine got the request, after its prompt was tokenized (and after it waited for a
    thread to do that): a worker slow to tokenize long prompts under load showed nothing of it."""
    tokenizer = worker.server.served.tokenizer
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: (time.sleep(0.4), encode(*a, **k))[1])
    before = scrape()
    request = worker_pb2.GenerateRequest(text="hello there", sampling=common_pb2.SamplingParams(max_new_tokens=2))
    finish = list(client.Generate(request, timeout=60))[-1].finish
    after = scrape()
    for name in ("qserve_worker_time_to_first_token_seconds_sum", "qserve_worker_queue_time_seconds_sum"):
        assert value(after, name) - value(before, name) >= 0.4, name
    assert finish.timings.time_to_first_token.ToTimedelta().total_seconds() >= 0.4


def test_a_request_cancelled_while_its_prompt_is_tokenized_counts_as_abort_and_as_waiting(worker, client, scrape,
                                                                                           monkeypatch):
    """It was counted nowhere (it never reached the engine), and no gauge showed it while it was tokenized."""
    tokenizer = worker.server.served.tokenizer
    encode, started = tokenizer.encode, threading.Event()

    def slow_encode(*args, **kwargs):
        started.set()
        time.sleep(1.0)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    before = _counts(scrape())
    call = client.Generate(worker_pb2.GenerateRequest(text="hello"), timeout=60)
    reader = threading.Thread(target=lambda: next(call, None), daemon=True)  # reading sends the request
    reader.start()
    assert started.wait(10)
    assert value(scrape(), "qserve_worker_waiting_requests") == 1
    call.cancel()
    reader.join(10)
    _wait_for(lambda: _delta(before, _counts(scrape())).get("qserve_worker_requests_total[('reason', 'abort')]") == 1,
              what="the cancel counted as an abort")


def test_tokens_streamed_before_an_engine_error_are_counted(worker, client, scrape):
    """Only finished requests added to the generated-tokens counter: a failing GPU's token rate read low."""
    runner = worker.server.served.engine.runner
    step, steps = runner.step, []

    def fail_the_third(batch):
        steps.append(1)
        if len(steps) == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step(batch)

    runner.step = fail_the_third
    before = scrape()
    streamed = 0
    try:
        with pytest.raises(grpc.RpcError) as failed:
            for message in client.Generate(_request(max_new_tokens=8, ignore_eos=True), timeout=60):
                streamed += len(message.token_ids)
    finally:
        runner.step = step
    assert failed.value.code() == grpc.StatusCode.INTERNAL and streamed == 2
    delta = _delta(_counts(before), _counts(scrape()))
    assert delta["qserve_worker_requests_total[('reason', 'error')]"] == 1
    assert delta["qserve_worker_generated_tokens_total[]"] == streamed


def test_the_start_up_probe_error_is_a_gauge(scrape):
    fams = scrape()
    assert fams["qserve_worker_probe_relative_error"].type == "gauge"
    assert 0 <= value(fams, "qserve_worker_probe_relative_error") < 0.01  # the fp16 artifact on the CPU reference


def test_a_worker_whose_probe_was_not_checked_has_no_gauge():
    metrics = WorkerMetrics(lambda: EngineStats(0, 0, 0, 0, 0, 0), probe_error=None)
    assert b"qserve_worker_probe_relative_error" not in generate_latest(metrics.registry)


def test_prefix_cache_blocks_are_reused_within_one_cache_scope_only(client, scrape):
    """Shared by every request, the prefix cache let a client time whether another client's prompt prefix (a
    system prompt, a document) had been seen: the gateway gives each API key its own scope."""
    prompt = common_pb2.TokenIds(ids=list(range(2000, 2040)))  # ten blocks of 4

    def hit_tokens(scope: str) -> float:
        before = value(scrape(), "qserve_worker_prefix_cache_hit_tokens_total")
        list(client.Generate(worker_pb2.GenerateRequest(token_ids=prompt, cache_scope=scope,
                                                        sampling=common_pb2.SamplingParams(max_new_tokens=1)),
                             timeout=60))
        return value(scrape(), "qserve_worker_prefix_cache_hit_tokens_total") - before

    assert hit_tokens("tenant-a") == 0
    assert hit_tokens("tenant-a") == 36  # its own: all but the block holding the last prompt token
    assert hit_tokens("tenant-b") == 0 and hit_tokens("") == 0
    with pytest.raises(grpc.RpcError) as refused:
        list(client.Generate(worker_pb2.GenerateRequest(token_ids=prompt, cache_scope="x" * 129), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cache_scope" in refused.value.details()

"""Generation through the worker's engine (services/worker/engine/engine.py) for the e2e benchmark.

A static batch of requests arrives at once; the engine's own loop (scheduler with chunked
prefill and continuous batching, block manager, sampler, detokenizer) runs them on the caller's
thread, greedy, `ignore_eos`, `max_new_tokens` = the output length. Decode steps of the full batch
replay the runner's CUDA graphs; prefill steps (which also carry the decode tokens of sequences
admitted earlier) run eagerly. The detokenizer gets a decoder that returns no text (random token
ids have no meaning here; its bookkeeping still runs).
"""

from __future__ import annotations

import time

import torch

from services.worker.engine.engine import Engine, EngineLimits
from services.worker.engine.sequence import SamplingOptions


class _NoText:
    def decode(self, ids: list[int]) -> str:
        return ""


def make_engine(runner, batch: int, total_len: int, max_batch_tokens: int, overlap: bool | None = None,
                prefix_caching: bool = False) -> Engine:
    """An engine whose cache holds `batch` full contexts plus the scheduler's one spare block each.
    overlap None: the engine's default (on with a GPU)."""
    per_seq = -(-total_len // runner.block_size) + 1
    limits = EngineLimits(num_blocks=batch * per_seq, max_running=batch, max_waiting=batch,
                          max_batch_tokens=max_batch_tokens, max_context=total_len)
    return Engine(runner, _NoText(), limits, eos_token_ids=(), overlap=overlap, prefix_caching=prefix_caching)


def run_requests(engine: Engine, prompts: list[list[int]], out_len: int, tag: str,
                 token_ids: dict[int, list[int]] | None = None) -> dict:
    """Submits every prompt at once and steps the engine until all finish; token_ids, when given, receives
    each prompt's generated ids (by index)."""
    vocab_outputs: dict[str, int] = {}
    finished: dict[str, object] = {}
    first_token_at: dict[str, float] = {}

    def sink(out) -> None:
        if out.error:
            raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        if out.request_id not in first_token_at:
            first_token_at[out.request_id] = time.perf_counter()
        vocab_outputs[out.request_id] = vocab_outputs.get(out.request_id, 0) + len(out.token_ids)
        if token_ids is not None:
            token_ids.setdefault(int(out.request_id.rsplit("-", 1)[1]), []).extend(out.token_ids)
        if out.finish is not None:
            finished[out.request_id] = out.finish

    options = SamplingOptions(max_new_tokens=out_len, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, options, sink)
    steps = 0
    all_first = None  # (time, tokens so far, steps) once every request has its first token
    while engine.step():
        steps += 1
        if all_first is None and len(first_token_at) == len(prompts):
            all_first = (time.perf_counter(), sum(vocab_outputs.values()), steps)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    if len(finished) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(finished)} requests did not finish")
    tokens = sum(vocab_outputs.values())
    t_first, tokens_first, steps_first = all_first
    infos = list(finished.values())
    return {
        "total_s": t1 - t0, "output_tokens": tokens, "steps": steps,
        "all_first_tokens_s": t_first - t0, "steps_until_all_first": steps_first,
        "after_all_first_s": t1 - t_first, "tokens_after_all_first": tokens - tokens_first,
        "ttft_mean_s": sum(f.time_to_first_token_s for f in infos) / len(infos),
        "ttft_max_s": max(f.time_to_first_token_s for f in infos),
        "tpot_mean_s": sum(f.time_per_output_token_s for f in infos) / len(infos),
        "preemptions": engine.stats().preemptions, "overlap": engine.overlap,
    }


def generate_with_engine(runner, batch: int, prompt_len: int, out_len: int, max_batch_tokens: int,
                         seed: int = 0, overlap: bool | None = None) -> dict:
    engine = make_engine(runner, batch, prompt_len + out_len, max_batch_tokens, overlap)
    g = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    # Warm-up outside the timing: one full prefill step's worth of requests compiles the prefill
    # kernels at the benchmark's step shape; then every decode graph up to the batch is captured.
    # The two times are what a worker's start-up adds for the same work (compiles are cached per
    # process, so only a format's first run pays them).
    t0 = time.perf_counter()
    warm = min(batch, max(1, max_batch_tokens // prompt_len))
    run_requests(engine, torch.randint(0, vocab, (warm, prompt_len), generator=g).tolist(), 3, "warm")
    t1 = time.perf_counter()
    if runner.graphs is not None:
        top = runner.graphs.bucket_for(batch) or runner.graphs.buckets[-1]
        runner.capture_graphs(tuple(b for b in runner.graphs.buckets if b <= top))
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    return {**run_requests(engine, prompts, out_len, "run"), "warm_up_s": t1 - t0, "capture_graphs_s": t2 - t1}

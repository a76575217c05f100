"""A static-batch generation driver on a ModelRunner, and the memory sizing the e2e bench uses.

The static driver (`--driver static`; e2e_engine.py drives the worker's engine instead) runs the
runner directly, the way the engine's steps look for a static batch: every
prompt is prefilled whole (several prompts per step, up to a token budget), the first token is
sampled from the prefill logits, then one decode step per output token for the whole batch,
greedy sampling on the GPU with one device->host transfer of the token ids per step (what an
engine's scheduler needs), no early stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from services.worker.engine.runner import SequenceChunk, StepBatch

GiB = 1 << 30
# Device memory outside torch's caching allocator (CUDA context, cuBLAS workspace, Triton's
# loaded modules) that a budget must also hold: an allowance, not measured by the benchmark.
CONTEXT_RESERVE = 1 * GiB


@dataclass(slots=True)
class Timing:
    batch: int
    prefill_s: float
    decode_s: float
    output_tokens: int
    decode_steps: int


def blocks_per_seq(runner, total_len: int) -> int:
    return -(-total_len // runner.block_size)


def max_batch_for_budget(runner, budget_bytes: int, total_len: int, prefill_tokens: int, spare_blocks: int = 0) -> dict:
    """The most sequences of total_len tokens whose KV cache fits beside weights and activations
    (spare_blocks: extra blocks per sequence the driver's allocator keeps, 1 for the engine's scheduler)."""
    # activation_bytes covers the decode graphs' private pool and logits too
    free = budget_bytes - CONTEXT_RESERVE - runner.weight_bytes() - runner.activation_bytes(prefill_tokens)
    per_seq = (blocks_per_seq(runner, total_len) + spare_blocks) * runner.kv_block_bytes()
    return {"budget_GiB": budget_bytes / GiB, "weights_GiB": runner.weight_bytes() / GiB,
            "activations_GiB": runner.activation_bytes(prefill_tokens) / GiB,
            "context_reserve_GiB": CONTEXT_RESERVE / GiB, "kv_per_seq_MiB": per_seq / (1 << 20),
            "max_batch": max(0, free // per_seq)}


def generate(runner, batch: int, prompt_len: int, out_len: int, prefill_tokens: int, seed: int = 0) -> Timing:
    """Prefill `batch` random prompts, then out_len - 1 decode steps; returns wall times (synchronized)."""
    per_seq = blocks_per_seq(runner, prompt_len + out_len)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    g = torch.Generator().manual_seed(seed)
    vocab = runner.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    group = max(1, prefill_tokens // prompt_len)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    firsts = []
    for start in range(0, batch, group):
        chunks = [SequenceChunk(i, prompts[i], 0, tables[i], True) for i in range(start, min(batch, start + group))]
        firsts.append(runner.step(StepBatch(chunks)).argmax(-1))
    tokens = torch.cat(firsts).tolist()  # the first output token of every sequence, on the host
    t1 = time.perf_counter()
    for step in range(out_len - 1):
        pos = prompt_len + step
        chunks = [SequenceChunk(i, [tokens[i]], pos, tables[i], True) for i in range(batch)]
        tokens = runner.step(StepBatch(chunks)).argmax(-1).tolist()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return Timing(batch, t1 - t0, t2 - t1, batch * out_len, out_len - 1)


def warm_up(runner, batch: int, prompt_len: int, prefill_tokens: int) -> None:
    """Compiles the prefill kernels at the benchmark's step shape and captures the decode graph."""
    group = min(batch, max(1, prefill_tokens // prompt_len))
    generate(runner, group, prompt_len, 3, prefill_tokens, seed=99)
    runner.capture_graphs((runner.graphs.bucket_for(batch),) if runner.graphs else None)

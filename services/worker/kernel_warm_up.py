"""Start-up: launches each attention kernel in every form a request can need, so that none compiles while
the worker serves (a cold Triton cache compiles for seconds, stalling every stream of the worker).

The CUDA graphs compile what they capture (every step piece's GEMM, norm and KV-write kernels, and decode
attention as the graphs run it), and the self-check and the probe a little more. Attention of a step with
prompt tokens runs outside the graphs, and Triton compiles each of its kernels once per launch-overlap class
of the launch's rows (launch_overlap.pdl_mode: up to 16 rows, up to 256, more) and, for decode rows in such
a step, with and without the split over the context (short contexts are not split). On an H100 a fresh
worker's first requests compiled 4 such kernels, and its first burst of traffic took 39 s instead of 0.9 s
(bench/results/h100/serving_compiles.json). Here each form is launched once, on the runner's own step, with
the cache's blocks as scratch: the K/V it writes there are garbage that no request reads (the caller empties
the prefix cache after), and the logits are thrown away.

Decode attention compiles slowest by far: on an H100 host each form of the KV4 kernel (launch-overlap class x
split over the context) took ~40 s, 162 of a cold start-up's 180 s of compiling
(bench/results/h100/start_up_compile_times.json), nearly all in one Triton pass (TritonGPUCoalesce, which
walks the whole kernel once per load and store). Triton's compiler releases the GIL, so
compile_decode_attention compiles those forms at once, one thread each, before the graphs capture them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from services.worker.engine.runner import SequenceChunk, StepBatch
from services.worker.kernels.launch_overlap import AFTER_WAIT_MAX_ROWS, PDL_MAX_ROWS, pdl_mode
from services.worker.kernels.paged_attention import DECODE_KERNELS, decode_partitions, paged_decode_attention

log = logging.getLogger(__name__)

# A launch of each row class of launch_overlap.pdl_mode (after_wait, late, none). Two rows, not one: a chunk
# of one token continuing a sequence is a decode row to the runner.
ROW_CLASSES = (2, AFTER_WAIT_MAX_ROWS + 1, PDL_MAX_ROWS + 1)


def warm_attention_kernels(runner, num_blocks: int, max_context: int, max_batch_tokens: int,
                           max_running: int) -> None:
    """Runs steps with prompt rows of each row class (a prompt's first chunk, a chunk continuing a cached
    prefix) and steps mixing a prompt token with decode rows of each row class at a short and at the longest
    context, within the worker's limits (a class the limits never reach is skipped: serving never reaches it)."""
    started = time.perf_counter()
    block = runner.block_size
    tokens = min(max_context, num_blocks * block)

    def table(positions: int) -> list[int]:
        return list(range(math.ceil(positions / block)))

    steps: list[StepBatch] = []
    for rows in ROW_CLASSES:
        if rows > max_batch_tokens or rows >= tokens:
            continue
        steps.append(StepBatch([SequenceChunk(0, [1] * rows, 0, table(rows), True)]))  # a first chunk
        start = min(block, tokens - rows)  # a chunk continuing a cached prefix of `start` tokens
        steps.append(StepBatch([SequenceChunk(0, [1] * rows, start, table(start + rows), True)]))
    for rows in ROW_CLASSES:
        if rows + 1 > max_batch_tokens or rows > max_running:
            continue
        for context in sorted({min(2, tokens), tokens}):
            if context < 2:
                continue
            # The decode rows share one block table: they only read it, but for their own new slot.
            shared = table(context)
            decode = [SequenceChunk(1 + i, [1], context - 1, shared, True) for i in range(rows)]
            steps.append(StepBatch([SequenceChunk(0, [1], 0, [0], True)] + decode))
    for batch in steps:
        runner.step(batch)
    log.info("attention kernels launched in every form a request can need (%d steps) in %.1f s", len(steps),
             time.perf_counter() - started)


def decode_attention_forms(pdl_class, partitions, max_running: int, max_context: int, graph_batches: tuple[int, ...],
                           graph_context: int) -> dict[tuple[int, bool], tuple[int, int]]:
    """{(launch-overlap mode, split): (rows, context) of one launch in that form} for every form serving can
    reach: eager steps (any rows up to max_running, any context up to max_context: each class's fewest rows
    split soonest, the longest context most) and the decode graphs (each batch at graph_context).
    pdl_class(rows) and partitions(rows, context) are the launcher's own rules (launch_overlap.pdl_mode,
    paged_attention.decode_partitions)."""
    launches = [(min(rows, max_running), context) for rows in (1, AFTER_WAIT_MAX_ROWS + 1, PDL_MAX_ROWS + 1)
                for context in (1, max_context)]
    launches += [(rows, graph_context) for rows in graph_batches]
    forms: dict[tuple[int, bool], tuple[int, int]] = {}
    for rows, context in launches:
        forms.setdefault((pdl_class(rows), partitions(rows, context) > 1), (rows, context))
    return forms


def compile_decode_attention(runner, max_context: int, max_running: int) -> int:
    """Compiles (and launches once, on layer 0's cache with every table entry block 0) decode attention in each
    form serving can reach, all at once; returns how many. The tensors are laid out as the runner's (the query
    a slice of its rotated q/k rows, block tables of its width), so that Triton's specialization (alignment,
    multiples of 16) is the same as at the runner's launches and these compiles are the ones they use."""
    device, c = runner.device, runner.config
    graphs = runner.graphs
    forms = decode_attention_forms(
        lambda rows: pdl_mode(device, rows),
        lambda rows, context: decode_partitions(rows, c.num_heads, c.head_dim, runner.k_cache[0], context),
        max_running, max_context, graphs.buckets if graphs is not None else (), runner.max_model_len,
    )
    on_gpu = device.type == "cuda"  # elsewhere (the CPU tests' interpreter, not thread-safe) one at a time
    index = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None
    for kernel in DECODE_KERNELS if on_gpu else ():
        # Triton makes a kernel's per-device cache at its first launch on the device: made by two threads at
        # once, one thread's compile would land in a cache that is then dropped (and compile again later).
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            caches[index]

    def launch(rows: int, context: int) -> None:
        with torch.cuda.device(index) if on_gpu else contextlib.nullcontext():  # a new thread's device is 0
            rotated = torch.zeros((rows, c.num_heads + c.num_kv_heads, c.head_dim), dtype=torch.float16, device=device)
            tables = torch.zeros((rows, runner.max_blocks), dtype=torch.int32, device=device)
            lens = torch.full((rows,), context, dtype=torch.int32, device=device)
            paged_decode_attention(rotated[:, : c.num_heads], runner.k_cache[0], runner.v_cache[0], tables, lens,
                                   max_context_len=context)

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(len(forms), os.cpu_count() or 1) if on_gpu else 1)) as pool:
            for done in [pool.submit(launch, rows, context) for rows, context in forms.values()]:
                done.result()
        if on_gpu:
            torch.cuda.synchronize(device)
    except Exception:  # only a speed-up: the graphs and the warm-up launch these forms again
        # A form that cannot launch fails there too, one at a time, and stops the start-up with its own error.
        log.warning("compiling decode attention's forms at once failed; they compile one at a time instead",
                    exc_info=True)
        return 0
    log.info("decode attention compiled in %d forms at once in %.1f s", len(forms), time.perf_counter() - started)
    return len(forms)

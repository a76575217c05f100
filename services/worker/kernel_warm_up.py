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
"""

from __future__ import annotations

import logging
import math
import time

from services.worker.engine.runner import SequenceChunk, StepBatch
from services.worker.kernels.launch_overlap import AFTER_WAIT_MAX_ROWS, PDL_MAX_ROWS

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

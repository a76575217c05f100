"""A StepBatch turned into the index tensors one forward step needs (built on the host, copied once).

Rows are the batch's tokens in batch order. Attention splits them two ways:

* chunks starting at position 0 attend only to themselves: causal varlen prefill attention over
  the chunk's own fp16 K/V (`cu_seqlens`);
* every other row (a decode token, or a prompt chunk continuing a cached prefix) attends through
  the paged cache, as one paged-decode query per row whose context is its position + 1: the cache
  already holds this step's K/V when attention runs, so causality within the chunk comes from the
  per-row context length.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from services.worker.engine.runner import StepBatch


@dataclass(slots=True)
class HostStep:
    """numpy arrays of one step, before the copy to the device."""

    tokens: np.ndarray  # (T,) int64
    positions: np.ndarray  # (T,) int32
    slots: np.ndarray  # (T,) int64, block * block_size + offset
    num_prefill: int  # rows [0, Tp) are the chunks starting at position 0, rows [Tp, T) attend through the cache
    cu_seqlens: np.ndarray  # (Bp + 1,) int32 over the prefill rows
    max_seqlen: int
    block_tables: np.ndarray  # (Tq, max_blocks) int32
    context_lens: np.ndarray  # (Tq,) int32 = position + 1
    max_context: int
    logit_rows: np.ndarray  # (n,) int64 rows whose logits are returned


@dataclass(slots=True)
class StepTensors:
    """The same on the device; None marks "all rows" / "no rows" to skip gathers."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    num_prefill: int  # rows [0, num_prefill) are prefill rows, the rest paged
    cu_seqlens: torch.Tensor | None  # None: no prefill rows
    max_seqlen: int
    block_tables: torch.Tensor | None  # None: no paged rows
    context_lens: torch.Tensor | None
    max_context: int
    logit_rows: torch.Tensor | None  # None: every row


def build_host_step(batch: StepBatch, block_size: int, max_blocks: int, max_model_len: int) -> HostStep:
    if batch.is_decode_only:
        return _build_decode_step(batch, block_size, max_blocks, max_model_len)
    tokens, positions, slots, logit_rows = [], [], [], []
    cu, tables, ctx = [0], [], []
    max_seqlen = max_context = 0
    row = 0
    # Prefill chunks (from position 0) take the first rows, so that attention splits the step by
    # slicing rather than by gathering rows; logits still come back in batch order.
    order = sorted(range(len(batch.chunks)), key=lambda i: batch.chunks[i].start_position != 0)
    for i in order:
        chunk = batch.chunks[i]
        n, start = len(chunk.token_ids), chunk.start_position
        if n == 0:
            raise ValueError(f"sequence {chunk.seq_id}: empty chunk")
        if start < 0 or start + n > max_model_len:
            raise ValueError(
                f"sequence {chunk.seq_id}: positions [{start}, {start + n}) are outside [0, {max_model_len}), "
                "the runner's max_model_len"
            )
        need = -(-(start + n) // block_size)
        if len(chunk.block_table) < need:
            raise ValueError(
                f"sequence {chunk.seq_id}: block table has {len(chunk.block_table)} blocks, positions up to "
                f"{start + n} need {need} of {block_size} slots"
            )
        table = np.asarray(chunk.block_table[:need], dtype=np.int64)
        pos = np.arange(start, start + n, dtype=np.int64)
        tokens.append(np.asarray(chunk.token_ids, dtype=np.int64))
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        if start == 0:
            cu.append(cu[-1] + n)
            max_seqlen = max(max_seqlen, n)
        else:
            tables.extend([table] * n)
            ctx.append(pos + 1)
            max_context = max(max_context, start + n)
        if chunk.want_logits:
            logit_rows.append((i, row + n - 1))
        row += n
    block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = table
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    return HostStep(
        tokens=cat(tokens, np.int64),
        positions=cat(positions, np.int32),
        slots=cat(slots, np.int64),
        num_prefill=cu[-1],
        cu_seqlens=np.asarray(cu, dtype=np.int32),
        max_seqlen=max_seqlen,
        block_tables=block_tables,
        context_lens=cat(ctx, np.int32),
        max_context=max_context,
        logit_rows=np.asarray([r for _, r in sorted(logit_rows)], dtype=np.int64),
    )


def to_device(host: HostStep, device: torch.device) -> StepTensors:
    t = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    total = len(host.tokens)
    has_prefill, has_paged = host.num_prefill > 0, host.num_prefill < total
    return StepTensors(
        tokens=t(host.tokens),
        positions=t(host.positions),
        slots=t(host.slots),
        num_prefill=host.num_prefill,
        cu_seqlens=t(host.cu_seqlens) if has_prefill else None,
        max_seqlen=host.max_seqlen,
        block_tables=t(host.block_tables) if has_paged else None,
        context_lens=t(host.context_lens) if has_paged else None,
        max_context=host.max_context,
        logit_rows=None if len(host.logit_rows) == total and (host.logit_rows == np.arange(total)).all() else t(host.logit_rows),
    )


def _build_decode_step(batch: StepBatch, block_size: int, max_blocks: int, max_model_len: int) -> HostStep:
    """The decode-only fast path (one token per chunk), vectorized over rows: a few hundred rows cost
    about a millisecond here, where the general path's per-chunk numpy calls cost several (and a
    decode step is only ~10-30 ms of GPU time)."""
    chunks = batch.chunks
    n = len(chunks)
    tokens = np.fromiter((c.token_ids[0] for c in chunks), np.int64, n)
    positions = np.fromiter((c.start_position for c in chunks), np.int64, n)
    need = positions // block_size + 1
    bad = [c for c, k in zip(chunks, need.tolist()) if c.start_position >= max_model_len or len(c.block_table) < k]
    if bad:
        c = bad[0]
        raise ValueError(
            f"sequence {c.seq_id}: position {c.start_position} must be < max_model_len {max_model_len} and needs "
            f"{c.start_position // block_size + 1} blocks of {block_size} slots; its block table has {len(c.block_table)}"
        )
    # One flat read of every row's first `need` blocks, scattered row-major under a mask.
    flat = np.fromiter(chain.from_iterable(c.block_table[:k] for c, k in zip(chunks, need.tolist())), np.int32,
                       int(need.sum()))
    block_tables = np.zeros((n, max_blocks), dtype=np.int32)
    block_tables[np.arange(max_blocks)[None, :] < need[:, None]] = flat
    rows = np.arange(n, dtype=np.int64)
    slots = block_tables[rows, need - 1].astype(np.int64) * block_size + positions % block_size
    want = np.fromiter((c.want_logits for c in chunks), bool, n)
    return HostStep(
        tokens=tokens,
        positions=positions.astype(np.int32),
        slots=slots,
        num_prefill=0,
        cu_seqlens=np.zeros(1, np.int32),
        max_seqlen=0,
        block_tables=block_tables,
        context_lens=(positions + 1).astype(np.int32),
        max_context=int(positions.max()) + 1,
        logit_rows=rows[want],
    )

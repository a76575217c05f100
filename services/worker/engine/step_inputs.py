"""A StepBatch turned into the index tensors one forward step needs (built on the host, copied once).

Rows are the batch's tokens grouped by how they attend (logits still come back in batch order):

* chunks starting at position 0 attend only to themselves: causal varlen prefill attention over
  the chunk's own fp16 K/V (`cu_seqlens`);
* prompt chunks of 2+ tokens continuing a cached prefix attend through the paged cache, a chunk at
  a time (`chunk_cu`, `chunk_starts`, `chunk_tables`: paged_prefill_attention.py);
* decode tokens (and 1-token continuations) attend through the paged cache one query per row, whose
  context is its position + 1 (`block_tables`, `context_lens`).
The cache already holds this step's K/V when attention runs, so causality within a continuing
chunk comes from the positions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    num_prefill: int  # rows [0, Tp) are the chunks starting at position 0
    cu_seqlens: np.ndarray  # (Bp + 1,) int32 over the prefill rows
    max_seqlen: int
    block_tables: np.ndarray  # (Tq, max_blocks) int32, the decode rows [Tp + Tc, T)
    context_lens: np.ndarray  # (Tq,) int32 = position + 1
    max_context: int
    logit_rows: np.ndarray  # (n,) int64 rows whose logits are returned
    num_chunked: int = 0  # rows [Tp, Tp + Tc): chunks continuing a cached prefix
    chunk_cu: np.ndarray | None = None  # (Bc + 1,) int32 over those rows
    chunk_starts: np.ndarray | None = None  # (Bc,) int32 first position of each
    chunk_tables: np.ndarray | None = None  # (Bc, max_blocks) int32
    max_chunk: int = 0


@dataclass(slots=True)
class StepTensors:
    """The same on the device; None marks "all rows" / "no rows" to skip gathers."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    num_prefill: int  # rows [0, num_prefill) are prefill rows
    cu_seqlens: torch.Tensor | None  # None: no prefill rows
    max_seqlen: int
    block_tables: torch.Tensor | None  # None: no decode rows
    context_lens: torch.Tensor | None
    max_context: int
    logit_rows: torch.Tensor | None  # None: every row
    num_chunked: int = 0  # then rows [num_prefill, num_prefill + num_chunked) of continuing chunks
    chunk_cu: torch.Tensor | None = None  # None: no such rows
    chunk_starts: torch.Tensor | None = None
    chunk_tables: torch.Tensor | None = None
    max_chunk: int = 0


def build_host_step(batch: StepBatch, block_size: int, max_blocks: int, max_model_len: int) -> HostStep:
    if batch.is_decode_only:
        return _build_decode_step(batch, block_size, max_blocks, max_model_len)
    tokens, positions, slots, logit_rows = [], [], [], []
    cu, tables, ctx = [0], [], []
    chunk_cu, chunk_starts, chunk_tables = [0], [], []
    max_seqlen = max_context = max_chunk = 0
    row = 0
    # Rows grouped by attention path (prefill, continuing chunks, decode), so that attention splits
    # the step by slicing rather than by gathering rows.
    def path(i: int) -> int:
        chunk = batch.chunks[i]
        return 0 if chunk.start_position == 0 else 1 if len(chunk.token_ids) > 1 else 2

    order = sorted(range(len(batch.chunks)), key=path)
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
        elif n > 1:
            chunk_cu.append(chunk_cu[-1] + n)
            chunk_starts.append(start)
            chunk_tables.append(table)
            max_chunk = max(max_chunk, n)
        else:
            tables.append(table)
            ctx.append(pos + 1)
            max_context = max(max_context, start + 1)
        if chunk.want_logits:
            logit_rows.append((i, row + n - 1))
        row += n
    cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)  # noqa: E731
    return HostStep(
        tokens=cat(tokens, np.int64),
        positions=cat(positions, np.int32),
        slots=cat(slots, np.int64),
        num_prefill=cu[-1],
        cu_seqlens=np.asarray(cu, dtype=np.int32),
        max_seqlen=max_seqlen,
        block_tables=_table_rows(tables, max_blocks),
        context_lens=cat(ctx, np.int32),
        max_context=max_context,
        logit_rows=np.asarray([r for _, r in sorted(logit_rows)], dtype=np.int64),
        num_chunked=chunk_cu[-1],
        chunk_cu=np.asarray(chunk_cu, dtype=np.int32),
        chunk_starts=np.asarray(chunk_starts, dtype=np.int32),
        chunk_tables=_table_rows(chunk_tables, max_blocks),
        max_chunk=max_chunk,
    )


def _table_rows(tables: list[np.ndarray], max_blocks: int) -> np.ndarray:
    out = np.zeros((len(tables), max_blocks), dtype=np.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = table
    return out


def host_tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """a as a CPU tensor to copy to `device` with non_blocking=True: pinned when the device is a GPU,
    because a copy from pageable memory first waits for everything queued on the stream, i.e. for
    the step in flight that the engine launched this one behind. (The caching host allocator
    recycles the pinned block once the copy is done.)"""
    t = torch.from_numpy(a)
    return t.pin_memory() if device.type == "cuda" else t


def upload(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """a on `device`, copied without waiting for the stream's queued work (host_tensor)."""
    return host_tensor(a, device).to(device, non_blocking=True)


def to_device(host: HostStep, device: torch.device) -> StepTensors:
    t = lambda a: upload(a, device)  # noqa: E731
    total = len(host.tokens)
    has_prefill, has_chunked = host.num_prefill > 0, host.num_chunked > 0
    has_paged = host.num_prefill + host.num_chunked < total
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
        num_chunked=host.num_chunked,
        chunk_cu=t(host.chunk_cu) if has_chunked else None,
        chunk_starts=t(host.chunk_starts) if has_chunked else None,
        chunk_tables=t(host.chunk_tables) if has_chunked else None,
        max_chunk=host.max_chunk,
    )


def decode_rows(host: HostStep, start: int, stop: int) -> HostStep:
    """Rows [start, stop) of a decode-only step, as a step of their own: each decode row writes only
    its own cache slot and reads only its own blocks, so a step splits into pieces freely."""
    if host.num_prefill or host.num_chunked:
        raise ValueError("decode_rows splits decode-only steps")
    rows = slice(start, stop)
    tokens = host.tokens[rows]
    return replace(host, tokens=tokens, positions=host.positions[rows], slots=host.slots[rows],
                   block_tables=host.block_tables[rows], context_lens=host.context_lens[rows],
                   logit_rows=np.arange(len(tokens), dtype=np.int64))


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

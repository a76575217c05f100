"""Causal attention of prompt chunks that continue a cached prefix, reading K/V from the paged cache.

A prompt longer than a step's token budget is prefilled in chunks; a chunk starting at position
p > 0 must attend to positions [0, p) already in the paged cache (KV4 or fp16) as well as to
itself. The runner writes the chunk's own K/V into the cache before attention runs, so here every
key comes from the cache: query row i of a chunk (position p + i) attends to cache positions
[0, p + i]. (Through the paged *decode* kernel each row was one query re-reading its whole prefix:
a 4096-token chunk over a 12k prefix read the prefix 4096 times per head.)

Grid (query blocks, chunks, heads), as prefill_attention.py: a program takes BLOCK_M rows of one
head of one chunk and walks the keys BLOCK_N at a time with an online softmax (fp32, exp2) and fp16
tensor-core products. Keys below p + (the block's first row) precede every row of the block and
need no mask. KV4 rows are decoded to fp16 in registers (code * scale + zero in fp32, as
shared/formats/kv4.py); a byte holds dims j and j + D/2, so the head dimension is handled as two
halves: scores = q_lo . k_lo + q_hi . k_hi, outputs (p . v_lo | p . v_hi).

Layouts:
    query         (T, heads, D) fp16, rotated; the chunks' rows packed, chunk b = cu_seqlens[b] : [b + 1]
    KV4 caches    (num_blocks, kv_heads, block_size, D/2 + 4) uint8; fp16 caches (..., D) fp16
    starts        (B,) int32: the position of each chunk's first row
    block_tables  (B, max_blocks) int32, covering positions [0, start + length) of each chunk
    output        (T, heads, D) fp16
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from services.worker.kernels.host_int import cdiv
from services.worker.kernels.launch_overlap import _overlap_entry, launch_kwargs
from services.worker.kernels.paged_decode_parts import _scale_zero
from services.worker.kernels.prefill_attention import (
    LOG2E,
    PrefillConfig,
    attention_output,
    check_index_vectors,
    check_one_device,
    checked_offsets,
    default_prefill_config,
)


@triton.jit
def _row_halves(c_ptr, tail_ptr, bt_ptr, kvh, offs_n, mask_n, offs_h,
                stride_cb, stride_ch, stride_cs, stride_tb, stride_th, stride_ts,
                HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV4: tl.constexpr):
    """K or V cache rows of positions offs_n (BLOCK_N,) of one KV head -> dims [0, HALF) and [HALF, D) fp16."""
    page = tl.load(bt_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    slot = offs_n % BLOCK_SIZE
    row = page * stride_cb + kvh * stride_ch + slot * stride_cs
    if KV4:
        codes = tl.load(c_ptr + row[:, None] + offs_h[None, :], mask=mask_n[:, None], other=0)  # (N, HALF) u8
        words = tl.load(tail_ptr + page * stride_tb + kvh * stride_th + slot * stride_ts + HALF // 4, mask=mask_n, other=0)
        scale, zero = _scale_zero(words)
        lo = ((codes & 0xF).to(tl.float32) * scale[:, None] + zero[:, None]).to(tl.float16)
        hi = ((codes >> 4).to(tl.float32) * scale[:, None] + zero[:, None]).to(tl.float16)
    else:
        lo = tl.load(c_ptr + row[:, None] + offs_h[None, :], mask=mask_n[:, None], other=0.0)
        hi = tl.load(c_ptr + row[:, None] + HALF + offs_h[None, :], mask=mask_n[:, None], other=0.0)
    return lo, hi


@triton.jit
def _paged_prefill_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, k_tail_ptr, v_tail_ptr, cu_seqlens_ptr, starts_ptr, block_tables_ptr, out_ptr,
    # sizes
    qk_scale,
    # strides (elements of each view)
    stride_qt, stride_qh, stride_cb, stride_ch, stride_cs, stride_tb, stride_th, stride_ts, stride_bt,
    stride_ot, stride_oh,
    # meta
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV4: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    row0 = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - row0
    m_start = m_block * BLOCK_M
    if m_start < seq_len:
        HALF: tl.constexpr = HEAD_DIM // 2
        kvh = head // GROUP
        start = tl.load(starts_ptr + seq)
        offs_m = m_start + tl.arange(0, BLOCK_M)  # rows of the chunk; their positions are start + offs_m
        offs_h = tl.arange(0, HALF)
        mask_m = offs_m < seq_len
        q_rows = q_ptr + row0.to(tl.int64) * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt
        q_lo = tl.load(q_rows + offs_h[None, :], mask=mask_m[:, None], other=0.0)
        q_hi = tl.load(q_rows + HALF + offs_h[None, :], mask=mask_m[:, None], other=0.0)
        bt_ptr = block_tables_ptr + seq * stride_bt

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc_lo = tl.zeros((BLOCK_M, HALF), tl.float32)
        acc_hi = tl.zeros((BLOCK_M, HALF), tl.float32)
        first_row_pos = start + m_start
        end = start + tl.minimum(m_start + BLOCK_M, seq_len)  # one past the block's last position
        full_end = first_row_pos // BLOCK_N * BLOCK_N  # whole key blocks every row of the block sees
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            k_lo, k_hi = _row_halves(k_ptr, k_tail_ptr, bt_ptr, kvh, offs_n, mask_n, offs_h,
                                     stride_cb, stride_ch, stride_cs, stride_tb, stride_th, stride_ts,
                                     HALF, BLOCK_SIZE, KV4)
            s = (tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))) * qk_scale
            if n0 >= full_end:  # the diagonal: keys past a row's position, or past the chunk
                causal = (offs_n[None, :] <= (start + offs_m)[:, None]) & mask_n[None, :]
                s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_lo, v_hi = _row_halves(v_ptr, v_tail_ptr, bt_ptr, kvh, offs_n, mask_n, offs_h,
                                     stride_cb, stride_ch, stride_cs, stride_tb, stride_th, stride_ts,
                                     HALF, BLOCK_SIZE, KV4)
            p16 = p.to(tl.float16)
            acc_lo = acc_lo * alpha[:, None] + tl.dot(p16, v_lo)
            acc_hi = acc_hi * alpha[:, None] + tl.dot(p16, v_hi)
            m_i = m_new
        # Padding rows (past seq_len) are not stored; keep them finite anyway.
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        o_rows = out_ptr + row0.to(tl.int64) * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot
        tl.store(o_rows + offs_h[None, :], (acc_lo * inv[:, None]).to(tl.float16), mask=mask_m[:, None])
        tl.store(o_rows + HALF + offs_h[None, :], (acc_hi * inv[:, None]).to(tl.float16), mask=mask_m[:, None])


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    max_seqlen: int,
    sm_scale: float | None = None,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """Chunks continuing cached prefixes: (T, heads, D) fp16 rotated queries -> (T, heads, D) fp16 (in `out` if given).

    k_cache / v_cache: KV4 (uint8) or fp16 pages holding every position up to each chunk's end
    (this step's rows included); cu_seqlens (B + 1,) int32 over the rows; starts (B,) int32;
    block_tables (B, max_blocks) int32; max_seqlen >= every chunk's length (sizes the grid).
    max_context_len >= every chunk's end (start + length) is checked against what block_tables address;
    without it the launcher reads starts and cu_seqlens (a device sync).
    """
    if query.dim() != 3 or query.dtype != torch.float16 or query.stride(-1) != 1:
        raise ValueError(f"query must be (T, heads, D) fp16, contiguous in D; got {tuple(query.shape)} {query.dtype}")
    total, heads, d = query.shape
    kv4 = k_cache.dtype == torch.uint8
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        # one set of strides addresses both caches
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must be alike 4-d pages")
    kv_heads, block_size, row = k_cache.shape[1:]
    if row != (d // 2 + 4 if kv4 else d) or (not kv4 and k_cache.dtype != torch.float16):
        raise ValueError(f"cache rows of {row} {k_cache.dtype} do not hold head_dim {d} (KV4: D/2 + 4 bytes; fp16: D)")
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of kv_heads {kv_heads}")
    if d < 32 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not supported: a power of two >= 32")
    batch = cu_seqlens.numel() - 1
    for name, t, shape in (("cu_seqlens", cu_seqlens, (batch + 1,)), ("starts", starts, (batch,))):
        if t.dtype != torch.int32 or tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {shape} int32, got {tuple(t.shape)} {t.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be ({batch}, max_blocks) int32, got {tuple(block_tables.shape)}")
    # The kernel reads cu_seqlens[b], starts[b], block_tables[b, j] and a cache row's values at unit
    # strides (base + index): anything strided there would be read as other entries.
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got strides {block_tables.stride()}")
    check_index_vectors(cu_seqlens=cu_seqlens, starts=starts)
    if row > 1 and k_cache.stride(3) != 1:
        raise ValueError(f"cache rows must be contiguous, got strides {k_cache.stride()}")
    check_one_device("query", query, k_cache=k_cache, v_cache=v_cache, cu_seqlens=cu_seqlens, starts=starts,
                     block_tables=block_tables)
    cfg = config or default_prefill_config(d)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = attention_output(query, out, reads={"k_cache": k_cache, "v_cache": v_cache})
    if total == 0 or batch == 0 or max_seqlen == 0:
        return out
    if max_context_len is None:
        cu = checked_offsets(cu_seqlens, total)
        max_context_len = max(start + b - a for start, a, b in zip(starts.tolist(), cu, cu[1:]))
    if max_context_len > block_tables.shape[1] * block_size:
        # A chunk past its table's last entry would read the next row's entries (or past the table): garbage
        # attention, different from run to run, and no error.
        raise ValueError(f"chunks end at up to {max_context_len} tokens, past what block_tables of {block_tables.shape[1]} "
                         f"blocks of {block_size} tokens address ({block_tables.shape[1] * block_size})")
    # KV4: codes read bytewise from the uint8 pages, each row's scale/zero word from an int32 view.
    k_tail = k_cache.view(torch.int32) if kv4 else k_cache
    v_tail = v_cache.view(torch.int32) if kv4 else v_cache
    grid = (cdiv(max_seqlen, cfg.block_m), batch, heads)
    _paged_prefill_kernel[grid](
        query, k_cache, v_cache, k_tail, v_tail, cu_seqlens, starts, block_tables, out, scale * LOG2E,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_tail.stride(0), k_tail.stride(1), k_tail.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_SIZE=block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KV4=kv4,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(query.device, total),
    )
    return out

"""Causal prefill attention over fp16 Q/K/V for a packed variable-length batch (flash-attention).

Grid (query blocks, sequences, heads): a program takes BLOCK_M queries of one head of one
sequence and walks that sequence's keys up to the diagonal BLOCK_N at a time, with an online
softmax in fp32 (exp2, scale folded into log2 units) and fp16 tensor-core products. GQA: query
head h reads KV head h // group. Key blocks past the diagonal are never loaded; only the
diagonal block is masked.

Layouts:
    query       (total_tokens, heads, D) fp16, already rotated
    key, value  (total_tokens, kv_heads, D) fp16 (key rotated)
    cu_seqlens  (B + 1,) int32: sequence b is rows cu_seqlens[b] : cu_seqlens[b + 1]
    output      (total_tokens, heads, D) fp16
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker.kernels.host_int import cdiv
from services.worker.kernels.launch_overlap import _overlap_entry, launch_kwargs

LOG2E = 1.4426950408889634


@dataclass(slots=True, frozen=True)
class PrefillConfig:
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} {value} must be a power of two >= 16")
        if self.block_m % self.block_n:
            raise ValueError(f"block_n {self.block_n} must divide block_m {self.block_m} (unmasked key blocks)")


def default_prefill_config(head_dim: int) -> PrefillConfig:
    """head_dim 128: the fastest measured on an H200 (bench/attention.py); 64: fits without spills."""
    if head_dim <= 64:
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


@triton.jit
def _prefill_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, cu_seqlens_ptr, out_ptr,
    # sizes
    qk_scale,
    # strides (elements)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    # meta
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    seq_start = tl.load(cu_seqlens_ptr + seq)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1) - seq_start
    m_start = m_block * BLOCK_M
    if m_start < seq_len:
        kvh = head // GROUP
        offs_m = m_start + tl.arange(0, BLOCK_M)  # positions in the sequence
        offs_d = tl.arange(0, HEAD_DIM)
        mask_m = offs_m < seq_len
        row0 = seq_start.to(tl.int64)
        # Scalar bases plus int32 tile offsets: 64-bit pointers per element would cost registers.
        q_base = q_ptr + row0 * stride_qt + head * stride_qh
        k_base = k_ptr + row0 * stride_kt + kvh * stride_kh
        v_base = v_ptr + row0 * stride_vt + kvh * stride_vh
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=mask_m[:, None], other=0.0)

        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
        # Keys [0, diag) need no mask: every key there precedes every query of the block.
        diag = tl.minimum(m_start, seq_len)
        for n0 in range(0, diag, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :])
            s = tl.dot(q, tl.trans(k)) * qk_scale
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m_i = m_new
        end = tl.minimum(m_start + BLOCK_M, seq_len)
        for n0 in range(diag, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < seq_len
            k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            causal = (offs_n[None, :] <= offs_m[:, None]) & mask_n[None, :]
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            m_i = m_new
        # Padding rows (past seq_len) saw only masked keys: keep them finite, they are not stored.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + row0 * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
        tl.store(o_ptrs, out.to(tl.float16), mask=mask_m[:, None])


def attention_output(query: torch.Tensor, out: torch.Tensor | None, name: str = "out",
                     reads: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """A launcher's (T, heads, D) fp16 output beside `query`: a new tensor, or the caller's `out` (a slice
    of a larger step buffer, so the runner needs no copy), checked to take the kernels' (row, head)
    strides with D contiguous, and to lie clear of the other tensors the kernel `reads` (keys, values, caches:
    written while still being read, they gave wrong results, no error; `out` may be `query` itself). Used by the
    attention launchers and the cache write's rotated query."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != torch.float16 or out.stride(-1) != 1 or out.device != query.device:
        raise ValueError(f"{name} must be {tuple(query.shape)} fp16 on {query.device}, contiguous in D; "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    for other, t in (reads or {}).items():
        if _spans_overlap(out, t):
            raise ValueError(f"{name} overlaps {other} in memory: the kernel would overwrite what it still reads")
    return out


def _spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory a and b span (first to last element) overlaps: conservative for interleaved views."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def check_index_vectors(**vectors: torch.Tensor) -> None:
    """1-D index tensors the kernels read at base + i: a strided view would be read as other entries."""
    for name, t in vectors.items():
        if t.numel() > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def check_one_device(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Every given tensor (None skipped) on the reference tensor's device."""
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device}, the {reference_name} on {reference.device}: all on one device")


def checked_offsets(cu_seqlens: torch.Tensor, total: int) -> list[int]:
    """cu_seqlens read to the host (a device sync), checked: from 0, never decreasing, ending within the total
    rows. The kernels trust them: an end past the rows read and wrote rows beyond the tensors."""
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
        shown = ", ".join(map(str, cu[:8])) + (", ..." if len(cu) > 8 else "")
        raise ValueError(f"cu_seqlens must rise from 0 to at most the {total} rows, got [{shown}]")
    return cu


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int | None = None,
    sm_scale: float | None = None,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention per sequence of a packed batch. Returns (total_tokens, heads, D) fp16 (in `out` if given).

    query (total, heads, D) fp16, key/value (total, kv_heads, D) fp16, cu_seqlens (B + 1,) int32.
    max_seqlen (>= every sequence's length) sizes the grid; without it the launcher reads
    cu_seqlens (a device sync). sm_scale defaults to 1/sqrt(D).
    """
    if query.dim() != 3 or query.dtype != torch.float16:
        raise ValueError(f"query must be (total_tokens, heads, D) fp16, got {tuple(query.shape)} {query.dtype}")
    total, heads, d = query.shape
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or x.shape[0] != total or x.shape[2] != d or x.dtype != torch.float16:
            raise ValueError(f"{name} must be ({total}, kv_heads, {d}) fp16, got {tuple(x.shape)} {x.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} must match key {tuple(key.shape)}")
    if any(x.stride(-1) != 1 for x in (query, key, value)):
        raise ValueError("query, key and value must be contiguous in the head dimension")
    kv_heads = key.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads {heads} are not a multiple of kv_heads {kv_heads}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not supported: a power of two >= 16 (64 and 128 are tuned)")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be (B + 1,) int32, got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    check_index_vectors(cu_seqlens=cu_seqlens)
    check_one_device("query", query, key=key, value=value, cu_seqlens=cu_seqlens)
    cfg = config or default_prefill_config(d)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    if max_seqlen is None:
        cu = checked_offsets(cu_seqlens, total)
        max_seqlen = max(b - a for a, b in zip(cu, cu[1:]))
    out = attention_output(query, out, reads={"key": key, "value": value})
    batch = cu_seqlens.numel() - 1
    if total == 0 or max_seqlen == 0:
        return out
    grid = (cdiv(max_seqlen, cfg.block_m), batch, heads)
    _prefill_kernel[grid](
        query, key, value, cu_seqlens, out, scale * LOG2E,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kwargs(query.device, total),
    )
    return out

"""Pure-torch references for the attention kernels: the same numerics, written plainly.

The kernel tests compare against these, and the CPU backend runs them. Layouts are those of the
kernels (see kv4_cache.py, paged_attention.py, prefill_attention.py):
    rope_cache  (max_positions, D) fp32, [cos(pos * inv_freq) | sin(pos * inv_freq)], each D/2 wide
    KV4 cache   (num_blocks, kv_heads, block_size, D/2 + 4) uint8, rows as shared.formats.kv4
    fp16 cache  (num_blocks, kv_heads, block_size, D) fp16
    slot        block_id * block_size + offset in block; a negative slot means "do not write"
"""

from __future__ import annotations

import math

import torch

from shared.formats.kv4 import FULL_KV_RANGE, decode_rows, encode_rows
from shared.model.rope import cos_sin


def build_rope_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """inv_freq (D/2,) fp32 -> (max_positions, D) fp32: [cos | sin] of position * inv_freq.

    Built with shared.model.rope.cos_sin so that the kernels rotate with bit-identical angles.
    """
    cos, sin = cos_sin(torch.arange(max_positions, device=inv_freq.device), inv_freq)  # (P, D) halves repeated
    half = inv_freq.shape[0]
    return torch.cat([cos[:, :half], sin[:, :half]], dim=-1).contiguous()


def rope_reference(x: torch.Tensor, positions: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
    """x (T, heads, D) fp16 -> x rotated (HF rotate_half, pairs (i, i + D/2)), fp16.

    Same arithmetic as shared.model.rope.apply_rope: fp32 x * cos + rotate_half(x) * sin, then fp16.
    """
    half = x.shape[-1] // 2
    table = rope_cache[positions.long()]  # (T, D) fp32
    cos, sin = table[:, None, :half], table[:, None, half:]
    xf = x.float()
    lo, hi = xf[..., :half], xf[..., half:]
    return torch.cat([lo * cos + (-hi) * sin, hi * cos + lo * sin], dim=-1).to(x.dtype)


def _scatter_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache (num_blocks, kv_heads, block_size, R); rows (T, kv_heads, R); writes where slot >= 0."""
    block_size = cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    cache[slots // block_size, :, slots % block_size] = rows[keep].to(cache.dtype)


def write_kv4_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_range: tuple[float, float] = FULL_KV_RANGE,
    key_feedback: torch.Tensor | None = None,
) -> None:
    """RoPE on key, KV4-encode key and value per token per head (at the layer's K and V range
    ratios; keys with error feedback when key_feedback (kv_heads, D, D) is given), write the rows
    at their slots."""
    keys = encode_rows(rope_reference(key, positions, rope_cache), kv_range[0], key_feedback)
    _scatter_rows(k_cache, keys, slot_mapping)
    _scatter_rows(v_cache, encode_rows(value, kv_range[1]), slot_mapping)


def write_fp16_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """RoPE on key, write key and value rows (fp16) at their slots."""
    _scatter_rows(k_cache, rope_reference(key, positions, rope_cache), slot_mapping)
    _scatter_rows(v_cache, value, slot_mapping)


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` tokens -> (kv_heads, length, D) fp32, KV4 rows decoded."""
    block_size = cache.shape[2]
    pages = block_table[: -(-length // block_size)].long()
    rows = cache[pages].transpose(0, 1).flatten(1, 2)[:, :length]  # (kv_heads, length, R)
    return decode_rows(rows) if cache.dtype == torch.uint8 else rows.float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """q (heads, Tq, D), k/v (kv_heads, Tk, D) fp32 -> (heads, Tq, D) fp32, GQA by repeat_interleave."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(1, 2)) * scale  # (heads, Tq, Tk)
    if causal:
        tq, tk = scores.shape[-2:]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def paged_decode_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """query (B, heads, D) fp16 -> (B, heads, D) fp16, attention in fp32 over the decoded cache.

    Works for KV4 (uint8) and fp16 caches. A sequence of length 0 gets a zero output.
    """
    b, heads, d = query.shape
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(b, heads, d, dtype=torch.float32, device=query.device)
    for i, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = gather_sequence(k_cache, block_tables[i], length)
        v = gather_sequence(v_cache, block_tables[i], length)
        out[i] = _attend(query[i].float()[:, None], k, v, scale, causal=False)[:, 0]
    return out.to(query.dtype)


def prefill_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention per sequence of a packed batch, fp32 math, output in query's dtype.

    query (total, heads, D); key/value (total, kv_heads, D); cu_seqlens (B + 1,) int.
    """
    d = query.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty_like(query, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        q, k, v = (x[start:end].float().transpose(0, 1) for x in (query, key, value))
        out[start:end] = _attend(q, k, v, scale, causal=True).transpose(0, 1)
    return out.to(query.dtype)


def paged_prefill_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    block_tables: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Chunks continuing cached prefixes (paged_prefill_attention.py): row i of chunk b, at position
    starts[b] + i, attends to cache positions [0, starts[b] + i]; fp32 math, query's dtype out."""
    d = query.shape[-1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros_like(query, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for b, (first, last) in enumerate(zip(bounds[:-1], bounds[1:])):
        if last == first:
            continue
        length = int(starts[b]) + last - first
        k = gather_sequence(k_cache, block_tables[b], length)
        v = gather_sequence(v_cache, block_tables[b], length)
        out[first:last] = _attend(query[first:last].float().transpose(0, 1), k, v, scale, causal=True).transpose(0, 1)
    return out.to(query.dtype)

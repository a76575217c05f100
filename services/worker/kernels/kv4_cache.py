"""Fused RoPE + paged KV-cache write: KV4 (the quantized engine) and fp16 (the baseline engine).

One program per (token, tile of KV heads): it rotates the keys (HF rotate_half, pairs (i, i + D/2))
with angles read from a precomputed rope cache, then either quantizes keys and values to KV4 rows
(shared/formats/kv4.py: D/2 nibble-pair bytes, fp16 scale, fp16 zero) or writes them as fp16.
The same program can also rotate the query heads of its KV groups, so one launch per layer does
all the RoPE work of the attention block. A program takes up to HEADS_PER_PROGRAM query heads'
worth of KV heads: one program per (token, head) was latency-bound (a chain of dependent loads
for 128 values; 216 us a layer for an 8192-token prefill chunk on the H200).
With key error feedback (opt-in, shared.formats.kv4) each program runs the keys' D-step rounding
loop, reading its heads' whole R (64 KiB a head at D = 128) for its one token. Measured on an H200
(session 27, bench/results/h200/kv_write_feedback.json): 2.9x / 9.4x the plain write at 1024 / 4096
tokens, +10-25 us a layer for decode batches. A second kernel reading each row of R once for 16 tokens
of a head ("head_tiles", session 29) was slower from 64 tokens up on an H100 (1.4x at 64-256 tokens;
session 30, bench/results/h100/kv_write_feedback.json) and was deleted.

Layouts:
    key, value    (T, kv_heads, D) fp16, last dim contiguous; key is pre-RoPE
    query         (T, heads, D) fp16 (optional), pre-RoPE; heads = kv_heads * group
    positions     (T,) int32/int64, each < rope_cache.shape[0]
    slot_mapping  (T,) int64, block_id * block_size + offset; negative = skip (padding tokens)
    rope_cache    (max_positions, D) fp32, [cos | sin] (see attention_reference.build_rope_cache)
    KV4 caches    (num_blocks, kv_heads, block_size, D/2 + 4) uint8, one for K and one for V
    fp16 caches   (num_blocks, kv_heads, block_size, D) fp16
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.kernels.attention_reference import build_rope_cache  # noqa: F401  (re-exported)
from services.worker.kernels.host_int import cdiv, next_power_of_2
from services.worker.kernels.launch_overlap import _overlap_entry, launch_kwargs
from services.worker.kernels.prefill_attention import attention_output, check_index_vectors, check_one_device
from shared.formats.kv4 import FULL_KV_RANGE, check_key_feedback, page_row_bytes, range_margin

__all__ = ["build_rope_cache", "write_fp16_cache", "write_kv4_cache"]

# Query heads a program covers (its KV heads times the group, padded to powers of two): 16 heads
# of head_dim 128 are 2048 values a tensor, 16 a thread at 4 warps.
HEADS_PER_PROGRAM = 16

@triton.jit
def _round_half_even(x):
    """torch.round for fp32 x >= -1 (what the KV4 codes need): exact, no libdevice."""
    r = tl.floor(x)
    frac = x - r  # exact for x >= -1
    odd = (r.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return r + up.to(tl.float32)


@triton.jit
def _rotate_half_pairs(lo, hi, cos, sin):
    """RoPE on halves (lo, hi) fp32 (HF rotate_half: pairs (i, i + D/2)), rounded to fp16 as the
    reference rotates: each product rounded (the launches run without FMA contraction)."""
    return (lo * cos - hi * sin).to(tl.float16), (hi * cos + lo * sin).to(tl.float16)


@triton.jit
def _kv4_code(x, scale, zero):
    """The nearest KV4 code of x on the grid (scale, zero): IEEE division, round half to even, clamp."""
    return tl.minimum(tl.maximum(_round_half_even(tl.div_rn(x - zero, scale)), 0.0), 15.0)


@triton.jit
def _feedback_codes(lo, hi, scale, zero, r_rows, r_mask, HALF: tl.constexpr):
    """The error-feedback codes of shared.formats.kv4 (its module doc): (H, HALF) halves lo, hi of H
    vectors on the grids scale, zero (H,). r_rows (H, 1): pointers to the first element of each
    vector's R (D, D) fp32 (its KV head's); r_mask: where they may be read (broadcast against (H, HALF)).

    Dim i is lo[:, i] for i < HALF, else hi[:, i - HALF]. Step i updates a whole half where the
    reference updates the dims after i: R is upper triangular, so the others change by a product with
    0, which leaves a value as it was; hence the steps of the upper half leave lo alone. Dim i itself
    takes R[i, i] = 1 times its own error: it ends as w_i - e_i, its dequantized value to within
    an ulp of w_i, and the codes are read back from the final values at the end, which gives q_i
    exactly wherever the vector's range is not empty (checked over 40M fp16-valued cases with up to
    1e4 steps of overshoot; an empty range has every error 0 and every code 0). That saves the two
    per-step selects that kept each q_i: D dependent steps per vector, each over one half (lower half)
    or the upper half alone, reading one row of R (or its upper half) per vector."""
    D: tl.constexpr = 2 * HALF
    offs = tl.arange(0, HALF)[None, :]
    for i in range(HALF):
        w = tl.sum(tl.where(offs == i, lo, 0.0), axis=1)  # (H,): dim i, exactly
        err = (w - (_kv4_code(w, scale, zero) * scale + zero))[:, None]  # product then sum: the launch has no FMA
        r_row = r_rows + i * D + offs
        lo = lo - err * tl.load(r_row, mask=r_mask, other=0.0)
        hi = hi - err * tl.load(r_row + HALF, mask=r_mask, other=0.0)
    for i in range(HALF):
        w = tl.sum(tl.where(offs == i, hi, 0.0), axis=1)
        err = (w - (_kv4_code(w, scale, zero) * scale + zero))[:, None]
        hi = hi - err * tl.load(r_rows + (HALF + i) * D + HALF + offs, mask=r_mask, other=0.0)
    return _kv4_code(lo, scale[:, None], zero[:, None]), _kv4_code(hi, scale[:, None], zero[:, None])


@triton.jit
def _store_kv4_rows(row_ptrs, mask_h, lo, hi, margin, HALF: tl.constexpr, SHRINK: tl.constexpr,
                    r_rows=None, r_mask=None, FEEDBACK: tl.constexpr = False):
    """Quantize head vectors (halves lo, hi: (H, HALF) fp32 holding fp16 values) into the KV4 rows
    at row_ptrs (H,), those where mask_h (H,) holds.

    Bit-for-bit shared.formats.kv4.encode_rows: IEEE division, round half to even, fp16 scale/zero;
    SHRINK: the range ratio rule, [min, max] narrowed by margin = fp32((1 - ratio) / 2) of its width;
    FEEDBACK: codes by error-feedback rounding with R at r_rows, r_mask (see _feedback_codes).
    """
    vmin = tl.minimum(tl.min(lo, axis=1), tl.min(hi, axis=1))  # (H,)
    vmax = tl.maximum(tl.max(lo, axis=1), tl.max(hi, axis=1))
    if SHRINK:
        cut = (vmax - vmin) * margin
        vmin, vmax = vmin + cut, vmax - cut
    scale = tl.maximum(tl.div_rn(vmax - vmin, 15.0), 1e-5).to(tl.float16)
    zero = vmin.to(tl.float16)
    if FEEDBACK:
        q_lo, q_hi = _feedback_codes(lo, hi, scale.to(tl.float32), zero.to(tl.float32), r_rows, r_mask, HALF)
    else:
        scale_f, zero_f = scale.to(tl.float32)[:, None], zero.to(tl.float32)[:, None]
        q_lo, q_hi = _kv4_code(lo, scale_f, zero_f), _kv4_code(hi, scale_f, zero_f)
    codes = q_lo.to(tl.int32) | (q_hi.to(tl.int32) << 4)  # byte j: dim j low nibble, dim j + D/2 high
    stored = mask_h[:, None]
    tl.store(row_ptrs[:, None] + tl.arange(0, HALF)[None, :], codes.to(tl.uint8), mask=stored)
    # The 4 tail bytes, little-endian: fp16 scale then fp16 zero.
    scale_bits = scale.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    zero_bits = zero.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tail = (scale_bits | (zero_bits << 16))[:, None]
    offs_tail = tl.arange(0, 4)[None, :]
    tl.store(row_ptrs[:, None] + HALF + offs_tail, ((tail >> (offs_tail * 8)) & 0xFF).to(tl.uint8), mask=stored)


@triton.jit
def _rope_cache_write_kernel(
    # pointers
    key_ptr, value_ptr, query_ptr, query_out_ptr, positions_ptr, slots_ptr, rope_ptr, k_cache_ptr, v_cache_ptr,
    key_feedback_ptr,  # (kv_heads, D, D) fp32, contiguous (KEY_FEEDBACK)
    # sizes
    kv_heads,
    # strides (elements of each tensor's dtype)
    stride_kt, stride_kh, stride_vt, stride_vh, stride_qt, stride_qh, stride_ot, stride_oh, stride_rope,
    stride_cb, stride_ch, stride_cs,
    k_margin, v_margin,  # KV4 range-ratio margins (shared.formats.kv4.range_margin)
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_H: tl.constexpr, QUANTIZE: tl.constexpr, ROTATE_QUERY: tl.constexpr, K_SHRINK: tl.constexpr,
    V_SHRINK: tl.constexpr, KEY_FEEDBACK: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    """Token tl.program_id(0), KV heads [BLOCK_H * tl.program_id(1), + BLOCK_H) (the last tile masked)."""
    _overlap_entry(PDL)
    tok = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF)
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < kv_heads
    rows_mask = mask_h[:, None]  # (BLOCK_H, 1): the tile's real KV heads

    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos = tl.load(rope_ptr + pos * stride_rope + offs)[None, :]  # (1, HALF) fp32
    sin = tl.load(rope_ptr + pos * stride_rope + HALF + offs)[None, :]

    if ROTATE_QUERY:
        # Query heads of the tile's KV heads, as (BLOCK_H * BLOCK_G, HALF) rows (group padded to BLOCK_G).
        offs_r = tl.arange(0, BLOCK_H * BLOCK_G)
        g = offs_r % BLOCK_G
        kv_of = h0 + offs_r // BLOCK_G
        mask_q = ((g < GROUP) & (kv_of < kv_heads))[:, None]
        heads = (kv_of * GROUP + g)[:, None]
        q_ptrs = query_ptr + tok * stride_qt + heads * stride_qh + offs[None, :]
        q_lo = tl.load(q_ptrs, mask=mask_q, other=0.0).to(tl.float32)
        q_hi = tl.load(q_ptrs + HALF, mask=mask_q, other=0.0).to(tl.float32)
        o_ptrs = query_out_ptr + tok * stride_ot + heads * stride_oh + offs[None, :]
        q_lo, q_hi = _rotate_half_pairs(q_lo, q_hi, cos, sin)
        tl.store(o_ptrs, q_lo, mask=mask_q)
        tl.store(o_ptrs + HALF, q_hi, mask=mask_q)

    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot >= 0:
        # Every load first (keys, then values), so their latencies overlap; then the math and stores.
        k_ptrs = key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs[None, :]  # (BLOCK_H, HALF)
        k_lo = tl.load(k_ptrs, mask=rows_mask, other=0.0).to(tl.float32)
        k_hi = tl.load(k_ptrs + HALF, mask=rows_mask, other=0.0).to(tl.float32)
        v_ptrs = value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs[None, :]
        v_lo = tl.load(v_ptrs, mask=rows_mask, other=0.0)
        v_hi = tl.load(v_ptrs + HALF, mask=rows_mask, other=0.0)
        row = (slot // BLOCK_SIZE) * stride_cb + offs_h * stride_ch + (slot % BLOCK_SIZE) * stride_cs  # (BLOCK_H,)
        # Round the rotated key to fp16 first: the reference quantizes the fp16 rotated key.
        r_lo, r_hi = _rotate_half_pairs(k_lo, k_hi, cos, sin)
        if QUANTIZE:
            _store_kv4_rows(k_cache_ptr + row, mask_h, r_lo.to(tl.float32), r_hi.to(tl.float32), k_margin, HALF,
                            K_SHRINK, (key_feedback_ptr + offs_h * (HEAD_DIM * HEAD_DIM))[:, None], rows_mask,
                            KEY_FEEDBACK)
        else:
            dst = row[:, None] + offs[None, :]
            tl.store(k_cache_ptr + dst, r_lo, mask=rows_mask)
            tl.store(k_cache_ptr + dst + HALF, r_hi, mask=rows_mask)
        if QUANTIZE:
            _store_kv4_rows(v_cache_ptr + row, mask_h, v_lo.to(tl.float32), v_hi.to(tl.float32), v_margin, HALF, V_SHRINK)
        else:
            dst = row[:, None] + offs[None, :]
            tl.store(v_cache_ptr + dst, v_lo, mask=rows_mask)
            tl.store(v_cache_ptr + dst + HALF, v_hi, mask=rows_mask)


def _check_inputs(key, value, positions, slot_mapping, rope_cache, query) -> tuple[int, int, int]:
    if key.dim() != 3 or key.dtype != torch.float16:
        raise ValueError(f"key must be (T, kv_heads, D) fp16, got {tuple(key.shape)} {key.dtype}")
    t, kv_heads, d = key.shape
    if value.shape != key.shape or value.dtype != torch.float16:
        raise ValueError(f"value must match key {tuple(key.shape)} fp16, got {tuple(value.shape)} {value.dtype}")
    if d < 16 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not supported: a power of two >= 16 (64 and 128 are tuned)")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in the head dimension")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be ({t},) int32/int64, got {tuple(positions.shape)} {positions.dtype}")
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be ({t},) int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    if rope_cache.dim() != 2 or rope_cache.shape[1] != d or rope_cache.dtype != torch.float32:
        raise ValueError(f"rope_cache must be (max_positions, {d}) fp32, got {tuple(rope_cache.shape)} {rope_cache.dtype}")
    if rope_cache.stride(1) != 1:
        raise ValueError("rope_cache must be contiguous in its last dimension")
    # A strided positions or slot_mapping would send tokens to other tokens' slots.
    check_index_vectors(positions=positions, slot_mapping=slot_mapping)
    check_one_device("key", key, value=value, positions=positions, slot_mapping=slot_mapping, rope_cache=rope_cache,
                     query=query)
    group = 1
    if query is not None:
        if query.dim() != 3 or query.shape[0] != t or query.shape[2] != d or query.dtype != torch.float16:
            raise ValueError(f"query must be ({t}, heads, {d}) fp16, got {tuple(query.shape)} {query.dtype}")
        if query.shape[1] % kv_heads:
            raise ValueError(f"query heads {query.shape[1]} are not a multiple of kv_heads {kv_heads}")
        if query.stride(-1) != 1:
            raise ValueError("query must be contiguous in the head dimension")
        group = query.shape[1] // kv_heads
    return t, kv_heads, group


def _check_cache(name: str, cache: torch.Tensor, kv_heads: int, row: int, dtype: torch.dtype) -> None:
    if cache.dim() != 4 or cache.shape[1] != kv_heads or cache.shape[3] != row or cache.dtype != dtype:
        raise ValueError(
            f"{name} must be (num_blocks, {kv_heads}, block_size, {row}) {dtype}, "
            f"got {tuple(cache.shape)} {cache.dtype}"
        )
    if cache.stride(3) != 1 or cache.stride(2) != row:
        raise ValueError(f"{name} rows must be contiguous (strides {cache.stride()})")


def _launch(key, value, positions, slot_mapping, rope_cache, k_cache, v_cache, query, quantize: bool,
            kv_range: tuple[float, float] = FULL_KV_RANGE, key_feedback: torch.Tensor | None = None,
            query_out: torch.Tensor | None = None):
    t, kv_heads, group = _check_inputs(key, value, positions, slot_mapping, rope_cache, query)
    d = key.shape[2]
    if key_feedback is not None:
        # Shape only: the values were checked where the artifact was read (a check here would sync
        # the device on every write, and a CUDA graph being captured cannot).
        check_key_feedback(key_feedback, kv_heads, d, values=False)
        if key_feedback.device != key.device or not key_feedback.is_contiguous():
            raise ValueError("key_feedback must be contiguous and on the key's device")
    row = page_row_bytes(d) if quantize else d
    dtype = torch.uint8 if quantize else torch.float16
    _check_cache("k_cache", k_cache, kv_heads, row, dtype)
    _check_cache("v_cache", v_cache, kv_heads, row, dtype)
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache {tuple(v_cache.shape)} must have k_cache's shape and strides {tuple(k_cache.shape)}")
    if k_cache.device != key.device or v_cache.device != key.device:
        raise ValueError(f"k_cache / v_cache are on {k_cache.device} / {v_cache.device}, the key on {key.device}")
    if query is not None:
        query_out = attention_output(query, query_out, "query_out", reads={"key": key, "value": value})
    elif query_out is not None:
        raise ValueError("query_out is only written with a query to rotate")
    if t == 0:
        return query_out
    q_arg = query if query is not None else key  # unused when ROTATE_QUERY is off
    o_arg = query_out if query_out is not None else key
    block_g = next_power_of_2(group)
    block_h = min(next_power_of_2(kv_heads), max(1, HEADS_PER_PROGRAM // block_g))
    _rope_cache_write_kernel[(t, cdiv(kv_heads, block_h))](
        key, value, q_arg, o_arg, positions, slot_mapping, rope_cache, k_cache, v_cache,
        key if key_feedback is None else key_feedback, kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        q_arg.stride(0), q_arg.stride(1), o_arg.stride(0), o_arg.stride(1), rope_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        range_margin(kv_range[0]), range_margin(kv_range[1]),
        HEAD_DIM=d, BLOCK_SIZE=k_cache.shape[2], GROUP=group, BLOCK_G=block_g, BLOCK_H=block_h,
        QUANTIZE=quantize, ROTATE_QUERY=query is not None, K_SHRINK=kv_range[0] != 1.0, V_SHRINK=kv_range[1] != 1.0,
        KEY_FEEDBACK=key_feedback is not None,
        # No FMA contraction: x * cos - y * sin rounds each product as torch does, so the rotated
        # fp16 key, and with it the KV4 row, is bit-identical to the reference.
        num_warps=max(1, min(4, block_h * block_g * d // 1024)), enable_fp_fusion=False, **launch_kwargs(key.device, t),
    )
    return query_out


def write_kv4_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query: torch.Tensor | None = None,
    kv_range: tuple[float, float] = FULL_KV_RANGE,
    key_feedback: torch.Tensor | None = None,
    query_out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """RoPE the key, quantize key and value to KV4 rows, write them at slot_mapping (in place).

    key, value (T, kv_heads, D) fp16 pre-RoPE key; k_cache/v_cache (num_blocks, kv_heads,
    block_size, D/2 + 4) uint8. If `query` (T, heads, D) fp16 is given, returns it rotated
    (in `query_out` if given, else a new tensor); otherwise returns None. Tokens whose slot is
    negative are not written.
    kv_range: the layer's K and V range ratios; key_feedback (kv_heads, D, D) fp32: its keys' error-feedback
    factor, or None for nearest rounding (shared.formats.kv4).
    """
    return _launch(key, value, positions, slot_mapping, rope_cache, k_cache, v_cache, query, True, kv_range,
                   key_feedback, query_out)


def write_fp16_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    rope_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query: torch.Tensor | None = None,
    query_out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The fp16 baseline's write: RoPE the key, write key and value at slot_mapping (in place).

    k_cache/v_cache (num_blocks, kv_heads, block_size, D) fp16; `query` as in write_kv4_cache.
    """
    return _launch(key, value, positions, slot_mapping, rope_cache, k_cache, v_cache, query, quantize=False,
                   query_out=query_out)

"""KV4 paged decode attention with the query heads as the score MMA's rows (groups of up to 8).

The "mma" kernel (paged_attention_mma.py) puts 16 tokens in the rows of its int8 score MMA and
the heads in its 8 columns, then shuffles every score to a lane per token for the softmax. Here
the MMA is turned around, as FlashAttention-2 does: rows are the query (row g: head g's int16
high bytes, row g + 8: its low bytes), columns are 8 tokens, `mma.sync.m16n8k32` s8 x u8. Lane
(g, t) then holds head g's scores of tokens 2t and 2t + 1 of each block of 8 (see C below):
the B fragment of the value MMA (_pv_mma_apply: out^T = V^T P^T on the fp16 tensor cores) as it
stands, with no shuffle, and the softmax reduces over the 4 lanes of a quad. A 32-token tile takes
16 score MMAs for any group up to 8, so this pays for groups of 8; lanes past the group idle.

Fragments (PTX ISA, m16n8k32 with 8-bit operands; lane l, g = l // 4, t = l % 4):
    A (16 x 32): a0 = row g, k 4t..4t+3; a1 = row g + 8; a2, a3 the same rows, k 16 + 4t..
    B (32 x 8):  b0 = col g, k 4t..4t+3;  b1 = col g, k 16 + 4t..
    C (16 x 8):  c0, c1 = row g, cols 2t, 2t + 1;  c2, c3 = row g + 8
B's column g is token g of the block: K code word 8c + t of that token, `& 0x0F0F0F0F`, holds
dims 32c + 4t .. + 3 (low nibbles) and one shift more dims D/2 + 32c + 4t .. (as in the "mma"
kernel). Score of head g, token 2t = 256 c0 + c2 (exact int32), token 2t + 1 = 256 c1 + c3.

Head_dim 128, pages of a multiple of 16 tokens, groups of 1..8 (written for 8); optional prefetch
(PREFETCH: tile i + 1's words in flight during tile i's math).
Launcher: paged_attention.py, variant "mma" with head_rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release
from services.worker.kernels.paged_attention_mma import (
    TILE,
    _mma_s8_u8,
    _pack_f16x2,
    _pages,
    _pv_mma_apply,
    _pv_mma_loads,
    _shfl_f32,
    _store_pv_rows,
)
from services.worker.kernels.paged_decode_parts import UNSPECIALIZED, _program_span, _scale_zero


@triton.jit
def _query_rows(q_row, stride_qh, inv, g, t, base: tl.constexpr, GROUP: tl.constexpr):
    """A fragment registers of query dims base + 4t .. base + 4t + 3 of head g (0 past the group):
    (high bytes, low bytes) of q * inv rounded to int16 (q16 = 256 hi + lo, lo in [-128, 127])."""
    hi_reg = tl.zeros(g.shape, tl.int32)
    lo_reg = tl.zeros(g.shape, tl.int32)
    for j in tl.static_range(4):
        x = tl.load(q_row + g * stride_qh + base + 4 * t + j, mask=g < GROUP, other=0.0).to(tl.float32) * inv
        q16 = tl.floor(x + 0.5).to(tl.int32)
        hi = (q16 + 128) >> 8
        hi_reg |= (hi & 0xFF) << (8 * j)
        lo_reg |= ((q16 - hi * 256) & 0xFF) << (8 * j)
    return hi_reg, lo_reg


@triton.jit
def _block_scores(w0, w1, w2, w3, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
                  FAST: tl.constexpr):
    """Integer scores of head g against tokens 2t, 2t + 1 of an 8-token block, from K words t, t + 4,
    t + 8, t + 12 of the block's token g (_head_rows_loads): 4 MMAs over the 4 runs of 32 dims (query
    fragments qh/ql 0..7: dims 0..31, 16.. of each run in turn, see _query_rows)."""
    lo = 0x0F0F0F0F
    c0 = tl.zeros(w0.shape, tl.int32)
    c1 = c0
    c2 = c0
    c3 = c0
    c0, c1, c2, c3 = _mma_s8_u8(qh0, ql0, qh1, ql1, w0 & lo, w1 & lo, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma_s8_u8(qh2, ql2, qh3, ql3, w2 & lo, w3 & lo, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma_s8_u8(qh4, ql4, qh5, ql5, (w0 >> 4) & lo, (w1 >> 4) & lo, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma_s8_u8(qh6, ql6, qh7, ql7, (w2 >> 4) & lo, (w3 >> 4) & lo, c0, c1, c2, c3, FAST)
    return c0 * 256 + c2, c1 * 256 + c3


@triton.jit
def _scale_zero_words(k_ptr, v_ptr, base, slot, n0, end, ROW: tl.constexpr, W: tl.constexpr, MASKED: tl.constexpr):
    """The K and V scale/zero words of the token at `slot` of the group of 16 whose slot 0 is at
    `base` (0 past the context, whose fp16 bits may be NaN)."""
    if MASKED:
        valid = n0 + slot < end
        ksz = tl.load(k_ptr + base + slot * ROW + W, mask=valid, other=0)
        vsz = tl.load(v_ptr + base + slot * ROW + W, mask=valid, other=0)
    else:
        ksz = tl.load(k_ptr + base + slot * ROW + W)
        vsz = tl.load(v_ptr + base + slot * ROW + W)
    return ksz, vsz


@triton.jit
def _token_log2_score(score, ksz, vsz, slot, n0, end, q_step, q_sum, MASKED: tl.constexpr):
    """Scores in log2 units of the tokens at `slot` of the group of 16 starting at token n0, and
    their V scale and zero."""
    k_scale, k_zero = _scale_zero(ksz)
    v_scale, v_zero = _scale_zero(vsz)
    s = score.to(tl.float32) * q_step * k_scale + q_sum * k_zero
    if MASKED:
        s = tl.where(n0 + slot < end, s, float("-inf"))
    return s, v_scale, v_zero


@triton.jit
def _quad_max(x, lane, FAST: tl.constexpr):
    x = tl.maximum(x, _shfl_f32(x, lane ^ 1, FAST))
    return tl.maximum(x, _shfl_f32(x, lane ^ 2, FAST))


@triton.jit
def _quad_sum(x, lane, FAST: tl.constexpr):
    x += _shfl_f32(x, lane ^ 1, FAST)
    return x + _shfl_f32(x, lane ^ 2, FAST)


@triton.jit
def _k_words(k_ptr, row):
    """K words t, t + 4, t + 8, t + 12 of a token (`row` addresses word t): _block_scores' B operands."""
    return tl.load(k_ptr + row), tl.load(k_ptr + row + 4), tl.load(k_ptr + row + 8), tl.load(k_ptr + row + 12)


@triton.jit
def _head_rows_loads(k_ptr, v_ptr, page0, page1, head_off, n0, end, stride_cb, g, t,
                     BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, W: tl.constexpr):
    """Every word lane (g, t) needs of tokens [n0, n0 + 32): K words t, t + 4, t + 8, t + 12 of
    token g of each block of 8 (blocks 0, 1 in the first group of 16: slots g, 8 + g; 2, 3 in the
    second), the K and V scale/zero words of its tokens (slots 2t, 2t + 1, 2t + 8, 2t + 9 of each
    group of 16) and its value-MMA words (_pv_mma_loads). Code rows past the context are read
    unmasked (their page is a real one, page 0 at worst): their scores are masked."""
    ROW: tl.constexpr = W + 1
    base0 = page0 * stride_cb + head_off + (n0 % BLOCK_SIZE) * ROW
    base1 = page1 * stride_cb + head_off + ((n0 + 16) % BLOCK_SIZE) * ROW
    r0 = base0 + g * ROW + t
    r1 = base0 + (8 + g) * ROW + t
    r2 = base1 + g * ROW + t
    r3 = base1 + (8 + g) * ROW + t
    k00, k01, k02, k03 = _k_words(k_ptr, r0)
    k10, k11, k12, k13 = _k_words(k_ptr, r1)
    k20, k21, k22, k23 = _k_words(k_ptr, r2)
    k30, k31, k32, k33 = _k_words(k_ptr, r3)
    ka0, va0 = _scale_zero_words(k_ptr, v_ptr, base0, 2 * t, n0, end, ROW, W, MASKED)
    ka1, va1 = _scale_zero_words(k_ptr, v_ptr, base0, 2 * t + 1, n0, end, ROW, W, MASKED)
    ka2, va2 = _scale_zero_words(k_ptr, v_ptr, base0, 2 * t + 8, n0, end, ROW, W, MASKED)
    ka3, va3 = _scale_zero_words(k_ptr, v_ptr, base0, 2 * t + 9, n0, end, ROW, W, MASKED)
    ka4, va4 = _scale_zero_words(k_ptr, v_ptr, base1, 2 * t, n0 + 16, end, ROW, W, MASKED)
    ka5, va5 = _scale_zero_words(k_ptr, v_ptr, base1, 2 * t + 1, n0 + 16, end, ROW, W, MASKED)
    ka6, va6 = _scale_zero_words(k_ptr, v_ptr, base1, 2 * t + 8, n0 + 16, end, ROW, W, MASKED)
    ka7, va7 = _scale_zero_words(k_ptr, v_ptr, base1, 2 * t + 9, n0 + 16, end, ROW, W, MASKED)
    x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7 = _pv_mma_loads(v_ptr, base0, base1, g, t, ROW)
    return (k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
            ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
            x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7)


@triton.jit
def _head_rows_math(
    k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
    ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
    x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
    n0, end, lane, g, t,
    qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
    q_step, q_sum, m_i, l_p, pw_p, z_p, c0, c1, c2, c3,
    MASKED: tl.constexpr, FAST: tl.constexpr, GROUP: tl.constexpr,
):
    """Online-softmax update of head g (lane (g, t)) with tokens [n0, n0 + 32) from the words of
    _head_rows_loads: m_i, and this lane's parts l_p, pw_p, z_p of the softmax sum, of
    sum fp16(p * v_scale) and of sum p * v_zero; c0..c3 the (8, 32) value MMA sums (_pv_mma_apply)."""
    r00, r01 = _block_scores(k00, k01, k02, k03, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3,
                             qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, FAST)
    r10, r11 = _block_scores(k10, k11, k12, k13, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3,
                             qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, FAST)
    r20, r21 = _block_scores(k20, k21, k22, k23, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3,
                             qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, FAST)
    r30, r31 = _block_scores(k30, k31, k32, k33, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3,
                             qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7, FAST)
    s00, vs00, vz00 = _token_log2_score(r00, ka0, va0, 2 * t, n0, end, q_step, q_sum, MASKED)
    s01, vs01, vz01 = _token_log2_score(r01, ka1, va1, 2 * t + 1, n0, end, q_step, q_sum, MASKED)
    s10, vs10, vz10 = _token_log2_score(r10, ka2, va2, 2 * t + 8, n0, end, q_step, q_sum, MASKED)
    s11, vs11, vz11 = _token_log2_score(r11, ka3, va3, 2 * t + 9, n0, end, q_step, q_sum, MASKED)
    s20, vs20, vz20 = _token_log2_score(r20, ka4, va4, 2 * t, n0 + 16, end, q_step, q_sum, MASKED)
    s21, vs21, vz21 = _token_log2_score(r21, ka5, va5, 2 * t + 1, n0 + 16, end, q_step, q_sum, MASKED)
    s30, vs30, vz30 = _token_log2_score(r30, ka6, va6, 2 * t + 8, n0 + 16, end, q_step, q_sum, MASKED)
    s31, vs31, vz31 = _token_log2_score(r31, ka7, va7, 2 * t + 9, n0 + 16, end, q_step, q_sum, MASKED)
    m_tile = tl.maximum(tl.maximum(tl.maximum(s00, s01), tl.maximum(s10, s11)),
                        tl.maximum(tl.maximum(s20, s21), tl.maximum(s30, s31)))
    m_new = tl.maximum(m_i, _quad_max(m_tile, lane, FAST))
    alpha = tl.exp2(m_i - m_new)
    live = g < GROUP  # lanes past the group hold zero queries: their weights must be 0
    p00 = tl.exp2(s00 - m_new)
    p01 = tl.exp2(s01 - m_new)
    p10 = tl.exp2(s10 - m_new)
    p11 = tl.exp2(s11 - m_new)
    p20 = tl.exp2(s20 - m_new)
    p21 = tl.exp2(s21 - m_new)
    p30 = tl.exp2(s30 - m_new)
    p31 = tl.exp2(s31 - m_new)
    l_p = l_p * alpha + (p00 + p01 + p10 + p11 + p20 + p21 + p30 + p31)
    z_p = z_p * alpha + (p00 * vz00 + p01 * vz01 + p10 * vz10 + p11 * vz11 + p20 * vz20 + p21 * vz21
                         + p30 * vz30 + p31 * vz31)
    w00 = tl.where(live, p00 * vs00, 0.0).to(tl.float16).to(tl.float32)
    w01 = tl.where(live, p01 * vs01, 0.0).to(tl.float16).to(tl.float32)
    w10 = tl.where(live, p10 * vs10, 0.0).to(tl.float16).to(tl.float32)
    w11 = tl.where(live, p11 * vs11, 0.0).to(tl.float16).to(tl.float32)
    w20 = tl.where(live, p20 * vs20, 0.0).to(tl.float16).to(tl.float32)
    w21 = tl.where(live, p21 * vs21, 0.0).to(tl.float16).to(tl.float32)
    w30 = tl.where(live, p30 * vs30, 0.0).to(tl.float16).to(tl.float32)
    w31 = tl.where(live, p31 * vs31, 0.0).to(tl.float16).to(tl.float32)
    pw_p = pw_p * alpha + (w00 + w01 + w10 + w11 + w20 + w21 + w30 + w31)
    # the value sums hold heads 2t and 2t + 1: their rescale factors from lanes 4 (2t) and 4 (2t + 1)
    alpha_e = _shfl_f32(alpha, 8 * t, FAST)[None, :]
    alpha_o = _shfl_f32(alpha, 8 * t + 4, FAST)[None, :]
    c0 = c0 * alpha_e
    c1 = c1 * alpha_o
    c2 = c2 * alpha_e
    c3 = c3 * alpha_o
    c0, c1, c2, c3 = _pv_mma_apply(_pack_f16x2(w00, w01, FAST), _pack_f16x2(w10, w11, FAST),
                                   x0, x1, x2, x3, x4, x5, x6, x7, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _pv_mma_apply(_pack_f16x2(w20, w21, FAST), _pack_f16x2(w30, w31, FAST),
                                   y0, y1, y2, y3, y4, y5, y6, y7, c0, c1, c2, c3, FAST)
    return m_new, l_p, pw_p, z_p, c0, c1, c2, c3


@triton.jit
def _head_rows_tile(
    k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, lane, g, t,
    qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
    q_step, q_sum, m_i, l_p, pw_p, z_p, c0, c1, c2, c3,
    BLOCK_SIZE: tl.constexpr, W: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr, GROUP: tl.constexpr,
):
    """Tokens [n0, n0 + 32) without prefetch: their pages, words (_head_rows_loads) and math."""
    page0, page1 = _pages(bt_row, n0, end, BLOCK_SIZE, MASKED)
    (k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
     ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
     x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7) = _head_rows_loads(
        k_ptr, v_ptr, page0, page1, head_off, n0, end, stride_cb, g, t, BLOCK_SIZE, MASKED, W)
    return _head_rows_math(
        k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
        ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
        x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
        n0, end, lane, g, t, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
        q_step, q_sum, m_i, l_p, pw_p, z_p, c0, c1, c2, c3, MASKED, FAST, GROUP)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _kv4_decode_head_rows_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, part_m_ptr, part_l_ptr, part_o_ptr,
    # sizes
    qk_scale, num_kv_heads, num_partitions, partition_size,
    # strides (q/out in elements, caches in int32 words; rows are W + 1 words apart)
    stride_qb, stride_qh, stride_cb, stride_ch, stride_bt, stride_ob, stride_oh,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, FAST: tl.constexpr,
    GROUP: tl.constexpr = 8, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    _overlap_entry(PDL)
    W: tl.constexpr = HEAD_DIM // 8
    HALF: tl.constexpr = HEAD_DIM // 2
    tl.static_assert(HEAD_DIM == 128, "the head-rows decode kernel is written for head_dim 128")
    tl.static_assert(BLOCK_SIZE % 16 == 0, "the head-rows decode kernel needs pages of a multiple of 16 tokens")
    tl.static_assert(GROUP <= 8, "the head-rows decode kernel takes up to 8 query heads per KV head")
    bh, part, b, kvh, ctx, start, end, full_end = _program_span(context_lens_ptr, num_kv_heads, partition_size, TILE)

    lane = tl.arange(0, 32)
    g = lane // 4  # this lane's head (rows g and g + 8 of the score MMA)
    t = lane % 4
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (kvh * GROUP) * stride_qh
    # head g's scale: lane (g, t) reads dims 32 i + 4t + j of its head and the quad combines them
    q_sum = tl.zeros((32,), tl.float32)
    q_max = tl.zeros((32,), tl.float32)
    for i in tl.static_range(HEAD_DIM // 16):
        for j in tl.static_range(4):
            x = tl.load(q_row + g * stride_qh + 16 * i + 4 * t + j, mask=g < GROUP, other=0.0).to(tl.float32)
            q_sum += x
            q_max = tl.maximum(q_max, tl.abs(x))
    q_sum = _quad_sum(q_sum, lane, FAST) * qk_scale
    q_max = _quad_max(q_max, lane, FAST) * qk_scale
    q_step = tl.where(q_max > 0, q_max / 32512.0, 1.0)  # |q16| <= 32512 keeps the high byte in [-127, 127]
    inv = qk_scale / q_step
    qh0, ql0 = _query_rows(q_row, stride_qh, inv, g, t, 0, GROUP)
    qh1, ql1 = _query_rows(q_row, stride_qh, inv, g, t, 16, GROUP)
    qh2, ql2 = _query_rows(q_row, stride_qh, inv, g, t, 32, GROUP)
    qh3, ql3 = _query_rows(q_row, stride_qh, inv, g, t, 48, GROUP)
    qh4, ql4 = _query_rows(q_row, stride_qh, inv, g, t, HALF, GROUP)
    qh5, ql5 = _query_rows(q_row, stride_qh, inv, g, t, HALF + 16, GROUP)
    qh6, ql6 = _query_rows(q_row, stride_qh, inv, g, t, HALF + 32, GROUP)
    qh7, ql7 = _query_rows(q_row, stride_qh, inv, g, t, HALF + 48, GROUP)

    m_i = tl.full((32,), float("-inf"), tl.float32)
    l_p = tl.zeros((32,), tl.float32)
    pw_p = l_p
    z_p = l_p
    c0 = tl.zeros((8, 32), tl.float32)
    c1 = c0
    c2 = c0
    c3 = c0
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * stride_ch
    if PREFETCH:
        # Software pipelining by one tile, as the 'mma' kernel: tile i + 1's pages and words are in
        # flight during tile i's math. The prologue's loads are masked (there may be no full tile);
        # the last iteration reloads the last full tile (cache hits) instead of branching.
        page0, page1 = _pages(bt_row, start, end, BLOCK_SIZE, True)
        (k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
         ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
         x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7) = _head_rows_loads(
            k_ptr, v_ptr, page0, page1, head_off, start, end, stride_cb, g, t, BLOCK_SIZE, True, W)
        last_full = tl.maximum(full_end - TILE, start)
        for n0 in range(start, full_end, TILE):
            nxt = tl.minimum(n0 + TILE, last_full)
            page0, page1 = _pages(bt_row, nxt, end, BLOCK_SIZE, False)
            (nk00, nk01, nk02, nk03, nk10, nk11, nk12, nk13, nk20, nk21, nk22, nk23, nk30, nk31, nk32, nk33,
             nka0, nka1, nka2, nka3, nka4, nka5, nka6, nka7, nva0, nva1, nva2, nva3, nva4, nva5, nva6, nva7,
             nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7) = _head_rows_loads(
                k_ptr, v_ptr, page0, page1, head_off, nxt, end, stride_cb, g, t, BLOCK_SIZE, False, W)
            m_i, l_p, pw_p, z_p, c0, c1, c2, c3 = _head_rows_math(
                k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
                ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
                x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                n0, end, lane, g, t, qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
                q_step, q_sum, m_i, l_p, pw_p, z_p, c0, c1, c2, c3, False, FAST, GROUP)
            (k00, k01, k02, k03, k10, k11, k12, k13, k20, k21, k22, k23, k30, k31, k32, k33,
             ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7, va0, va1, va2, va3, va4, va5, va6, va7,
             x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7) = (
                nk00, nk01, nk02, nk03, nk10, nk11, nk12, nk13, nk20, nk21, nk22, nk23, nk30, nk31, nk32, nk33,
                nka0, nka1, nka2, nka3, nka4, nka5, nka6, nka7, nva0, nva1, nva2, nva3, nva4, nva5, nva6, nva7,
                nx0, nx1, nx2, nx3, nx4, nx5, nx6, nx7, ny0, ny1, ny2, ny3, ny4, ny5, ny6, ny7)
    else:
        for n0 in range(start, full_end, TILE):
            m_i, l_p, pw_p, z_p, c0, c1, c2, c3 = _head_rows_tile(
                k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, lane, g, t,
                qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
                q_step, q_sum, m_i, l_p, pw_p, z_p, c0, c1, c2, c3, BLOCK_SIZE, W, False, FAST, GROUP)
    for n0 in range(full_end, end, TILE):  # at most one partial tile
        m_i, l_p, pw_p, z_p, c0, c1, c2, c3 = _head_rows_tile(
            k_ptr, v_ptr, bt_row, head_off, n0, end, stride_cb, lane, g, t,
            qh0, ql0, qh1, ql1, qh2, ql2, qh3, ql3, qh4, ql4, qh5, ql5, qh6, ql6, qh7, ql7,
            q_step, q_sum, m_i, l_p, pw_p, z_p, c0, c1, c2, c3, BLOCK_SIZE, W, True, FAST, GROUP)
    _overlap_release(PDL)

    l_i = _quad_sum(l_p, lane, FAST)  # head g's, in each lane of its quad
    pw_sum = _quad_sum(pw_p, lane, FAST)
    z_sum = _quad_sum(z_p, lane, FAST)
    ok = start < ctx  # a partition past the context stores nothing (the reduction never reads it)
    if SPLIT:
        idx = (bh.to(tl.int64) * GROUP) * num_partitions + part  # query head b * heads + kvh * GROUP + h is idx + h * parts
        ok = (lane * 0 + start) < ctx  # per lane, for the stores
        first = (t == 0) & (g < GROUP) & ok
        tl.store(part_m_ptr + idx + g * num_partitions, m_i, mask=first)
        tl.store(part_l_ptr + idx + g * num_partitions, l_i, mask=first)
        out_row = part_o_ptr + idx * HEAD_DIM
        head_stride = num_partitions * HEAD_DIM
        denom = tl.full((32,), 1.0, tl.float32)
    else:
        out_row = out_ptr + b.to(tl.int64) * stride_ob + (kvh * GROUP) * stride_oh
        head_stride = stride_oh
        denom = tl.where(l_i > 0, l_i, 1.0)
    # lane (g, t) stores heads 2t and 2t + 1: their sums from lanes 4 (2t) and 4 (2t + 1)
    _store_pv_rows(out_row, head_stride, lane, c0, c1, c2, c3,
                   _shfl_f32(pw_sum, 8 * t, FAST), _shfl_f32(pw_sum, 8 * t + 4, FAST),
                   _shfl_f32(z_sum, 8 * t, FAST), _shfl_f32(z_sum, 8 * t + 4, FAST),
                   _shfl_f32(denom, 8 * t, FAST), _shfl_f32(denom, 8 * t + 4, FAST), ok, HALF, SPLIT, GROUP)

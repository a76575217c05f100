"""W4A8 for small M on warp-level int8 MMAs, each lane streaming its weight words into registers.

At M = 16 the tensor-core kernels of w4a8_gemm.py run at about 60% of the M = 1 GEMV's weight
bandwidth (H200, session 27): Triton's tl.dot stages the weight tile through shared memory and
waits on each wgmma. Here there is no shared memory and no tile: one warp per program (num_warps=1,
written lane by lane as in paged_attention_mma.py: a (1, 32) tensor holds element i in lane i, and
each tile of 8 columns keeps its own fragment variables), and every 32-bit weight word a lane loads goes
straight into one `mma.sync.m16n8k32` (s8 x u8 -> s32) as its B fragment. The loop is a stream of
weight words, like the dp4a GEMV's, with the products on the tensor cores: 16 rows of x cost the
same instructions as 1. A program takes 16 rows; more rows (up to w4a8_gemm.WARP_MMA_MAX_M) get
more programs, the row blocks of one column block launched side by side so that all but the first
read the weights from L2.

Fragments (PTX ISA, m16n8k32, 8-bit operands; lane l, g = l // 4, t = l % 4):
    A (16 x 32, x rows): a0 = row g, k 4t..4t+3; a1 = row g + 8; a2, a3 the same rows, k 16 + 4t..
    B (32 x 8, weights):  b0 = col g, k 4t..4t+3;  b1 = col g, k 16 + 4t..
    C (16 x 8):           c0, c1 = row g, cols 2t, 2t + 1;  c2, c3 = row g + 8
The MMA sums over k, so any permutation of k applied to both A and B gives the same result. In a
128-group, weight word w (0..15) holds k = 4w..4w+3 in its low nibbles and 64 + 4w.. in its high
ones (shared/formats/weights.py). Step s (0..3) of a group gives lane (g, t) word 4t + s of weight
row g: b0 = its low nibbles, b1 = its high nibbles; the matching A fragments are x's words 4t + s
(a0, a1) and 16 + 4t + s (a2, a3) of the group. Four steps cover the group's 16 words, and a lane's
four weight words are contiguous.

    chn:  acc = sum x8 * q on the raw codes; the zero term as in w4a8_gemm's channel kernel.
    g128: per group, part = sum x8 * q (raw codes), then acc += (part - z * X) * s2 with X the
          group's sum of x8 per row: one more MMA per step against B = all ones gives it (c0 the
          sum of row g, c2 of row g + 8), so no group-sums input is needed.
The per-group scales of the C fragment's columns (2t, 2t + 1) are read per lane.

The next group's weight words are loaded before this group's MMAs (a register double buffer; AHEAD 2:
the group after the next, a triple buffer): the memory system needs several loads in flight per warp
to stream. Split-K slices write int32 partials
for w4a8_gemm's epilogue kernel, exactly as the other kernels do. The int32 sums equal the
reference's; under TRITON_INTERPRET the MMA is emulated over the 32 lanes (paged_attention_mma).
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release
from services.worker.kernels.paged_attention_mma import _IMMA_S8_U8, _mma_emulated
from services.worker.kernels.w4a8_gemv import _byte_sum

ONES = tl.constexpr(0x01010101)  # B = 1 in every byte: the MMA then sums each row of A


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FAST: tl.constexpr):
    """C += A (16 x 32 s8) x B (32 x 8 u8) on (1, 32) fragments (lane i in element i)."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm=_IMMA_S8_U8, constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            args=[a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )
    d0, d1, d2, d3 = _mma_emulated(
        tl.reshape(a0, (32,)), tl.reshape(a1, (32,)), tl.reshape(a2, (32,)), tl.reshape(a3, (32,)),
        tl.reshape(b0, (32,)), tl.reshape(b1, (32,)), tl.reshape(c0, (32,)), tl.reshape(c1, (32,)),
        tl.reshape(c2, (32,)), tl.reshape(c3, (32,)), A_SIGNED=True, B_SIGNED=False,
    )
    return tl.reshape(d0, (1, 32)), tl.reshape(d1, (1, 32)), tl.reshape(d2, (1, 32)), tl.reshape(d3, (1, 32))


@triton.jit
def _x_words(x_lo, x_hi):
    """A's fragments of one group's four steps (x_lo / x_hi: the group's first word in rows g / g + 8):
    step s takes words s (a0 row g, a1 row g + 8) and 16 + s (a2, a3)."""
    return (tl.load(x_lo), tl.load(x_hi), tl.load(x_lo + 16), tl.load(x_hi + 16),
            tl.load(x_lo + 1), tl.load(x_hi + 1), tl.load(x_lo + 17), tl.load(x_hi + 17),
            tl.load(x_lo + 2), tl.load(x_hi + 2), tl.load(x_lo + 18), tl.load(x_hi + 18),
            tl.load(x_lo + 3), tl.load(x_hi + 3), tl.load(x_lo + 19), tl.load(x_hi + 19))


@triton.jit
def _tile_words(w_ptrs, grp):
    """A tile's four weight words of group `grp` for each lane: words 4t .. 4t + 3 of its row."""
    base = w_ptrs + grp * 16
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)


@triton.jit
def _tiles_words(w_ptrs0, w_ptrs1, w_ptrs2, w_ptrs3, grp, J: tl.constexpr):
    """The four words of group `grp` of each of the J tiles, as 16 values (tile j's at 4 j; tiles
    past J repeat tile 0's, unused)."""
    u00, u01, u02, u03 = _tile_words(w_ptrs0, grp)
    u10, u11, u12, u13 = u00, u01, u02, u03
    u20, u21, u22, u23 = u00, u01, u02, u03
    u30, u31, u32, u33 = u00, u01, u02, u03
    if J > 1:
        u10, u11, u12, u13 = _tile_words(w_ptrs1, grp)
    if J > 2:
        u20, u21, u22, u23 = _tile_words(w_ptrs2, grp)
        u30, u31, u32, u33 = _tile_words(w_ptrs3, grp)
    return u00, u01, u02, u03, u10, u11, u12, u13, u20, u21, u22, u23, u30, u31, u32, u33


@triton.jit
def _tile_group(w0, w1, w2, w3,
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                c0, c1, c2, c3, FAST: tl.constexpr):
    """One tile of 8 columns over one group: C += x (rows g, g + 8) x codes, four steps; weight word
    s gives b0 (its low nibbles) and b1 (its high nibbles) of step s."""
    c0, c1, c2, c3 = _mma(x0, x1, x2, x3, w0 & 0x0F0F0F0F, (w0 >> 4) & 0x0F0F0F0F, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma(x4, x5, x6, x7, w1 & 0x0F0F0F0F, (w1 >> 4) & 0x0F0F0F0F, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma(x8, x9, x10, x11, w2 & 0x0F0F0F0F, (w2 >> 4) & 0x0F0F0F0F, c0, c1, c2, c3, FAST)
    c0, c1, c2, c3 = _mma(x12, x13, x14, x15, w3 & 0x0F0F0F0F, (w3 >> 4) & 0x0F0F0F0F, c0, c1, c2, c3, FAST)
    return c0, c1, c2, c3


@triton.jit
def _group_x_sums(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, s_lo, s_hi,
                  FAST: tl.constexpr):
    """s_lo / s_hi += the group's sums of x rows g / g + 8 (1, 32): an MMA against B = all ones per
    step (its C columns all alike), or in the interpreter the same sums spelled out."""
    if FAST:
        ones = tl.full((1, 32), ONES, tl.int32)
        s_lo, _, s_hi, _ = _mma(x0, x1, x2, x3, ones, ones, s_lo, s_lo, s_hi, s_hi, FAST)
        s_lo, _, s_hi, _ = _mma(x4, x5, x6, x7, ones, ones, s_lo, s_lo, s_hi, s_hi, FAST)
        s_lo, _, s_hi, _ = _mma(x8, x9, x10, x11, ones, ones, s_lo, s_lo, s_hi, s_hi, FAST)
        s_lo, _, s_hi, _ = _mma(x12, x13, x14, x15, ones, ones, s_lo, s_lo, s_hi, s_hi, FAST)
        return s_lo, s_hi
    # This lane's share: the signed bytes of its words (w4a8_gemv's _byte_sum, interpreter form).
    own_lo = _byte_sum(x0, 0, False) + _byte_sum(x2, 0, False) + _byte_sum(x4, 0, False) + _byte_sum(x6, 0, False) \
        + _byte_sum(x8, 0, False) + _byte_sum(x10, 0, False) + _byte_sum(x12, 0, False) + _byte_sum(x14, 0, False)
    own_hi = _byte_sum(x1, 0, False) + _byte_sum(x3, 0, False) + _byte_sum(x5, 0, False) + _byte_sum(x7, 0, False) \
        + _byte_sum(x9, 0, False) + _byte_sum(x11, 0, False) + _byte_sum(x13, 0, False) + _byte_sum(x15, 0, False)
    return s_lo + _over_quad(own_lo), s_hi + _over_quad(own_hi)


@triton.jit
def _over_quad(v):
    """(1, 32): for lane (g, t), the sum of v over the four lanes of g (interpreter only)."""
    quad = tl.sum(tl.reshape(v, (8, 4)), axis=1)
    return tl.reshape(tl.broadcast_to(quad[:, None], (8, 4)), (1, 32))


@triton.jit
def _g128_group(p0, p1, p2, p3, s_lo, s_hi, s2_ptr, zero_ptr, col_e, col_o, grp, stride_sn, c0, c1, c2, c3):
    """acc += (part - z * X) * s2 for one tile and group, with the scales of the C columns."""
    s2_e = tl.load(s2_ptr + col_e * stride_sn + grp).to(tl.int32)
    s2_o = tl.load(s2_ptr + col_o * stride_sn + grp).to(tl.int32)
    z_e = tl.load(zero_ptr + col_e * stride_sn + grp).to(tl.int32)
    z_o = tl.load(zero_ptr + col_o * stride_sn + grp).to(tl.int32)
    return (c0 + (p0 - z_e * s_lo) * s2_e, c1 + (p1 - z_o * s_lo) * s2_o,
            c2 + (p2 - z_e * s_hi) * s2_e, c3 + (p3 - z_o * s_hi) * s2_o)


@triton.jit
def _tile_step(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
               s_lo, s_hi, s2_ptr, zero_ptr, col, N, grp, stride_sn, c0, c1, c2, c3,
               G128: tl.constexpr, FAST: tl.constexpr):
    """One tile's share of a group: chn accumulates the raw products; g128 scales the group's."""
    if G128:
        z = tl.zeros_like(c0)
        p0, p1, p2, p3 = _tile_group(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13,
                                     x14, x15, z, z, z, z, FAST)
        return _g128_group(p0, p1, p2, p3, s_lo, s_hi, s2_ptr, zero_ptr, col % N, (col + 1) % N, grp, stride_sn,
                           c0, c1, c2, c3)
    return _tile_group(w0, w1, w2, w3, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                       c0, c1, c2, c3, FAST)


@triton.jit(do_not_specialize=["M", "GROUPS_PER_SPLIT"])
def _w4a8_warp_mma_kernel(
    # pointers (x and the packed weights as 32-bit words)
    x_ptr, sx_ptr, rowsum_ptr, qw_ptr, s2_ptr, zero_ptr, col_scale_ptr, out_ptr, ws_ptr,
    # sizes
    M, N, K, GROUPS_PER_SPLIT,
    # strides (x and qw rows in words)
    stride_xm, stride_qn, stride_sn, stride_om, stride_on,
    # meta
    G128: tl.constexpr, HAS_ROWSUM: tl.constexpr, J: tl.constexpr, USE_SPLIT: tl.constexpr, FAST: tl.constexpr,
    AHEAD: tl.constexpr = 1, PDL: tl.constexpr = 0,
):
    """Rows [16 pid_m, + 16) and columns [8 J pid_n, + 8 J) over the K slice program_id(1); J is
    1, 2 or 4 tiles of 8 columns, each its own (1, 32) fragment variables (a (J, 32) tensor's loads
    took a layout of their own, converted through shared memory before every MMA). The row blocks
    of one column block are launch neighbours: the second reads its weights from L2."""
    tl.static_assert(J == 1 or J == 2 or J == 4, "J: 1, 2 or 4 tiles of 8 columns")
    lane = tl.arange(0, 32)[None, :]
    row_blocks = tl.cdiv(M, 16)
    pid_m = tl.program_id(0) % row_blocks
    n0 = (tl.program_id(0) // row_blocks) * (8 * J)
    g = lane // 4 + 16 * pid_m  # A's and C's rows g and g + 8 of this row block
    t = lane % 4
    pid_k = tl.program_id(1)
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = min(g_start + GROUPS_PER_SPLIT, K // 128)
    # Rows past N or M are read from a valid row and dropped at the store: no masks in the loop
    # (a row of A or a column of B only reaches its own row or column of C).
    b_row = lane // 4  # B's column (weight row) of the lane within a tile
    w_ptrs0 = qw_ptr + ((n0 + b_row) % N) * stride_qn + 4 * t
    w_ptrs1 = qw_ptr + ((n0 + 8 + b_row) % N) * stride_qn + 4 * t
    w_ptrs2 = qw_ptr + ((n0 + 16 + b_row) % N) * stride_qn + 4 * t
    w_ptrs3 = qw_ptr + ((n0 + 24 + b_row) % N) * stride_qn + 4 * t
    x_lo = x_ptr + (g % M) * stride_xm + 4 * t  # A's row g
    x_hi = x_ptr + ((g + 8) % M) * stride_xm + 4 * t  # row g + 8
    col0 = n0 + 2 * t  # C's even column of tile 0; the odd one is col + 1
    zero = tl.zeros((1, 32), tl.int32)
    a00, a01, a02, a03 = zero, zero, zero, zero  # tile 0's C fragments, then tiles 1..3
    a10, a11, a12, a13 = zero, zero, zero, zero
    a20, a21, a22, a23 = zero, zero, zero, zero
    a30, a31, a32, a33 = zero, zero, zero, zero
    x_sum_lo = zero  # chn without rowsum: the slice's x sums of rows g and g + 8
    x_sum_hi = zero
    # Each tile's weight words of the current group; the next group's are loaded before its MMAs.
    u00, u01, u02, u03, u10, u11, u12, u13, u20, u21, u22, u23, u30, u31, u32, u33 = _tiles_words(
        w_ptrs0, w_ptrs1, w_ptrs2, w_ptrs3, g_start, J)
    # With AHEAD 2, v holds the next group's words and the loop loads the one after.
    v00, v01, v02, v03, v10, v11, v12, v13, v20, v21, v22, v23, v30, v31, v32, v33 = (
        u00, u01, u02, u03, u10, u11, u12, u13, u20, u21, u22, u23, u30, u31, u32, u33)
    if AHEAD > 1:
        v00, v01, v02, v03, v10, v11, v12, v13, v20, v21, v22, v23, v30, v31, v32, v33 = _tiles_words(
            w_ptrs0, w_ptrs1, w_ptrs2, w_ptrs3, min(g_start + 1, g_end - 1), J)
    # The weights are no kernel's output: their first words are requested before the PDL wait (as the
    # GEMV does), x and the partial sums only after it (launch_overlap.py).
    _overlap_entry(PDL)
    for grp in range(g_start, g_end):
        ahead = min(grp + AHEAD, g_end - 1)  # the last steps re-read the last group: in bounds, cached
        w00, w01, w02, w03, w10, w11, w12, w13, w20, w21, w22, w23, w30, w31, w32, w33 = _tiles_words(
            w_ptrs0, w_ptrs1, w_ptrs2, w_ptrs3, ahead, J)
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _x_words(x_lo + grp * 32,
                                                                                        x_hi + grp * 32)
        if G128:
            s_lo, s_hi = _group_x_sums(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
                                       zero, zero, FAST)
        else:
            s_lo, s_hi = zero, zero
            if not HAS_ROWSUM:
                x_sum_lo, x_sum_hi = _group_x_sums(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14,
                                                   x15, x_sum_lo, x_sum_hi, FAST)
        a00, a01, a02, a03 = _tile_step(u00, u01, u02, u03, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12,
                                        x13, x14, x15, s_lo, s_hi, s2_ptr, zero_ptr, col0, N, grp, stride_sn,
                                        a00, a01, a02, a03, G128, FAST)
        if J > 1:
            a10, a11, a12, a13 = _tile_step(u10, u11, u12, u13, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11,
                                            x12, x13, x14, x15, s_lo, s_hi, s2_ptr, zero_ptr, col0 + 8, N, grp,
                                            stride_sn, a10, a11, a12, a13, G128, FAST)
        if J > 2:
            a20, a21, a22, a23 = _tile_step(u20, u21, u22, u23, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11,
                                            x12, x13, x14, x15, s_lo, s_hi, s2_ptr, zero_ptr, col0 + 16, N, grp,
                                            stride_sn, a20, a21, a22, a23, G128, FAST)
            a30, a31, a32, a33 = _tile_step(u30, u31, u32, u33, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11,
                                            x12, x13, x14, x15, s_lo, s_hi, s2_ptr, zero_ptr, col0 + 24, N, grp,
                                            stride_sn, a30, a31, a32, a33, G128, FAST)
        if AHEAD > 1:
            u00, u01, u02, u03, u10, u11, u12, u13, u20, u21, u22, u23, u30, u31, u32, u33 = (
                v00, v01, v02, v03, v10, v11, v12, v13, v20, v21, v22, v23, v30, v31, v32, v33)
            v00, v01, v02, v03, v10, v11, v12, v13, v20, v21, v22, v23, v30, v31, v32, v33 = (
                w00, w01, w02, w03, w10, w11, w12, w13, w20, w21, w22, w23, w30, w31, w32, w33)
        else:
            u00, u01, u02, u03, u10, u11, u12, u13, u20, u21, u22, u23, u30, u31, u32, u33 = (
                w00, w01, w02, w03, w10, w11, w12, w13, w20, w21, w22, w23, w30, w31, w32, w33)
    _overlap_release(PDL)
    _finish_tile(a00, a01, a02, a03, g, col0, M, N, x_sum_lo, x_sum_hi, sx_ptr, rowsum_ptr, zero_ptr, col_scale_ptr,
                 out_ptr, ws_ptr, stride_om, stride_on, G128, HAS_ROWSUM, USE_SPLIT)
    if J > 1:
        _finish_tile(a10, a11, a12, a13, g, col0 + 8, M, N, x_sum_lo, x_sum_hi, sx_ptr, rowsum_ptr, zero_ptr,
                     col_scale_ptr, out_ptr, ws_ptr, stride_om, stride_on, G128, HAS_ROWSUM, USE_SPLIT)
    if J > 2:
        _finish_tile(a20, a21, a22, a23, g, col0 + 16, M, N, x_sum_lo, x_sum_hi, sx_ptr, rowsum_ptr, zero_ptr,
                     col_scale_ptr, out_ptr, ws_ptr, stride_om, stride_on, G128, HAS_ROWSUM, USE_SPLIT)
        _finish_tile(a30, a31, a32, a33, g, col0 + 24, M, N, x_sum_lo, x_sum_hi, sx_ptr, rowsum_ptr, zero_ptr,
                     col_scale_ptr, out_ptr, ws_ptr, stride_om, stride_on, G128, HAS_ROWSUM, USE_SPLIT)


@triton.jit
def _finish_tile(c0, c1, c2, c3, g, col, M, N, x_sum_lo, x_sum_hi, sx_ptr, rowsum_ptr, zero_ptr, col_scale_ptr,
                 out_ptr, ws_ptr, stride_om, stride_on, G128: tl.constexpr, HAS_ROWSUM: tl.constexpr,
                 USE_SPLIT: tl.constexpr):
    """A tile's four C registers (rows g, g + 8; columns col, col + 1): chn's zero term where x8's row
    sums were not given (int32, as w4a8_gemm's channel kernel), then partials or the epilogue."""
    if G128:
        zero_e = 0.0
        zero_o = 0.0
    else:
        zero_e = tl.load(zero_ptr + col % N).to(tl.float32)  # integers in [0, 15]
        zero_o = tl.load(zero_ptr + (col + 1) % N).to(tl.float32)
        if not HAS_ROWSUM:
            c0 -= zero_e.to(tl.int32) * x_sum_lo
            c1 -= zero_o.to(tl.int32) * x_sum_lo
            c2 -= zero_e.to(tl.int32) * x_sum_hi
            c3 -= zero_o.to(tl.int32) * x_sum_hi
    sub = HAS_ROWSUM and not G128
    _store(c0, g, col, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_e, out_ptr, ws_ptr, stride_om, stride_on, sub,
           USE_SPLIT)
    _store(c1, g, col + 1, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_o, out_ptr, ws_ptr, stride_om, stride_on,
           sub, USE_SPLIT)
    _store(c2, g + 8, col, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_e, out_ptr, ws_ptr, stride_om, stride_on,
           sub, USE_SPLIT)
    _store(c3, g + 8, col + 1, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_o, out_ptr, ws_ptr, stride_om,
           stride_on, sub, USE_SPLIT)


@triton.jit
def _store(acc, m, n, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero, out_ptr, ws_ptr, stride_om, stride_on,
           SUB_ROWSUM: tl.constexpr, USE_SPLIT: tl.constexpr):
    """One C register (1, 32) at rows m and columns n (1, 32): the int32 partial of this K slice, or
    the epilogue of w4a8_gemm's kernels (same fp32 operations, same order)."""
    mask = (m < M) & (n < N)
    if USE_SPLIT:
        tl.store(ws_ptr + tl.program_id(1) * M * N + m * N + n, acc, mask=mask)
    else:
        y = acc.to(tl.float32)
        if SUB_ROWSUM:
            y = y - tl.load(rowsum_ptr + m, mask=m < M, other=0).to(tl.float32) * zero
        y = y * tl.load(sx_ptr + m, mask=m < M, other=0.0) * tl.load(col_scale_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n * stride_on, y.to(tl.float16), mask=mask)

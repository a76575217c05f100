"""W4A8 for M <= 16 on warp-level int8 MMAs, each lane streaming its weight words into registers.

At M = 16 the tensor-core kernels of w4a8_gemm.py run at about 60% of the M = 1 GEMV's weight
bandwidth (H200, session 27): Triton's tl.dot stages the weight tile through shared memory and
waits on each wgmma. Here there is no shared memory and no tile: one warp per program (num_warps=1,
written lane by lane as in paged_attention_mma.py: a (32,) tensor holds element i in lane i, a
(J, 32) tensor row j in lane i's j-th register), and every 32-bit weight word a lane loads goes
straight into one `mma.sync.m16n8k32` (s8 x u8 -> s32) as its B fragment. The loop is a stream of
weight words, like the dp4a GEMV's, with the products on the tensor cores: 16 rows of x cost the
same instructions as 1.

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

The next group's weight words are loaded before this group's MMAs (a register double buffer): the
memory system needs several loads in flight per warp to stream. Split-K slices write int32 partials
for w4a8_gemm's epilogue kernel, exactly as the other kernels do. The int32 sums equal the
reference's; under TRITON_INTERPRET the MMA is emulated over the 32 lanes (paged_attention_mma).
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release
from services.worker.kernels.paged_attention_mma import _IMMA_S8_U8, _mma_emulated

ONES = 0x01010101  # B = 1 in every byte: the MMA then sums each row of A


@triton.jit
def _mma_tiles(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, FAST: tl.constexpr):
    """C += A (16 x 32 s8, fragments (32,)) x B (32 x 8 u8) for each row j of the (J, 32) B and C
    fragments: J MMAs sharing one A."""
    if FAST:
        shape = c0.shape
        return tl.inline_asm_elementwise(
            asm=_IMMA_S8_U8, constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            args=[tl.broadcast_to(a0[None, :], shape), tl.broadcast_to(a1[None, :], shape),
                  tl.broadcast_to(a2[None, :], shape), tl.broadcast_to(a3[None, :], shape),
                  tl.broadcast_to(b0, shape), tl.broadcast_to(b1, shape), c0, c1, c2, c3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )
    J: tl.constexpr = c0.shape[0]
    rows = tl.arange(0, J)[:, None]
    b0 = tl.broadcast_to(b0, c0.shape)
    b1 = tl.broadcast_to(b1, c0.shape)
    for j in tl.static_range(J):
        here = rows == j
        d0, d1, d2, d3 = _mma_emulated(
            a0, a1, a2, a3, _row(b0, here), _row(b1, here), _row(c0, here), _row(c1, here), _row(c2, here),
            _row(c3, here), A_SIGNED=True, B_SIGNED=False,
        )
        c0 = tl.where(here, d0[None, :], c0)
        c1 = tl.where(here, d1[None, :], c1)
        c2 = tl.where(here, d2[None, :], c2)
        c3 = tl.where(here, d3[None, :], c3)
    return c0, c1, c2, c3


@triton.jit
def _row(x, here):
    """Row `here` of a (J, 32) int32 tensor as (32,) (the interpreter's emulation only)."""
    return tl.sum(tl.where(here, x, 0), axis=0)


@triton.jit
def _group_words(w_ptrs, grp):
    """The four weight words (J, 32) of group `grp` for each lane: words 4t .. 4t + 3 of its row."""
    base = w_ptrs + grp * 16
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3)


@triton.jit
def _step(w, x_lo, x_hi, s: tl.constexpr, c0, c1, c2, c3, s0, s2, FAST: tl.constexpr):
    """Step s of a group: weight words w (J, 32) meet x words s (a0, a1) and 16 + s (a2, a3) of
    rows g and g + 8; s0 / s2 += the step's sums of those x rows (the all-ones MMA)."""
    a0 = tl.load(x_lo + s)
    a1 = tl.load(x_hi + s)
    a2 = tl.load(x_lo + 16 + s)
    a3 = tl.load(x_hi + 16 + s)
    c0, c1, c2, c3 = _mma_tiles(a0, a1, a2, a3, w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F, c0, c1, c2, c3, FAST)
    ones = tl.full((1, 32), ONES, tl.int32)
    s0, _, s2, _ = _mma_tiles(a0, a1, a2, a3, ones, ones, s0, s0, s2, s2, FAST)
    return c0, c1, c2, c3, s0, s2


@triton.jit
def _group_mmas(w0, w1, w2, w3, x_lo, x_hi, c0, c1, c2, c3, s0, s2, FAST: tl.constexpr):
    """One 128-group (x_lo / x_hi: its first x word in rows g / g + 8): C += x x codes over the
    four steps, s0 / s2 += the group's sums of x rows g / g + 8 (every column of those MMAs alike)."""
    c0, c1, c2, c3, s0, s2 = _step(w0, x_lo, x_hi, 0, c0, c1, c2, c3, s0, s2, FAST)
    c0, c1, c2, c3, s0, s2 = _step(w1, x_lo, x_hi, 1, c0, c1, c2, c3, s0, s2, FAST)
    c0, c1, c2, c3, s0, s2 = _step(w2, x_lo, x_hi, 2, c0, c1, c2, c3, s0, s2, FAST)
    c0, c1, c2, c3, s0, s2 = _step(w3, x_lo, x_hi, 3, c0, c1, c2, c3, s0, s2, FAST)
    return c0, c1, c2, c3, s0, s2


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
    PDL: tl.constexpr = 0,
):
    """Columns [8 J program_id(0), + 8 J) of all M <= 16 rows, over the K slice program_id(1)."""
    lane = tl.arange(0, 32)
    g = lane // 4
    t = lane % 4
    tiles = tl.arange(0, J)[:, None]  # (J, 1)
    n0 = tl.program_id(0) * (8 * J)
    pid_k = tl.program_id(1)
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = min(g_start + GROUPS_PER_SPLIT, K // 128)
    # Rows past N or M are read from a valid row and dropped at the store: no masks in the loop
    # (a row of A or a column of B only reaches its own row or column of C).
    w_ptrs = qw_ptr + ((n0 + 8 * tiles + g[None, :]) % N) * stride_qn + 4 * t[None, :]  # (J, 32): B's row g
    x_lo = x_ptr + (g % M) * stride_xm + 4 * t  # (32,): A's row g
    x_hi = x_ptr + ((g + 8) % M) * stride_xm + 4 * t  # row g + 8
    col = n0 + 8 * tiles + 2 * t[None, :]  # (J, 32): C's even column; the odd one is col + 1
    col_e = col % N
    col_o = (col + 1) % N
    _overlap_entry(PDL)
    acc0 = tl.zeros((J, 32), tl.int32)
    acc1 = tl.zeros((J, 32), tl.int32)
    acc2 = tl.zeros((J, 32), tl.int32)
    acc3 = tl.zeros((J, 32), tl.int32)
    x_sum_lo = tl.zeros((1, 32), tl.int32)  # chn without rowsum: the slice's x sums, rows g and g + 8
    x_sum_hi = tl.zeros((1, 32), tl.int32)
    w0, w1, w2, w3 = _group_words(w_ptrs, g_start)
    for grp in range(g_start, g_end):
        # The next group's words first (the last step re-reads its own group: in bounds, cached).
        n0w, n1w, n2w, n3w = _group_words(w_ptrs, min(grp + 1, g_end - 1))
        xg_lo = x_lo + grp * 32
        xg_hi = x_hi + grp * 32
        if G128:
            zero_tiles = tl.zeros((J, 32), tl.int32)
            p0, p1, p2, p3, s_lo, s_hi = _group_mmas(w0, w1, w2, w3, xg_lo, xg_hi, zero_tiles, zero_tiles,
                                                     zero_tiles, zero_tiles, tl.zeros((1, 32), tl.int32),
                                                     tl.zeros((1, 32), tl.int32), FAST)
            s2_e = tl.load(s2_ptr + col_e * stride_sn + grp).to(tl.int32)
            s2_o = tl.load(s2_ptr + col_o * stride_sn + grp).to(tl.int32)
            z_e = tl.load(zero_ptr + col_e * stride_sn + grp).to(tl.int32)
            z_o = tl.load(zero_ptr + col_o * stride_sn + grp).to(tl.int32)
            acc0 += (p0 - z_e * s_lo) * s2_e
            acc1 += (p1 - z_o * s_lo) * s2_o
            acc2 += (p2 - z_e * s_hi) * s2_e
            acc3 += (p3 - z_o * s_hi) * s2_o
        else:
            acc0, acc1, acc2, acc3, x_sum_lo, x_sum_hi = _group_mmas(w0, w1, w2, w3, xg_lo, xg_hi, acc0, acc1, acc2,
                                                                     acc3, x_sum_lo, x_sum_hi, FAST)
        w0, w1, w2, w3 = n0w, n1w, n2w, n3w
    _overlap_release(PDL)
    row_lo = g[None, :]  # (1, 32): C rows g and g + 8
    row_hi = row_lo + 8
    if not G128:
        zero_e = tl.load(zero_ptr + col_e).to(tl.float32)  # integers in [0, 15]
        zero_o = tl.load(zero_ptr + col_o).to(tl.float32)
        if not HAS_ROWSUM:
            acc0 -= zero_e.to(tl.int32) * x_sum_lo
            acc1 -= zero_o.to(tl.int32) * x_sum_lo
            acc2 -= zero_e.to(tl.int32) * x_sum_hi
            acc3 -= zero_o.to(tl.int32) * x_sum_hi
    else:
        zero_e = 0.0
        zero_o = 0.0
    _store(acc0, row_lo, col, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_e, out_ptr, ws_ptr, stride_om, stride_on,
           HAS_ROWSUM and not G128, USE_SPLIT)
    _store(acc1, row_lo, col + 1, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_o, out_ptr, ws_ptr, stride_om,
           stride_on, HAS_ROWSUM and not G128, USE_SPLIT)
    _store(acc2, row_hi, col, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_e, out_ptr, ws_ptr, stride_om, stride_on,
           HAS_ROWSUM and not G128, USE_SPLIT)
    _store(acc3, row_hi, col + 1, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero_o, out_ptr, ws_ptr, stride_om,
           stride_on, HAS_ROWSUM and not G128, USE_SPLIT)


@triton.jit
def _store(acc, m, n, M, N, sx_ptr, rowsum_ptr, col_scale_ptr, zero, out_ptr, ws_ptr, stride_om, stride_on,
           SUB_ROWSUM: tl.constexpr, USE_SPLIT: tl.constexpr):
    """One C fragment register (J, 32) at rows m (1, 32) and columns n (J, 32): the int32 partial of
    this K slice, or the epilogue of w4a8_gemm's kernels (same fp32 operations, same order)."""
    mask = (m < M) & (n < N)
    if USE_SPLIT:
        tl.store(ws_ptr + tl.program_id(1) * M * N + m * N + n, acc, mask=mask)
    else:
        y = acc.to(tl.float32)
        if SUB_ROWSUM:
            y = y - tl.load(rowsum_ptr + m, mask=m < M, other=0).to(tl.float32) * zero
        y = y * tl.load(sx_ptr + m, mask=m < M, other=0.0) * tl.load(col_scale_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + n * stride_on, y.to(tl.float16), mask=mask)

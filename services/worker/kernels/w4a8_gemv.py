"""W4A8 for a few tokens (M <= 4): 4-byte integer dot products on CUDA cores, no tensor cores.

At decode batch 1..4 the tensor-core kernels of w4a8_gemm.py pad M to 16 and spend their time
filling MMA tiles; the work is really a stream over the weight bytes. Here each 32-bit word of
packed weights (4 low nibbles = k .. k+3, 4 high nibbles = k+64 .. k+67 of a 128 chunk, the
layout of shared/formats/weights.py) meets the matching 32-bit words of x8 in two dp4a
instructions (sum of 4 byte products into int32), so the loop is loads plus a few integer ops.

    chn:  acc = sum x8 * q                  (the zero term as in the tensor-core kernel)
    g128: acc = sum x8 * ((q - z) * s2)     computed per word as s2 * (sum x8 * q - z * sum x8):
          the chn dot of the unsigned nibbles, corrected by the word's x byte sum, so no int8
          weight is built (the SWAR (q - z) * s2 per word cost ~30% more time). At M = 1 with
          x8's 128-group sums X_g given (the act-quant kernel writes them), the correction is
          s2 * z * X_g once per weight row and group instead of per word.

M = 1 (_row_sums) and M = 2..4 (_many_row_sums) take different tilings: broadcasting each weight
word over M rows of x costs a layout change through shared memory per step, which at M = 1 is
pure overhead. The x-shared loop (_row_sums_x_shared, session 25; the `.xs` variants, which the
H200 policy picks at M = 1 everywhere and at M = 2..4 on some shapes) runs one program per token
and lays its tile out so that each thread's x words serve all its weight rows.

The sums are the same exact int32 values as the reference; the epilogue (or the split-K
workspace and its epilogue kernel) is shared with w4a8_gemm.py. In the interpreter the byte
products are spelled out with shifts (no inline PTX there).
"""

from __future__ import annotations

import triton
import triton.language as tl

from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release


@triton.jit
def _byte(v, b: tl.constexpr):
    """Signed byte b of each int32 of v (the interpreter's stand-in for dp4a's operand split)."""
    return (v << (24 - 8 * b)) >> 24


@triton.jit
def _nibble(w, b: tl.constexpr, high: tl.constexpr):
    return (w >> (8 * b + 4 * high)) & 0xF


@triton.jit
def _dot_chn(w, x_lo, x_hi, acc, FAST: tl.constexpr):
    """acc + sum over w's 4 bytes of (low nibble * x_lo byte + high nibble * x_hi byte)."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 t, r;
            and.b32 t, $1, 0x0F0F0F0F;
            dp4a.u32.s32 r, t, $2, $4;
            shr.u32 t, $1, 4;
            and.b32 t, t, 0x0F0F0F0F;
            dp4a.u32.s32 $0, t, $3, r;
            }""",
            constraints="=r,r,r,r,r", args=[w, x_lo, x_hi, acc], dtype=tl.int32, is_pure=True, pack=1,
        )
    for b in tl.static_range(4):
        acc += _nibble(w, b, 0) * _byte(x_lo, b) + _nibble(w, b, 1) * _byte(x_hi, b)
    return acc


@triton.jit
def _byte_sum(x, acc, FAST: tl.constexpr):
    """acc + the sum of x's 4 signed bytes."""
    if FAST:
        return tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, 0x01010101, $2;",
            constraints="=r,r,r", args=[x, acc], dtype=tl.int32, is_pure=True, pack=1,
        )
    return acc + _byte(x, 0) + _byte(x, 1) + _byte(x, 2) + _byte(x, 3)


@triton.jit
def _load_step(
    qw_ptr, x_ptr, s2_ptr, zero_ptr, g0, g_end, rn, offs_m, mask_m, offs_c,
    stride_qn, stride_xm, stride_sn, G128: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
):
    """The words of groups g0 .. g0 + GROUPS_PER_STEP - 1 (those < g_end; the rest read as 0):
    weights (BN, C), x of each group's low and high half (BM, C), and for g128 s2 and z (BN, C)."""
    group = g0 + offs_c // 16  # (C,): the group each word column belongs to
    in_slice = group < g_end
    # g0 * 16 + offs_c, not group * 16 + offs_c % 16: the same words, spelled so the compiler
    # sees a contiguous run and issues 16-byte loads.
    w = tl.load(qw_ptr + rn[:, None] * stride_qn + (g0 * 16 + offs_c)[None, :], mask=in_slice[None, :], other=0)
    # Masked x words are 0, so a column past the slice adds nothing whatever its weight.
    x_rows = x_ptr + offs_m[:, None] * stride_xm + (group * 32 + offs_c % 16)[None, :]
    x_mask = mask_m[:, None] & in_slice[None, :]
    x_lo = tl.load(x_rows, mask=x_mask, other=0)
    x_hi = tl.load(x_rows + 16, mask=x_mask, other=0)
    if G128:
        # One s2 / zero byte per row and group, then repeated over the group's 16 word columns
        # (a 16-fold gather of the same bytes costs more than the broadcast).
        BN: tl.constexpr = rn.shape[0]
        groups = g0 + tl.arange(0, GROUPS_PER_STEP)
        g_ptrs = rn[:, None] * stride_sn + groups[None, :]
        g_mask = (groups < g_end)[None, :]
        s2 = tl.load(s2_ptr + g_ptrs, mask=g_mask, other=0).to(tl.int32)  # (BN, GROUPS_PER_STEP)
        z = tl.load(zero_ptr + g_ptrs, mask=g_mask, other=0).to(tl.int32)
        s2 = tl.reshape(tl.broadcast_to(s2[:, :, None], (BN, GROUPS_PER_STEP, 16)), (BN, 16 * GROUPS_PER_STEP))
        z = tl.reshape(tl.broadcast_to(z[:, :, None], (BN, GROUPS_PER_STEP, 16)), (BN, 16 * GROUPS_PER_STEP))
    else:
        s2 = w
        z = w
    return w, x_lo, x_hi, s2, z


@triton.jit
def _weight_step_one_row(qw_ptr, s2_ptr, zero_ptr, g0, g_end, rn, offs_g, offs_j, stride_qn, stride_sn,
                         G128: tl.constexpr):
    """The weight words of groups g0 + offs_g (those < g_end; the rest read as 0) as
    (BN, GPS, 16), and for g128 (BN, GPS) s2 and z. Group and word-in-group as two axes: s2 and z
    broadcast along the last one in registers."""
    groups = g0 + offs_g
    in_slice = groups < g_end
    words = (g0 * 16 + offs_g * 16)[:, None] + offs_j[None, :]  # (GPS, 16): runs of 16 contiguous words
    w = tl.load(qw_ptr + rn[:, None, None] * stride_qn + words[None, :, :], mask=in_slice[None, :, None], other=0)
    if G128:
        g_ptrs = rn[:, None] * stride_sn + groups[None, :]
        s2 = tl.load(s2_ptr + g_ptrs, mask=in_slice[None, :], other=0).to(tl.int32)
        z = tl.load(zero_ptr + g_ptrs, mask=in_slice[None, :], other=0).to(tl.int32)
    else:
        s2 = w
        z = w
    return w, s2, z


@triton.jit
def _x_step_one_row(x_ptr, g0, g_end, rn, offs_g, offs_j):
    """One row of x: the words of groups g0 + offs_g, low and high halves, spelled per weight word
    (every weight row reads the same ones, from L1) so they arrive in the weights' register
    layout: a (GPS, 16) load would be moved through shared memory each step."""
    groups = g0 + offs_g
    in_slice = (groups < g_end)[None, :, None]
    x_words = x_ptr + (rn * 0)[:, None, None] + ((groups * 32)[:, None] + offs_j[None, :])[None, :, :]
    return tl.load(x_words, mask=in_slice, other=0), tl.load(x_words + 16, mask=in_slice, other=0)


@triton.jit
def _accumulate(w, s2, z, x_lo, x_hi, acc, x_sum, G128: tl.constexpr, HAS_ROWSUM: tl.constexpr, FAST: tl.constexpr):
    """One step of one row of x against the weight words w (BN, GPS, 16). With group sums (g128
    HAS_ROWSUM) the zero term is left to the caller: acc gets s2 * (x . q) only."""
    if G128:
        dot = _dot_chn(w, x_lo, x_hi, tl.zeros_like(acc), FAST)
        if HAS_ROWSUM:
            acc += s2[:, :, None] * dot
        else:
            x_word_sum = _byte_sum(x_hi, _byte_sum(x_lo, tl.zeros_like(acc), FAST), FAST)
            acc += s2[:, :, None] * dot - (s2 * z)[:, :, None] * x_word_sum
    else:
        acc = _dot_chn(w, x_lo, x_hi, acc, FAST)
        if not HAS_ROWSUM:
            x_sum = _byte_sum(x_hi, _byte_sum(x_lo, x_sum, FAST), FAST)
    return acc, x_sum


@triton.jit
def _row_sums(
    qw_ptr, x_ptr, rowsum_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, stride_qn, stride_sn,
    G128: tl.constexpr, HAS_ROWSUM: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):
    """M = 1: (BLOCK_N, 1) int32 sums over groups g_start .. g_end - 1 (chn: less zero * sum x when
    there is no rowsum), with no tile broadcast over M: the (BN, BM, C) tiles of _many_row_sums need
    a layout conversion through shared memory (and its barriers) every step.

    Waits for the kernel before (_overlap_entry) itself, after requesting the first step's weight
    words: weights are never written by a kernel (x is), so under PDL their DRAM latency overlaps
    the previous kernel's tail. H200 (session 22, graph of 4 calls, bench/kernels.py): 2-7% at
    every Llama-2-7B shape at M = 1, e.g. chn 4096x4096 5.98 -> 5.66 us, 12288x4096 11.35 -> 10.86;
    the first two steps before the wait (more registers) won nothing more.

    The same loop with one accumulator per row of x for M = 2..4 (session 22, no barriers in its
    SASS either) was slower on the H200 than the broadcast loop for chn (4096x4096 M = 2: 9.4 vs
    8.1 us) and than the MMA kernels for g128 (12288x4096: 20.8 vs 17.2 us): dropped in session 23.
    """
    offs_g = tl.arange(0, GROUPS_PER_STEP)
    offs_j = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N, GROUPS_PER_STEP, 16), dtype=tl.int32)
    x_sum = acc  # chn without a rowsum: every weight row holds the same x sums
    zero_term = tl.zeros((BLOCK_N, GROUPS_PER_STEP), dtype=tl.int32)  # g128 with group sums: sum s2 * z * X_g
    w, s2, z = _weight_step_one_row(qw_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, offs_g, offs_j,
                                    stride_qn, stride_sn, G128)
    _overlap_entry(PDL)
    x_lo, x_hi = _x_step_one_row(x_ptr, g_start, g_end, rn, offs_g, offs_j)
    # Software pipelining by one step, as in _many_row_sums.
    for g0 in range(g_start, g_end, GROUPS_PER_STEP):
        g_next = g0 + GROUPS_PER_STEP
        w_n, s2_n, z_n = _weight_step_one_row(qw_ptr, s2_ptr, zero_ptr, g_next, g_end, rn,
                                              offs_g, offs_j, stride_qn, stride_sn, G128)
        x_lo_n, x_hi_n = _x_step_one_row(x_ptr, g_next, g_end, rn, offs_g, offs_j)
        if G128 and HAS_ROWSUM:
            # X_g (the act-quant kernel's sum of the group's x bytes), read per weight row like
            # x so it arrives in s2's layout: one multiply-add per row and group, where the
            # per-word x byte sums cost two dp4a and a multiply-add per word.
            groups = g0 + offs_g
            x_group_sum = tl.load(rowsum_ptr + (rn * 0)[:, None] + groups[None, :], mask=(groups < g_end)[None, :], other=0)
            zero_term += s2 * z * x_group_sum
        acc, x_sum = _accumulate(w, s2, z, x_lo, x_hi, acc, x_sum, G128, HAS_ROWSUM, FAST)
        w, s2, z, x_lo, x_hi = w_n, s2_n, z_n, x_lo_n, x_hi_n
    total = tl.sum(tl.sum(acc, axis=2), axis=1)
    if G128 and HAS_ROWSUM:
        total -= tl.sum(zero_term, axis=1)
    if not G128 and not HAS_ROWSUM:
        zero = tl.load(zero_ptr + rn).to(tl.int32)
        total -= zero * tl.sum(tl.sum(x_sum, axis=2), axis=1)
    return total[:, None]


@triton.jit
def _split4(v):
    """The 4 words of each thread's vector (last axis, size 4) as four tensors, in registers."""
    a, b = tl.split(tl.reshape(v, v.shape[:-1] + (2, 2)))
    return tl.split(a) + tl.split(b)


@triton.jit
def _row_sums_x_shared(
    qw_ptr, x_ptr, rowsum_ptr, sx_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, stride_qn, stride_sn,
    G128: tl.constexpr, HAS_ROWSUM: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
    FAST: tl.constexpr, PDL: tl.constexpr,
):
    """One token (the kernel points x, sx and the sums at its row) with the x words shared by all
    BLOCK_N weight rows in registers: a (V, BLOCK_N, 4) tile, V = 4
    vectors of 4 words per group, every lane along V (GROUPS_PER_STEP * 4 = 32 * num_warps), so a
    thread holds one 4-word vector of each of the BLOCK_N rows and the 8 x words that vector meets
    once (_row_sums loads x per weight row: twice the weight registers). The 4 words' dp4a chain into
    one sum per row and vector, so for g128 s2 multiplies once per 4 words, and the zero term (the
    group sum X_g, or the vector's x byte sums computed once for all rows) once per vector.

    V is the first axis, rows the second, on purpose: Triton's coalescing gives the lanes to the
    first of equally non-contiguous axes, and every tensor here (weights, x, s2, z, X_g) then gets
    the same lanes-along-V layout, with no shared-memory layout change in the loop.
    A step's weights are requested before the previous step's math (before the PDL wait for the first).
    Returns the (BLOCK_N, 1) sums, x's scale and (chn with HAS_ROWSUM) its row sum, each (1,)."""
    V: tl.constexpr = GROUPS_PER_STEP * 4
    offs_v = tl.arange(0, V)
    offs_e = tl.arange(0, 4)
    first_of_group = (offs_v % 4 == 0)[:, None]
    acc = tl.zeros((V, BLOCK_N), dtype=tl.int32)
    x_sum = tl.zeros((V, 1), dtype=tl.int32)  # chn without a rowsum

    w = _weights_x_shared(qw_ptr, g_start, g_end, rn, offs_v, offs_e, stride_qn)
    _overlap_entry(PDL)
    # x's scale (and chn row sum) for the epilogue, requested now rather than after the loop.
    x_scale = tl.load(sx_ptr + tl.arange(0, 1))
    x_rowsum = tl.load(rowsum_ptr + tl.arange(0, 1)) if not G128 and HAS_ROWSUM else x_scale
    for g0 in range(g_start, g_end, GROUPS_PER_STEP):
        v = g0 * 4 + offs_v  # global 4-word vector index: group v // 4, words (v % 4) * 4 .. + 3
        in_slice = (v < g_end * 4)[:, None]
        x_words = x_ptr + ((v // 4) * 32 + (v % 4) * 4)[:, None, None] + offs_e[None, None, :]
        x_lo = tl.load(x_words, mask=in_slice[:, :, None], other=0)  # (V, 1, 4)
        x_hi = tl.load(x_words + 16, mask=in_slice[:, :, None], other=0)
        w0, w1, w2, w3 = _split4(w)
        l0, l1, l2, l3 = _split4(tl.broadcast_to(x_lo, w.shape))
        h0, h1, h2, h3 = _split4(tl.broadcast_to(x_hi, w.shape))
        dot = _dot_chn(w0, l0, h0, tl.zeros_like(acc) if G128 else acc, FAST)
        dot = _dot_chn(w3, l3, h3, _dot_chn(w2, l2, h2, _dot_chn(w1, l1, h1, dot, FAST), FAST), FAST)
        if G128:
            g_ptrs = rn[None, :] * stride_sn + (v // 4)[:, None]
            s2 = tl.load(s2_ptr + g_ptrs, mask=in_slice, other=0).to(tl.int32)
            z = tl.load(zero_ptr + g_ptrs, mask=in_slice, other=0).to(tl.int32)
            if HAS_ROWSUM:
                # X_g once per group: on the group's first vector only.
                x_zero = tl.load(rowsum_ptr + (v // 4)[:, None], mask=in_slice & first_of_group, other=0)
            else:
                x_zero = _vector_byte_sums(x_lo, x_hi, FAST)
            acc += s2 * (dot - z * x_zero)
        else:
            acc = dot
            if not HAS_ROWSUM:
                x_sum += _vector_byte_sums(x_lo, x_hi, FAST)
        w = _weights_x_shared(qw_ptr, g0 + GROUPS_PER_STEP, g_end, rn, offs_v, offs_e, stride_qn)
    total = tl.sum(acc, axis=0)
    if not G128 and not HAS_ROWSUM:
        zero = tl.load(zero_ptr + rn).to(tl.int32)
        total -= zero * tl.sum(x_sum)
    return total[:, None], x_scale, x_rowsum


@triton.jit
def _vector_byte_sums(x_lo, x_hi, FAST: tl.constexpr):
    """(V, 1, 4) x words -> (V, 1): the sum of the 32 x bytes each 4-word weight vector meets."""
    return tl.sum(_byte_sum(x_hi, _byte_sum(x_lo, tl.zeros_like(x_lo), FAST), FAST), axis=2)


@triton.jit
def _weights_x_shared(qw_ptr, g0, g_end, rn, offs_v, offs_e, stride_qn):
    """The (V, BLOCK_N, 4) weight words of groups g0 .. (those < g_end; the rest read as 0)."""
    v = g0 * 4 + offs_v
    words = (v * 4)[:, None, None] + offs_e[None, None, :]
    return tl.load(qw_ptr + rn[None, :, None] * stride_qn + words, mask=(v < g_end * 4)[:, None, None], other=0)


@triton.jit
def _many_row_sums(
    x_ptr, qw_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, offs_m, mask_m, offs_c, stride_qn, stride_xm, stride_sn,
    G128: tl.constexpr, HAS_ROWSUM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, FAST: tl.constexpr,
):
    """M > 1: (BLOCK_N, BLOCK_M) int32 sums over groups g_start .. g_end - 1, each weight word
    broadcast over the BLOCK_M rows of x (chn: less zero * sum x when there is no rowsum)."""
    C: tl.constexpr = 16 * GROUPS_PER_STEP  # weight words per row per step
    acc = tl.zeros((BLOCK_N, BLOCK_M, C), dtype=tl.int32)
    x_sum = tl.zeros((BLOCK_M, C), dtype=tl.int32)
    # Software pipelining by one step: the next step's loads are issued before this step's math,
    # so a program keeps two steps of weight bytes in flight (past the slice they are masked off).
    w, x_lo, x_hi, s2, z = _load_step(
        qw_ptr, x_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, offs_m, mask_m, offs_c,
        stride_qn, stride_xm, stride_sn, G128, GROUPS_PER_STEP)
    for g0 in range(g_start, g_end, GROUPS_PER_STEP):
        w_n, x_lo_n, x_hi_n, s2_n, z_n = _load_step(
            qw_ptr, x_ptr, s2_ptr, zero_ptr, g0 + GROUPS_PER_STEP, g_end, rn, offs_m, mask_m, offs_c,
            stride_qn, stride_xm, stride_sn, G128, GROUPS_PER_STEP)
        w3 = tl.broadcast_to(w[:, None, :], (BLOCK_N, BLOCK_M, C))
        lo3 = tl.broadcast_to(x_lo[None, :, :], (BLOCK_N, BLOCK_M, C))
        hi3 = tl.broadcast_to(x_hi[None, :, :], (BLOCK_N, BLOCK_M, C))
        if G128:
            # Per word: s2 * (x . q - z * sum x), exactly the word's sum of x * (q - z) * s2.
            x_word_sum = _byte_sum(x_hi, _byte_sum(x_lo, tl.zeros((BLOCK_M, C), dtype=tl.int32), FAST), FAST)
            dot = _dot_chn(w3, lo3, hi3, tl.zeros((BLOCK_N, BLOCK_M, C), dtype=tl.int32), FAST)
            acc += s2[:, None, :] * dot - (s2 * z)[:, None, :] * x_word_sum[None, :, :]
        else:
            acc = _dot_chn(w3, lo3, hi3, acc, FAST)
            if not HAS_ROWSUM:
                x_sum = _byte_sum(x_hi, _byte_sum(x_lo, x_sum, FAST), FAST)
        w, x_lo, x_hi, s2, z = w_n, x_lo_n, x_hi_n, s2_n, z_n
    total = tl.sum(acc, axis=2)  # (BN, BM)
    if not G128 and not HAS_ROWSUM:
        zero = tl.load(zero_ptr + rn).to(tl.int32)
        total -= zero[:, None] * tl.sum(x_sum, axis=1)[None, :]
    return total


@triton.jit(do_not_specialize=["M", "GROUPS_PER_SPLIT"])
def _w4a8_gemv_kernel(
    # pointers: x and qweight as int32 words
    x_ptr, sx_ptr, rowsum_ptr, qw_ptr, s2_ptr, zero_ptr, col_scale_ptr, out_ptr, ws_ptr,
    # sizes
    M, N, K, GROUPS_PER_SPLIT,
    # strides (x and qweight rows in words; s2 / zero rows in elements)
    stride_xm, stride_qn, stride_sn, stride_om, stride_on,
    # meta
    G128: tl.constexpr, HAS_ROWSUM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, USE_SPLIT: tl.constexpr, FAST: tl.constexpr,
    PDL: tl.constexpr = 0, X_SHARED: tl.constexpr = False,
):
    """(BLOCK_N, BLOCK_M) int32 sums over this program's K slice; BLOCK_M >= M (one program covers M).

    rowsum_ptr / HAS_ROWSUM: chn, x8's row sums (M,); g128 (read by the one-token loops only), its
    128-group sums (M, K / 128), contiguous.

    X_SHARED: one program per (token, row block, K slice), the grid's three axes in that order;
    BLOCK_M is 1 and M may be larger. Otherwise the grid is (row blocks, K slices).

    A step reads GROUPS_PER_STEP groups of 128: 16 weight words per group and row, the matching
    x words for the low (first 64) and high (last 64) halves of each group.
    """
    offs_m = tl.arange(0, BLOCK_M)
    if X_SHARED:
        # One program per (token, row block, K slice), tokens on the fastest grid axis: the M
        # programs of a row block are neighbours in the launch order, so its weights come from DRAM
        # once and from L2 for the other tokens. (Decoding the token from a flat index instead,
        # pid % M and pid // M, cost the g128 loop 30 registers: 64 -> 94 at n8m1g16.)
        token = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m += token
        x_ptr += token * stride_xm
        sx_ptr += token
        rowsum_ptr += token * (K // 128 if G128 else 1)  # g128: contiguous (M, K / 128) group sums
    else:
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn = offs_n % N  # rows past N read a valid row, dropped at the store
    mask_m = offs_m < M
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = min(g_start + GROUPS_PER_SPLIT, K // 128)
    if not USE_SPLIT:
        # The epilogue's weight-side operands first, before the PDL wait: their latency hides under
        # the loop instead of adding a dependent round trip after it (a program is one or two steps).
        col_scale = tl.load(col_scale_ptr + rn).to(tl.float32)
        if not G128:
            zero = tl.load(zero_ptr + rn).to(tl.float32)  # (BN,) integers in [0, 15]
    if X_SHARED:
        total, x_scale, x_rowsum = _row_sums_x_shared(
            qw_ptr, x_ptr, rowsum_ptr, sx_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, stride_qn, stride_sn,
            G128, HAS_ROWSUM, BLOCK_N, GROUPS_PER_STEP, FAST, PDL)
    else:
        if BLOCK_M == 1:
            total = _row_sums(qw_ptr, x_ptr, rowsum_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, stride_qn, stride_sn,
                              G128, HAS_ROWSUM, BLOCK_N, GROUPS_PER_STEP, FAST, PDL)
        else:
            _overlap_entry(PDL)
            total = _many_row_sums(
                x_ptr, qw_ptr, s2_ptr, zero_ptr, g_start, g_end, rn, offs_m, mask_m, tl.arange(0, 16 * GROUPS_PER_STEP),
                stride_qn, stride_xm, stride_sn, G128, HAS_ROWSUM, BLOCK_N, BLOCK_M, GROUPS_PER_STEP, FAST)
        x_scale = tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)
        x_rowsum = tl.load(rowsum_ptr + offs_m, mask=mask_m, other=0) if not G128 and HAS_ROWSUM else x_scale
    _overlap_release(PDL)
    out_mask = (offs_n < N)[:, None] & mask_m[None, :]
    if USE_SPLIT:
        ws_ptrs = ws_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_ptrs, total, mask=out_mask)
    else:
        y = total.to(tl.float32)
        if not G128 and HAS_ROWSUM:
            y = y - x_rowsum.to(tl.float32)[None, :] * zero[:, None]
        y = y * x_scale[None, :] * col_scale[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on, y.to(tl.float16), mask=out_mask)

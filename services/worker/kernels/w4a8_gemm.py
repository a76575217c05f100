"""W4A8 GEMM: 4-bit weights, per-token int8 activations, int8 tensor cores, fp16 out.

Inputs (layouts from shared/formats/weights.py):
    x8      (M, K) int8, row-major        per-token symmetric codes (shared/quant/activations.py)
    sx      (M,) fp32                     per-token scale
    qweight (N, K // 2) uint8             in each chunk of 128 along K, byte j = value j (low nibble)
                                          | value j + 64 (high nibble)
    w4g128p: s2 (N, G) uint8, zero (N, G) uint8, s1 (N,) fp16      G = K // 128
             y = (sum_k x8 * (q - zero) * s2) * sx * s1             (the int8 weight (q - z) * s2 is exact)
    w4chn:   scale (N,) fp16, zero (N,) fp16 (an integer)
             y = (sum_k x8 * q - zero * rowsum(x8)) * sx * scale
Both match shared/model/linear.py bit for bit: int32 sums, then the same fp32 epilogue.

Orientation: the kernels compute the transposed tile, acc (BLOCK_N, BLOCK_M) = W_tile @ X_tile^T.
The dequantized weight is then the *first* MMA operand, which Hopper's wgmma reads from registers,
so it never makes a round trip through shared memory; and a tiny M (decode) sits in the MMA's N
dimension (as small as 16) instead of wasting a 64-row M dimension.

One K step is one 128-wide group: a (BLOCK_N, 64) tile of packed bytes is split into its low
nibbles (k .. k+63) and high nibbles (k+64 .. k+127), and each half meets its own slice of x.

Split-K (small M: the output tiles alone do not fill the GPU): each K slice writes its int32
partial tile to a workspace (SPLIT, M, N) with plain stores, and a second small kernel sums the
slices and runs the epilogue: exact and deterministic. (One-launch versions, the last slice of a
tile reducing, were slower or wrong on the H200: kernels README, "Split-K in one launch".)
The workspace is per device and shared by every call: launches must be ordered (one stream).

Dequantization in registers uses Triton's integer ops in the interpreter; on the GPU the nibble
split is two masks and a shift on 4 bytes at a time (inline PTX), and the `swar` variants also do
(q - z) * s2 on 4 bytes per 32-bit register: one multiply (q * s2 <= 240 cannot carry into the
next byte) and a carry-free bytewise subtraction of z * s2.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker.kernels.gemm_common import _dequant_swar, _num_sms, _rows_aligned, _split_nibbles, _tile_ids
from services.worker.kernels.host_int import cdiv, next_power_of_2, require
from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release, launch_kwargs
from services.worker.kernels.w4a8_gemv import _w4a8_gemv_kernel
from services.worker.kernels.w4a8_int8_path import int8_path_gemm
from shared.formats.weights import GROUP_SIZE, W4ChannelWeight, W4G128ProgressiveWeight

log = logging.getLogger(__name__)

# |x8 * w8| <= 127 * 128 per product: the int32 sum cannot overflow below this K.
MAX_K = (2**31 - 1) // (127 * 128) // GROUP_SIZE * GROUP_SIZE
KINDS = (W4G128ProgressiveWeight.kind, W4ChannelWeight.kind)


@triton.jit
def _store_partial(acc, ws_ptr, offs_n, offs_m, M, N):
    """This K slice's int32 tile -> ws[pid_k] of a (SPLIT, M, N) workspace."""
    ws_ptrs = ws_ptr + tl.program_id(1) * M * N + offs_m[None, :] * N + offs_n[:, None]  # (BLOCK_N, BLOCK_M)
    tl.store(ws_ptrs, acc, mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


# M changes with every batch (as in the GEMMs below); N, a layer's width, keeps ws's rows aligned without it.
@triton.jit(do_not_specialize=["M"])
def _split_k_epilogue_kernel(
    # pointers
    ws_ptr, sx_ptr, col_scale_ptr, zero_ptr, rowsum_ptr, out_ptr,
    # sizes
    M, N, SPLIT_K,
    # strides
    stride_om, stride_on,
    # meta
    HAS_ROWSUM: tl.constexpr, BLOCK: tl.constexpr, SLICES: tl.constexpr, PDL: tl.constexpr = 0,
):
    """out[m, n] = (sum_s ws[s, m, n] [- rowsum[m] * zero[n]]) * sx[m] * col_scale[n], flat over M * N.

    Every slice is read as one (SLICES, BLOCK) tile (SLICES a power of two >= SPLIT_K), all loads in
    flight together. Summing them in a loop instead (Triton 3.6 unrolls it by 4 with two slices' loads in
    flight at a time) was as fast or slower: on an H100, 73 of 288 (tile, shape, M) points more than 2%
    slower, 5 faster (session 30, bench/results/h100/split_epilogue_ab.json)."""
    _overlap_entry(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    ks = tl.arange(0, SLICES)[:, None]
    parts = tl.load(ws_ptr + ks * M * N + offs[None, :], mask=(ks < SPLIT_K) & mask[None, :], other=0)
    y = tl.sum(parts, axis=0).to(tl.float32)
    if HAS_ROWSUM:
        y = y - tl.load(rowsum_ptr + m, mask=mask, other=0).to(tl.float32) * tl.load(zero_ptr + n, mask=mask).to(tl.float32)
    y = y * tl.load(sx_ptr + m, mask=mask) * tl.load(col_scale_ptr + n, mask=mask).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n * stride_on, y.to(tl.float16), mask=mask)


# M and the split sizes change with every batch; specializing on them (== 1, % 16) would only recompile.
@triton.jit(do_not_specialize=["M", "GROUPS_PER_SPLIT"])
def _w4a8_g128_kernel(
    # pointers
    x_ptr, sx_ptr, qw_ptr, s2_ptr, zero_ptr, s1_ptr, out_ptr, ws_ptr, group_sums_ptr,
    # sizes
    M, N, K, GROUPS_PER_SPLIT,
    # strides
    stride_xm, stride_xk, stride_qn, stride_qk, stride_sn, stride_sg, stride_om, stride_on, stride_gm,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    ZERO_AFTER_DOT: tl.constexpr, DOT_FP16: tl.constexpr, SWAR: tl.constexpr, USE_SPLIT: tl.constexpr,
    FAST_UNPACK: tl.constexpr, HAS_GROUP_SUMS: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    """acc (BLOCK_N, BLOCK_M) int32 = sum over groups of ((q - z) * s2) @ x8^T; fp16 out.

    HAS_GROUP_SUMS (ZERO_AFTER_DOT only): each group's sum of x8 per row comes from the act-quant
    kernel's group sums (M, K / 128) instead of a reduction of the x tiles in every step."""
    pid_n, pid_m = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    HALF_K: tl.constexpr = 64
    OP_DTYPE: tl.constexpr = tl.float16 if DOT_FP16 else tl.int8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF_K)
    # Rows past M or N are read from a valid row and dropped at the store: no masks in the loop.
    rn = offs_n % N
    rm = offs_m % M
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = min(g_start + GROUPS_PER_SPLIT, K // (2 * HALF_K))
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (g_start * HALF_K + offs_h)[None, :] * stride_qk  # (BN, 64) u8
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (g_start * 2 * HALF_K + offs_h)[:, None] * stride_xk  # (64, BM) i8
    s2_ptrs = s2_ptr + rn * stride_sn + g_start * stride_sg  # (BN,) u8
    z_ptrs = zero_ptr + rn * stride_sn + g_start * stride_sg
    _overlap_entry(PDL)
    if DOT_FP16:
        acc_f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x-major: mma.sync, both operands in registers
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    s2 = tl.load(s2_ptrs)
    z = tl.load(z_ptrs)
    if HAS_GROUP_SUMS:
        gs_ptrs = group_sums_ptr + rm * stride_gm + g_start  # (BM,) i32
        x_group_sum = tl.load(gs_ptrs)
    for g in range(g_start, g_end):
        packed = tl.load(w_ptrs)
        x_lo = tl.load(x_ptrs)
        x_hi = tl.load(x_ptrs + HALF_K * stride_xk)
        # The next group's byte-wide scales, one step ahead: too narrow for the async-copy pipeline,
        # and a strided load each, so their latency would otherwise stall every step.
        has_next = tl.full((BLOCK_N,), g + 1, tl.int32) < g_end
        s2_next = tl.load(s2_ptrs + stride_sg, mask=has_next, other=0)
        z_next = tl.load(z_ptrs + stride_sg, mask=has_next, other=0)
        if HAS_GROUP_SUMS:
            x_group_sum_next = tl.load(gs_ptrs + 1, mask=tl.full((BLOCK_M,), g + 1, tl.int32) < g_end, other=0)
        q_lo, q_hi = _split_nibbles(packed, OP_DTYPE, FAST_UNPACK)
        if DOT_FP16:
            # (q - z) * s2 is an integer in [-240, 240]: exact in fp16, and so are the x8 codes.
            zf = z.to(tl.float16)[:, None]
            sf = s2.to(tl.float16)[:, None]
            acc_f = tl.dot(tl.trans(x_lo.to(tl.float16)), tl.trans((q_lo - zf) * sf), acc_f)
            acc_f = tl.dot(tl.trans(x_hi.to(tl.float16)), tl.trans((q_hi - zf) * sf), acc_f)
        elif ZERO_AFTER_DOT:
            # MMA on the raw codes; sum x * (q - z) * s2 = s2 * (sum x * q - z * sum x), per group.
            part = tl.dot(q_lo, x_lo, out_dtype=tl.int32)
            part = tl.dot(q_hi, x_hi, part, out_dtype=tl.int32)
            if HAS_GROUP_SUMS:
                x_sum = x_group_sum
            else:
                x_sum = tl.sum(x_lo.to(tl.int32), axis=0) + tl.sum(x_hi.to(tl.int32), axis=0)  # (BM,)
            acc += (part - z.to(tl.int32)[:, None] * x_sum[None, :]) * s2.to(tl.int32)[:, None]
        elif SWAR and FAST_UNPACK:
            zs = (z.to(tl.int32) * s2.to(tl.int32)).to(tl.uint8)
            w_lo, w_hi = _dequant_swar(packed, s2[:, None], zs[:, None])
            acc = tl.dot(w_lo, x_lo, acc, out_dtype=tl.int32)
            acc = tl.dot(w_hi, x_hi, acc, out_dtype=tl.int32)
        else:
            # int8 arithmetic wraps, but the true (q - z) * s2 lies in [-128, 127] (protective range).
            zi = z.to(tl.int8)[:, None]
            si = s2.to(tl.int8)[:, None]
            acc = tl.dot((q_lo - zi) * si, x_lo, acc, out_dtype=tl.int32)
            acc = tl.dot((q_hi - zi) * si, x_hi, acc, out_dtype=tl.int32)
        w_ptrs += HALF_K * stride_qk
        x_ptrs += 2 * HALF_K * stride_xk
        s2_ptrs += stride_sg
        z_ptrs += stride_sg
        s2 = s2_next
        z = z_next
        if HAS_GROUP_SUMS:
            gs_ptrs += 1
            x_group_sum = x_group_sum_next
    _overlap_release(PDL)
    if DOT_FP16:
        acc = tl.trans(acc_f).to(tl.int32)  # integer-valued: fp32 holds these sums exactly below 2^24
    if USE_SPLIT:
        _store_partial(acc, ws_ptr, offs_n, offs_m, M, N)
    else:
        sx = tl.load(sx_ptr + rm)  # (BM,) fp32
        s1 = tl.load(s1_ptr + rn).to(tl.float32)  # (BN,)
        y = acc.to(tl.float32) * sx[None, :] * s1[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
        tl.store(out_ptrs, y.to(tl.float16), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@triton.jit(do_not_specialize=["M", "GROUPS_PER_SPLIT"])
def _w4a8_channel_kernel(
    # pointers
    x_ptr, sx_ptr, rowsum_ptr, qw_ptr, scale_ptr, zero_ptr, out_ptr, ws_ptr,
    # sizes
    M, N, K, GROUPS_PER_SPLIT,
    # strides
    stride_xm, stride_xk, stride_qn, stride_qk, stride_om, stride_on,
    # meta
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_ROWSUM: tl.constexpr, DOT_FP16: tl.constexpr, USE_SPLIT: tl.constexpr, FAST_UNPACK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """acc (BLOCK_N, BLOCK_M) int32 = q @ x8^T on the raw codes; the zero term in the epilogue.

    Without a rowsum input, each K slice sums its own x8 columns and subtracts zero * that
    partial sum in int32 (the correction is linear in K, so slices stay independent).
    """
    pid_n, pid_m = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    HALF_K: tl.constexpr = 64
    OP_DTYPE: tl.constexpr = tl.float16 if DOT_FP16 else tl.int8
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, HALF_K)
    rn = offs_n % N
    rm = offs_m % M
    g_start = pid_k * GROUPS_PER_SPLIT
    g_end = min(g_start + GROUPS_PER_SPLIT, K // (2 * HALF_K))
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + (g_start * HALF_K + offs_h)[None, :] * stride_qk
    x_ptrs = x_ptr + rm[None, :] * stride_xm + (g_start * 2 * HALF_K + offs_h)[:, None] * stride_xk
    _overlap_entry(PDL)
    if DOT_FP16:
        acc_f = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # x-major: mma.sync, both operands in registers
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for _ in range(g_start, g_end):
        packed = tl.load(w_ptrs)
        x_lo = tl.load(x_ptrs)
        x_hi = tl.load(x_ptrs + HALF_K * stride_xk)
        q_lo, q_hi = _split_nibbles(packed, OP_DTYPE, FAST_UNPACK)
        if DOT_FP16:
            acc_f = tl.dot(tl.trans(x_lo.to(tl.float16)), tl.trans(q_lo), acc_f)
            acc_f = tl.dot(tl.trans(x_hi.to(tl.float16)), tl.trans(q_hi), acc_f)
        else:
            acc = tl.dot(q_lo, x_lo, acc, out_dtype=tl.int32)
            acc = tl.dot(q_hi, x_hi, acc, out_dtype=tl.int32)
        if not HAS_ROWSUM:
            x_sum += tl.sum(x_lo.to(tl.int32), axis=0) + tl.sum(x_hi.to(tl.int32), axis=0)
        w_ptrs += HALF_K * stride_qk
        x_ptrs += 2 * HALF_K * stride_xk
    _overlap_release(PDL)
    if DOT_FP16:
        acc = tl.trans(acc_f).to(tl.int32)
    zero = tl.load(zero_ptr + rn).to(tl.float32)  # (BN,) integers in [0, 15]
    if not HAS_ROWSUM:
        acc -= zero.to(tl.int32)[:, None] * x_sum[None, :]
    if USE_SPLIT:
        _store_partial(acc, ws_ptr, offs_n, offs_m, M, N)
    else:
        sx = tl.load(sx_ptr + rm)
        scale = tl.load(scale_ptr + rn).to(tl.float32)
        y = acc.to(tl.float32)
        if HAS_ROWSUM:
            y = y - tl.load(rowsum_ptr + rm).to(tl.float32)[None, :] * zero[:, None]
        y = y * sx[None, :] * scale[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None] * stride_on
        tl.store(out_ptrs, y.to(tl.float16), mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


@dataclass(frozen=True, slots=True)
class GemmVariant:
    """One compiled configuration of a W4A8 kernel. Tiles are named (BLOCK_N, BLOCK_M)."""

    name: str
    kind: str  # the weight kind it reads: "w4g128p" or "w4chn"
    block_n: int
    block_m: int
    num_warps: int
    num_stages: int
    split_k: bool = False  # may split K over programs when the output tiles do not fill the GPU
    zero_after_dot: bool = False  # g128: MMA on raw codes, zero and s2 applied per group after it
    dot_fp16: bool = False  # dequantize to fp16 and use fp16 MMAs (meant for tiny M)
    swar: bool = False  # g128 on the GPU: (q - z) * s2 on 4 bytes per register (see the module doc)
    gemv: bool = False  # no tensor cores: dp4a on CUDA cores, one program covers M <= block_m (w4a8_gemv.py)
    groups_per_step: int = 1  # gemv: 128-groups of K read per loop step
    x_shared: bool = False  # gemv: x words held once per thread for all its rows, one program per token (_row_sums_x_shared)
    int8_path: bool = False  # g128, large M: dequantize to int8 in the workspace, then an int8 GEMM (w4a8_int8_path.py)
    max_m: int | None = None
    group_m: int = 8
    # Register cap per thread (ptxas .maxnreg). An 8-warp n128m128 tile compiles to 128-149 registers
    # (Triton version, rowsum or not); at 128, two CTAs always fit an SM, so one's waits on its
    # wgmma (each dot completes before the next dequantization) can be covered by the other's
    # work. Measured on the H200 (session 10): 1-5% at some M, about the run-to-run spread.
    maxnreg: int | None = None

    @property
    def takes_group_sums(self) -> bool:
        """Whether this variant reads x8's 128-group sums when given them (w4a8_gemm's group_sums):
        the g128 dp4a loops of one token per program (M = 1, and the x-shared ones at any M) and the
        MMA-on-raw-codes (.zp) kernel."""
        return self.kind == G128 and ((self.gemv and self.block_m == 1) or self.zero_after_dot)

    @property
    def launch_options(self) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages,
                **({"maxnreg": self.maxnreg} if self.maxnreg else {})}

    def can_implement(self, M: int, N: int, K: int, fmt: str) -> tuple[bool, str]:
        if fmt != self.kind:
            return False, f"{self.name} reads {self.kind} weights, not {fmt}"
        if M < 1 or N < 1:
            return False, f"empty problem: M={M}, N={N}"
        if K < GROUP_SIZE or K % GROUP_SIZE:
            return False, f"K={K} is not a positive multiple of {GROUP_SIZE} (the group and pack chunk)"
        if K > MAX_K:
            return False, f"K={K} exceeds {MAX_K}: the int32 accumulator could overflow"
        if max(M * N, M * K) >= 2**31:
            return False, f"M={M} x N={N} / K={K}: element offsets past 2^31 overflow the kernels' int32 indexing"
        if self.max_m is not None and M > self.max_m:
            return False, f"M={M} exceeds {self.max_m}, the largest M of {self.name}"
        return True, "ok"


def _v(name: str, kind: str, bn: int, bm: int, warps: int, stages: int, **kw) -> GemmVariant:
    return GemmVariant(name, kind, bn, bm, warps, stages, **kw)


def _gemv(kind: str, bn: int, bm: int, groups_per_step: int, x_shared: bool = False) -> GemmVariant:
    prefix = "g128" if kind == G128 else "chn"
    name = f"{prefix}.gemv.n{bn}m{bm}g{groups_per_step}" + (".xs" if x_shared else "")
    # The x-shared loop puts every lane along K: 4 vectors of 4 words per group, 32 lanes per warp.
    warps = groups_per_step // 8 if x_shared else 4
    require(not x_shared or (bm == 1 and groups_per_step * 4 == 32 * warps), name)
    # No automatic split-K: on the H200 its second (epilogue) launch cost more than the extra
    # programs gained at every Llama-2-7B shape; an explicit split_k still works. The x-shared loop
    # runs one program per token, up to X_SHARED_MAX_M tokens (each row block's weights then come
    # from DRAM once and from L2 for the other tokens).
    return GemmVariant(name, kind, bn, bm, warps, 3, gemv=True, groups_per_step=groups_per_step,
                       max_m=X_SHARED_MAX_M if x_shared else bm, x_shared=x_shared)


X_SHARED_MAX_M = 4  # the H200 tune run (session 25): never fastest at M = 8, at 4 only on 4096x4096


G128, CHN = KINDS
VARIANTS: tuple[GemmVariant, ...] = (
    _v("g128.n64m16.sk", G128, 64, 16, 4, 4, split_k=True),
    _v("g128.n64m16.sk.swar", G128, 64, 16, 4, 4, split_k=True, swar=True),
    _v("g128.n64m16.sk.zp", G128, 64, 16, 4, 4, split_k=True, zero_after_dot=True),
    _v("g128.n128m16.sk.zp", G128, 128, 16, 4, 4, split_k=True, zero_after_dot=True),
    _v("g128.n64m16.sk.f16", G128, 64, 16, 4, 4, split_k=True, dot_fp16=True, max_m=16),
    _v("g128.n128m64.sk", G128, 128, 64, 8, 3, split_k=True),
    _v("g128.n128m64.sk.swar", G128, 128, 64, 8, 3, split_k=True, swar=True),
    _v("g128.n128m64.sk.zp", G128, 128, 64, 8, 3, split_k=True, zero_after_dot=True),
    _v("g128.n128m128", G128, 128, 128, 8, 3),
    _v("g128.n128m128.swar", G128, 128, 128, 8, 3, swar=True),
    _v("g128.n128m128.zp", G128, 128, 128, 8, 3, zero_after_dot=True),
    _v("g128.n128m256", G128, 128, 256, 8, 3),
    _v("g128.n128m256.swar", G128, 128, 256, 8, 3, swar=True),
    _v("g128.n256m128", G128, 256, 128, 8, 3),
    # Mid M (128..512) on narrow layers: the (N / 128) x (M / 128) tiles fill one wave of SMs
    # badly; narrower tiles or split K give the scheduler more programs.
    _v("g128.n64m128.swar", G128, 64, 128, 4, 4, swar=True),
    _v("g128.n128m128.sk.swar", G128, 128, 128, 8, 3, split_k=True, swar=True),
    _v("g128.n64m256.swar", G128, 64, 256, 8, 3, swar=True),
    # Two 8-warp CTAs per SM (see GemmVariant.maxnreg).
    _v("g128.n128m128.swar.r128", G128, 128, 128, 8, 3, swar=True, maxnreg=128),
    _v("g128.n128m128.sk.swar.r128", G128, 128, 128, 8, 3, split_k=True, swar=True, maxnreg=128),
    _v("chn.n64m16.sk", CHN, 64, 16, 4, 4, split_k=True),
    _v("chn.n128m16.sk", CHN, 128, 16, 4, 4, split_k=True),
    _v("chn.n64m16.sk.f16", CHN, 64, 16, 4, 4, split_k=True, dot_fp16=True, max_m=16),
    _v("chn.n128m64.sk", CHN, 128, 64, 8, 3, split_k=True),
    _v("chn.n128m128", CHN, 128, 128, 8, 3),
    _v("chn.n128m256", CHN, 128, 256, 8, 3),
    _v("chn.n256m128", CHN, 256, 128, 8, 3),
    _v("chn.n64m128", CHN, 64, 128, 4, 4),
    _v("chn.n128m128.sk", CHN, 128, 128, 8, 3, split_k=True),
    _v("chn.n64m256", CHN, 64, 256, 8, 3),
    _v("chn.n128m128.r128", CHN, 128, 128, 8, 3, maxnreg=128),
    _v("chn.n128m128.sk.r128", CHN, 128, 128, 8, 3, split_k=True, maxnreg=128),
    _v("chn.n128m128.s4.r128", CHN, 128, 128, 8, 4, maxnreg=128),
    # 64 x 64 tiles (4 warps; session 23): at M = 24..128 the 128-wide 8-warp tiles left SMs idle
    # (g128 M = 64: 22.0 vs 25.0 us at 12288x4096, 33.5 vs 39.2 at 22016x4096). A deeper cp.async
    # pipeline won only chn 12288x4096 M = 24..32 (15.8 vs 16.6 us). Tried and dropped there: 1-2 warp
    # n16m16 / n32m16 / n32m64 tiles on mma.sync (slower at every M: 10.5-74 vs 9.5-20.8 us at M = 16).
    _v("chn.n64m64.sk", CHN, 64, 64, 4, 4, split_k=True),
    _v("chn.n64m16.sk.s8", CHN, 64, 16, 4, 8, split_k=True),
    _v("g128.n64m64.sk.swar", G128, 64, 64, 4, 4, split_k=True, swar=True),
    # Decode at batch 1..4: a weight stream with dp4a, no MMA tile padding M to 16.
    *(_gemv(kind, bn, bm, gps) for kind in KINDS
      for bn, bm, gps in ((4, 1, 16), (8, 1, 16), (16, 1, 8), (32, 1, 4), (8, 4, 4))),
    # Batch 1 with x held once per thread for all its rows (session 25): 1, 2 or 4 warps.
    *(_gemv(kind, bn, 1, gps, x_shared=True) for kind in KINDS
      for bn, gps in ((4, 32), (16, 32), (4, 16), (8, 16), (16, 16), (16, 8))),
    # Prefill-sized M (sessions 30-31): the g128 weight dequantized to int8 in one pass, then a
    # persistent TMA int8 GEMM (w4a8_int8_path.py). On an H100 the fastest g128 kernel from M = 1024-2048
    # (1.5-1.7x cuBLAS fp16 at 4096, the tiles 1.08-1.27x). 4 warps lost (session 30); with TMA, 4 stages
    # won for n256m128 (1-5%, one shape 1.4% slower) and were mixed for n128m256, GROUP_M 4 lost, 16 tied
    # (bench/results/h100/int8_tiles_tma.json).
    _v("g128.i8.n128m128", G128, 128, 128, 8, 4, int8_path=True),
    _v("g128.i8.n256m128", G128, 256, 128, 8, 4, int8_path=True),
    _v("g128.i8.n128m256", G128, 128, 256, 8, 3, int8_path=True),
    # One-warpgroup tiles (n64m128, n128m64, 4 warps, 4 stages) for M = 128..512, where 128 x 128
    # tiles leave SMs idle, won 1 of 12 points on an H100, by 3% (session 32, int8_small_tiles.json):
    # there the pass alone costs most of a tile kernel's time (4096x11008 M = 128: 25.6 of 29.4 us). Not kept.
)
VARIANTS_BY_NAME = {v.name: v for v in VARIANTS}


def variants_for(fmt: str) -> list[GemmVariant]:
    return [v for v in VARIANTS if v.kind == fmt]


def get_variant(name: str) -> GemmVariant:
    try:
        return VARIANTS_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown W4A8 GEMM variant {name!r}; known: {sorted(VARIANTS_BY_NAME)}") from None


def default_variant_name(M: int, fmt: str) -> str:
    """A safe choice by M alone: the H200 bench's fastest variants that need no SWAR layout assumption."""
    if fmt == G128:
        return "g128.n128m16.sk.zp" if M <= 64 else "g128.n128m256"
    return ("chn.n64m16.sk" if M <= 16 else "chn.n128m16.sk") if M <= 64 else "chn.n128m128"


_logged_defaults: set[tuple[str, str]] = set()


def canonical_device(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current>`: torch.device("cuda") != torch.device("cuda:0"), and a tensor's
    .device always carries the index, so anything keyed by device must key by this form."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _Workspace:
    """Per-device int32 scratch for split-K partial tiles, grown on demand (never shrunk).

    Growing frees the old buffer: a CUDA graph captured over it would then write freed memory, so
    graph owners reserve the largest size first (`get`) and compare `pointer` before replaying.
    """

    def __init__(self):
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device | str, elements: int) -> torch.Tensor:
        key = canonical_device(device)
        ws = self._by_device.get(key)
        if ws is None or ws.numel() < elements:
            ws = torch.empty(elements, dtype=torch.int32, device=key)
            self._by_device[key] = ws
        return ws

    def pointer(self, device: torch.device | str) -> int | None:
        """The current buffer's address on this device (None before the first split-K launch)."""
        ws = self._by_device.get(canonical_device(device))
        return None if ws is None else ws.data_ptr()


WORKSPACE = _Workspace()


def workspace_elements(variant: GemmVariant, M: int, N: int, K: int, device: torch.device) -> int:
    """The int32 elements of WORKSPACE a launch of this variant uses (1 where it uses none)."""
    if variant.int8_path:
        return cdiv(N * K, 4)  # the int8 weight copy
    return _split_workspace_elements(_k_slices(variant, M, N, K, None, device)[1], M, N)


def _split_workspace_elements(split: int, M: int, N: int) -> int:
    """Split-K partials: SPLIT * M * N int32, or a one-element dummy when not split."""
    return split * M * N if split > 1 else 1


def _k_slices(variant: GemmVariant, M: int, N: int, K: int, split_k: int | None, device: torch.device) -> tuple[int, int]:
    """-> groups per K slice, slices (split_k, or the variant's rule where None; no empty slices)."""
    return k_slices(K, split_factor(variant, M, N, K, device) if split_k is None else split_k)


def k_slices(K: int, split: int) -> tuple[int, int]:
    """-> 128-groups per K slice, slices: K cut at most `split` ways in whole groups, no empty slice."""
    groups = K // GROUP_SIZE
    require(1 <= split <= groups, f"split_k={split} must be in [1, {groups}]")
    per_split = cdiv(groups, split)
    return per_split, cdiv(groups, per_split)


def scratch_int8(device: torch.device, elements: int) -> torch.Tensor:
    """WORKSPACE as int8, at least `elements` of them (the int8 path's weight copy)."""
    return WORKSPACE.get(device, cdiv(elements, 4)).view(torch.int8)


def split_factor(variant: GemmVariant, M: int, N: int, K: int, device: torch.device) -> int:
    """How many K slices, each >= 4 groups: about 3 programs per SM in all (H200 sweep).

    Under a 128-register cap (two 8-warp CTAs per SM) the slices instead fill at most one wave of
    two programs per SM: at 4096x11008 M=256, 64 tiles of 128 x 128 split 4 ways (256 programs)
    took 30.6 us on the H200, split 6 ways (the 3-per-SM rule) 38.5 us, and at 12288x4096 the
    rule's split 2 of 192 tiles was slower than none (gemm_tail_split_experiment.json).
    """
    if not variant.split_k:
        return 1
    tiles = cdiv(M, variant.block_m) * cdiv(N, variant.block_n)
    groups = K // GROUP_SIZE
    if variant.maxnreg is not None and variant.maxnreg <= 128:
        want = 2 * _num_sms(device) // tiles
    else:
        want = (3 * _num_sms(device) + tiles // 2) // tiles
    return max(1, min(want, groups // 4))


def _check_common(x8: torch.Tensor, sx: torch.Tensor, N: int, K: int, out: torch.Tensor | None) -> torch.Tensor:
    require(x8.dim() == 2 and x8.dtype == torch.int8, f"x8: expected (M, K) int8, got {tuple(x8.shape)} {x8.dtype}")
    M = x8.shape[0]
    require(x8.shape[1] == K, f"x8 has K={x8.shape[1]}, the weight has K={K}")
    require(x8.stride(1) == 1, f"x8 must be contiguous along K, strides {x8.stride()}")
    require(sx.dtype == torch.float32 and sx.numel() == M, f"sx: expected ({M},) fp32, got {tuple(sx.shape)} {sx.dtype}")
    sx = sx.reshape(M)
    require(sx.stride(0) == 1 or M == 1, "sx must be contiguous")
    if out is not None:
        require(out.shape == (M, N) and out.dtype == torch.float16, f"out: expected ({M}, {N}) fp16")
        require(out.stride(1) == 1, f"out must be contiguous along N, strides {out.stride()}")
        require(out.device == x8.device, f"out is on {out.device}, x8 on {x8.device}")
    return sx


def _launch_grid(variant: GemmVariant, M: int, N: int, K: int, split_k: int | None, device: torch.device):
    """-> grid, groups per slice, slices, workspace (SPLIT * M * N int32, or a dummy when not split)."""
    per_split, split = _k_slices(variant, M, N, K, split_k, device)
    ws = WORKSPACE.get(device, _split_workspace_elements(split, M, N))
    if variant.x_shared:
        row_blocks = cdiv(N, variant.block_n)
        require(row_blocks <= 65535, f"N={N}: {row_blocks} row blocks exceed the grid's second axis (65535)")
        return (M, row_blocks, split), per_split, split, ws
    tiles = cdiv(M, variant.block_m) * cdiv(N, variant.block_n)
    return (tiles, split), per_split, split, ws


def _split_k_epilogue(ws, split, sx, col_scale, zero, rowsum, out) -> None:
    M, N = out.shape
    slices = next_power_of_2(split)
    block = max(128, min(1024, 8192 // slices))  # at most 64 int32 partials a thread at 4 warps (split <= 64)
    _split_k_epilogue_kernel[(cdiv(M * N, block),)](
        ws, sx, col_scale, zero, sx if rowsum is None else rowsum, out,
        M, N, split,
        out.stride(0), out.stride(1),
        HAS_ROWSUM=rowsum is not None, BLOCK=block, SLICES=slices, num_warps=4,
        **launch_kwargs(out.device, M),
    )


def w4a8_g128_gemm(
    x8: torch.Tensor,
    sx: torch.Tensor,
    weight: W4G128ProgressiveWeight,
    variant: GemmVariant,
    *,
    group_sums: torch.Tensor | None = None,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x8 (M, K) int8, sx (M,) fp32, progressive g128 weight (N, K) -> (M, N) fp16; group_sums
    (M, K // 128) int32 or None (read by the .zp variants)."""
    qw, s2, zero, s1 = weight.qweight, weight.s2, weight.zero, weight.s1
    N, K = qw.shape[0], qw.shape[1] * 2
    sx = _check_common(x8, sx, N, K, out)
    M = x8.shape[0]
    ok, reason = variant.can_implement(M, N, K, weight.kind)
    require(ok, reason)
    require(qw.dtype == torch.uint8 and qw.stride(1) == 1, "qweight: (N, K // 2) uint8 contiguous along K")
    require(s2.shape == zero.shape == (N, K // GROUP_SIZE) and s2.stride() == zero.stride(), "s2 / zero: (N, G) alike")
    require(s1.shape == (N,) and s1.dtype == torch.float16 and s1.stride(0) == 1, "s1: (N,) fp16 contiguous")
    require(all(t.device == x8.device for t in (sx, qw, s2, zero, s1) + ((group_sums,) if group_sums is not None else ())),
            "all tensors on one device")
    if out is None:
        out = torch.empty((M, N), dtype=torch.float16, device=x8.device)
    group_sums = _group_sums_read_by(variant, group_sums, M, K)
    if variant.int8_path:
        require(split_k in (None, 1), f"{variant.name} does not split K")
        return int8_path_gemm(x8, sx, weight, variant, scratch_int8(x8.device, N * K), out)
    grid, per_split, split, ws = _launch_grid(variant, M, N, K, split_k, x8.device)
    _w4a8_g128_kernel[grid](
        x8, sx, qw, s2, zero, s1, out, ws, sx if group_sums is None else group_sums,
        M, N, K, per_split,
        x8.stride(0), x8.stride(1), qw.stride(0), qw.stride(1), s2.stride(0), s2.stride(1),
        out.stride(0), out.stride(1), 0 if group_sums is None else group_sums.stride(0),
        BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, GROUP_M=variant.group_m,
        ZERO_AFTER_DOT=variant.zero_after_dot, DOT_FP16=variant.dot_fp16, SWAR=variant.swar,
        USE_SPLIT=split > 1, FAST_UNPACK=x8.is_cuda, HAS_GROUP_SUMS=group_sums is not None,
        **variant.launch_options, **launch_kwargs(x8.device, M),
    )
    if split > 1:
        _split_k_epilogue(ws, split, sx, s1, s1, None, out)
    return out


def w4a8_channel_gemm(
    x8: torch.Tensor,
    sx: torch.Tensor,
    weight: W4ChannelWeight,
    variant: GemmVariant,
    rowsum: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x8 (M, K) int8, sx (M,) fp32, rowsum (M,) int32 or None, per-channel weight -> (M, N) fp16.

    rowsum = x8.sum(-1) as the activation-quant kernels return it; without it the GEMM sums x8 itself.
    """
    qw, scale, zero = weight.qweight, weight.scale, weight.zero
    N, K = qw.shape[0], qw.shape[1] * 2
    sx = _check_common(x8, sx, N, K, out)
    M = x8.shape[0]
    ok, reason = variant.can_implement(M, N, K, weight.kind)
    require(ok, reason)
    require(qw.dtype == torch.uint8 and qw.stride(1) == 1, "qweight: (N, K // 2) uint8 contiguous along K")
    require(scale.shape == zero.shape == (N,) and scale.dtype == zero.dtype == torch.float16, "scale / zero: (N,) fp16")
    require(scale.stride(0) == zero.stride(0) == 1, "scale / zero must be contiguous")
    if rowsum is not None:
        require(rowsum.dtype == torch.int32 and rowsum.numel() == M, f"rowsum: expected ({M},) int32")
        rowsum = rowsum.reshape(M)
        require(rowsum.stride(0) == 1 or M == 1, "rowsum must be contiguous")
    require(all(t.device == x8.device for t in (sx, qw, scale, zero) + ((rowsum,) if rowsum is not None else ())),
            "all tensors on one device")
    if out is None:
        out = torch.empty((M, N), dtype=torch.float16, device=x8.device)
    grid, per_split, split, ws = _launch_grid(variant, M, N, K, split_k, x8.device)
    _w4a8_channel_kernel[grid](
        x8, sx, sx if rowsum is None else rowsum, qw, scale, zero, out, ws,
        M, N, K, per_split,
        x8.stride(0), x8.stride(1), qw.stride(0), qw.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, GROUP_M=variant.group_m,
        HAS_ROWSUM=rowsum is not None, DOT_FP16=variant.dot_fp16, USE_SPLIT=split > 1,
        FAST_UNPACK=x8.is_cuda, **variant.launch_options,
        **launch_kwargs(x8.device, M),
    )
    if split > 1:
        _split_k_epilogue(ws, split, sx, scale, zero, rowsum, out)
    return out


def _as_words(t: torch.Tensor, name: str) -> torch.Tensor:
    """A (rows, bytes) int8/uint8 tensor, contiguous along bytes, as (rows, bytes // 4) int32 words."""
    t = _rows_aligned(t, 4)
    require(t.stride(1) == 1 and t.shape[1] % 4 == 0, f"{name}: rows must be contiguous whole words")
    return t.view(torch.int32)


def _group_sums_read_by(variant: GemmVariant, group_sums: torch.Tensor | None, M: int, K: int) -> torch.Tensor | None:
    """The group sums checked (whatever the variant), then the ones the variant reads: None where it
    does not take them (takes_group_sums) or none were given."""
    if group_sums is None:
        return None
    groups = K // GROUP_SIZE
    require(group_sums.dtype == torch.int32 and group_sums.shape == (M, groups),
            f"group_sums: expected ({M}, {groups}) int32, got {tuple(group_sums.shape)} {group_sums.dtype}")
    require(group_sums.stride(-1) == 1, "group_sums rows must be contiguous")
    return group_sums if variant.takes_group_sums else None


def w4a8_word_gemm(
    x8: torch.Tensor,
    sx: torch.Tensor,
    weight: W4G128ProgressiveWeight | W4ChannelWeight,
    variant: GemmVariant,
    rowsum: torch.Tensor | None = None,
    *,
    group_sums: torch.Tensor | None = None,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dp4a GEMV (w4a8_gemv.py), which reads x8 and the weights as 32-bit words, for the M its
    variant takes. Same contract as w4a8_gemm; g128's and chn's scales go in the same argument slots."""
    qw = weight.qweight
    N, K = qw.shape[0], qw.shape[1] * 2
    sx = _check_common(x8, sx, N, K, out)
    M = x8.shape[0]
    ok, reason = variant.can_implement(M, N, K, weight.kind)
    require(ok and variant.gemv, reason)
    g128 = isinstance(weight, W4G128ProgressiveWeight)
    if g128:
        s2, zero, col_scale = weight.s2, weight.zero, weight.s1
        require(s2.shape == zero.shape == (N, K // GROUP_SIZE) and s2.stride() == zero.stride() and s2.stride(1) == 1,
                "s2 / zero: (N, G) alike, contiguous along G")
        # The g128 x-sums input is the group sums, read by the M = 1 GEMV loops only (the x-shared
        # one steps through them by whole rows of K / 128).
        x_sums = _group_sums_read_by(variant, group_sums, M, K)
        if x_sums is not None and M > 1:
            x_sums = x_sums.contiguous()
    else:
        s2 = zero = weight.zero  # chn has no s2: its slot takes the zero, unread
        col_scale = weight.scale
        x_sums = rowsum
        if rowsum is not None:
            require(rowsum.dtype == torch.int32 and rowsum.numel() == M, f"rowsum: expected ({M},) int32")
            x_sums = rowsum.reshape(M)
            require(x_sums.stride(0) == 1 or M == 1, "rowsum must be contiguous")  # read at base + m
    require(col_scale.stride(0) == 1 and (g128 or zero.stride(0) == 1), "column scale / zero must be contiguous")
    require(all(t.device == x8.device for t in (sx, qw, s2, zero, col_scale) + ((x_sums,) if x_sums is not None else ())),
            "all tensors on one device")
    if out is None:
        out = torch.empty((M, N), dtype=torch.float16, device=x8.device)
    x32, qw32 = _as_words(x8, "x8"), _as_words(qw, "qweight")
    grid, per_split, split, ws = _launch_grid(variant, M, N, K, split_k, x8.device)
    _w4a8_gemv_kernel[grid](
        x32, sx, sx if x_sums is None else x_sums, qw32, s2, zero, col_scale, out, ws,
        M, N, K, per_split,
        x32.stride(0), qw32.stride(0), s2.stride(0), out.stride(0), out.stride(1),
        G128=g128, HAS_ROWSUM=x_sums is not None, USE_SPLIT=split > 1, FAST=x8.is_cuda,
        BLOCK_N=variant.block_n, BLOCK_M=variant.block_m, GROUPS_PER_STEP=variant.groups_per_step,
        X_SHARED=variant.x_shared,
        **variant.launch_options, **launch_kwargs(x8.device, M),
    )
    if split > 1:  # g128's zero term is already in the partials: no rowsum, its zero slot unread
        _split_k_epilogue(ws, split, sx, col_scale, col_scale if g128 else zero, None if g128 else x_sums, out)
    return out


def w4a8_gemm(
    x8: torch.Tensor,
    sx: torch.Tensor,
    weight: W4G128ProgressiveWeight | W4ChannelWeight,
    rowsum: torch.Tensor | None = None,
    variant: str | None = None,
    *,
    group_sums: torch.Tensor | None = None,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y (M, N) fp16 = the W4A8 linear of shared/model/linear.py on pre-quantized activations.

    variant: a name from VARIANTS (a policy table's choice); None picks a safe default by M.
    rowsum (M,) int32 = x8.sum(-1) serves per-channel weights; group_sums (M, K // 128) int32, the
    sums of x8 over each 128-group, serve the g128 variants that take them (takes_group_sums). Both
    as the activation-quant kernels return them; a kernel reads only the one it uses, and each is
    optional (the kernels then sum x8 themselves).
    """
    if not isinstance(weight, (W4G128ProgressiveWeight, W4ChannelWeight)):
        raise TypeError(f"w4a8_gemm takes {KINDS} weights, got {type(weight).__name__}")
    M, K = x8.shape[0], x8.shape[-1]
    N = weight.qweight.shape[0]
    if variant is None:
        variant = default_variant_name(M, weight.kind)
        if (weight.kind, variant) not in _logged_defaults:
            _logged_defaults.add((weight.kind, variant))
            log.info("w4a8_gemm: no variant given for %s M=%d, using %s", weight.kind, M, variant)
    chosen = get_variant(variant)
    ok, reason = chosen.can_implement(M, N, K, weight.kind)
    if not ok:
        others = "; ".join(f"{v.name}: {v.can_implement(M, N, K, weight.kind)[1]}" for v in VARIANTS)
        raise ValueError(f"variant {variant} cannot run M={M} N={N} K={K} {weight.kind}: {reason}. All: {others}")
    if chosen.gemv:
        return w4a8_word_gemm(x8, sx, weight, chosen, rowsum, group_sums=group_sums, split_k=split_k, out=out)
    if isinstance(weight, W4G128ProgressiveWeight):
        return w4a8_g128_gemm(x8, sx, weight, chosen, group_sums=group_sums, split_k=split_k, out=out)
    return w4a8_channel_gemm(x8, sx, weight, chosen, rowsum, split_k=split_k, out=out)

"""Large-M g128 W4A8 through an int8 copy of the weight: dequantize once per call, then an int8 GEMM.

At prefill-sized M the g128 tile kernels (w4a8_gemm.py) run the int8 tensor cores at ~0.8 POP/s
against the per-channel kernel's 1.2: every K step spends issue slots on (q - z) * s2, and Triton
3.6 waits on each wgmma whose first operand comes from registers before the next dequantization
(kernels README, "Where the time goes"). Here the dequantization is its own memory-bound pass:

  1. _g128_to_int8_kernel writes W8 = (q - z) * s2, (N, K) int8, into the caller's scratch buffer
     (1.5 bytes of traffic a weight: 28 us for 12288 x 4096 on an H100, 0.87 of a copy of the same
     bytes; 16 rows x 8 groups a program beat 64 x 1 by 4-10%: bench/results/h100/int8_pass_ab.json).
  2. _int8_gemm_kernel: acc (BLOCK_M, BLOCK_N) = x8 @ W8^T with both operands K-major in shared memory
     (the layout int8 wgmma takes), loaded by TMA, one persistent program per SM; fp32 epilogue * sx * s1.
     On an H100 it is 2-12% faster than the same GEMM on pointer loads, one program a tile
     (bench/results/h100/int8_tma_ab.json; session 30's kernel, since replaced), and with the pass
     within 5% of cuBLAS fp8 (torch._scaled_mm) at M = 4096 less the pass.

W8 is exact (the protective range keeps (q - z) * s2 in [-128, 127]), so the output equals the
reference linear bit for bit. The price is the pass (8-10% of the time at M = 4096 on an H100; far too much at
decode sizes: the policy table decides where it wins) and N * K bytes of scratch (90 MB at 22016 x 4096).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from services.worker.kernels.gemm_common import _dequant_swar, _num_sms, _rows_aligned, _split_nibbles, _tile_at
from services.worker.kernels.host_int import cdiv, require
from services.worker.kernels.launch_overlap import PDL_MAX_ROWS, _overlap_entry, _overlap_release, launch_kwargs
from shared.formats.weights import GROUP_SIZE, W4G128ProgressiveWeight

# Rows and 128-groups of W8 one dequantization program writes: 8 KB read, 16 KB written.
DEQUANT_BLOCK_N = 16
DEQUANT_GROUPS = 8
# K per pipeline stage of the int8 GEMM: one group; K is always a multiple of it.
INT8_BLOCK_K = GROUP_SIZE


@triton.jit
def _g128_to_int8_kernel(
    qw_ptr, s2_ptr, zero_ptr, w8_ptr,
    N, K,
    stride_qn, stride_sn, stride_sg,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, FAST_UNPACK: tl.constexpr, PDL: tl.constexpr = 0,
):
    """w8[n, g*128 + j] = (q - z) * s2 for BLOCK_N rows n and GROUPS 128-groups g from program_id(1) * GROUPS
    (each row's GROUPS * 64 packed bytes in one contiguous run)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs_h = tl.arange(0, 64)[None, None, :]
    groups = K // 128
    rn = offs_n % N  # rows past N and groups past K read a valid byte and are not stored
    rg = offs_g % groups
    packed = tl.load(qw_ptr + rn[:, None, None] * stride_qn + rg[None, :, None] * 64 + offs_h)  # (BN, GROUPS, 64)
    s2 = tl.load(s2_ptr + rn[:, None] * stride_sn + rg[None, :] * stride_sg)[:, :, None]  # (BN, GROUPS, 1)
    z = tl.load(zero_ptr + rn[:, None] * stride_sn + rg[None, :] * stride_sg)[:, :, None]
    # The scratch buffer may still be read by the previous kernel (another layer's GEMM): wait before writing.
    _overlap_entry(PDL)
    if FAST_UNPACK:
        zs = (z.to(tl.int32) * s2.to(tl.int32)).to(tl.uint8)
        w_lo, w_hi = _dequant_swar(packed, s2, zs)
    else:
        # int8 arithmetic wraps, but the true (q - z) * s2 lies in [-128, 127] (protective range).
        q_lo, q_hi = _split_nibbles(packed, tl.int8, False)
        zi = z.to(tl.int8)
        si = s2.to(tl.int8)
        w_lo = (q_lo - zi) * si
        w_hi = (q_hi - zi) * si
    w_ptrs = w8_ptr + offs_n[:, None, None] * K + offs_g[None, :, None] * 128 + offs_h
    mask = (offs_n < N)[:, None, None] & (offs_g < groups)[None, :, None]
    tl.store(w_ptrs, w_lo, mask=mask)
    tl.store(w_ptrs + 64, w_hi, mask=mask)
    _overlap_release(PDL)


@triton.jit(do_not_specialize=["M"])
def _int8_gemm_kernel(
    x_desc, w_desc, sx_ptr, s1_ptr, out_ptr,
    M, N, K,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """out (M, N) fp16 = (x8 @ w8^T) * sx[m] * s1[n]; x8 (M, K) and w8 (N, K) int8 behind TMA descriptors
    (rows past M or N come back as zeros: the descriptors' padding). Persistent: program i takes
    tiles i, i + programs, ... in _tile_ids' order, the loop over tiles and K flattened into one
    pipeline, so the next tile's loads start under this one's epilogue."""
    _overlap_entry(PDL)
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_n, pid_m = _tile_at(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc, out_dtype=tl.int32)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        sx = tl.load(sx_ptr + offs_m, mask=offs_m < M, other=0.0)  # (BM,) fp32
        s1 = tl.load(s1_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)  # (BN,)
        y = acc.to(tl.float32) * sx[:, None] * s1[None, :]  # the other kernels' order: bit-equal results
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, y.to(tl.float16), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    _overlap_release(PDL)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t (rows, K) int8 as TMA takes it: 16-byte aligned base and row stride, contiguous along K."""
    return _rows_aligned(t if t.stride(1) == 1 else t.contiguous(), 16, one_row_stride=True)


def _num_programs(variant, M: int, N: int, device: torch.device) -> int:
    """One program per SM (or per tile, if fewer); 4 on the CPU interpreter, so each walks several."""
    return min(cdiv(M, variant.block_m) * cdiv(N, variant.block_n), _num_sms(device))


def dequantize_g128_to_int8(weight: W4G128ProgressiveWeight, w8: torch.Tensor, overlap: dict | None = None,
                            block_n: int = DEQUANT_BLOCK_N, groups: int = DEQUANT_GROUPS) -> torch.Tensor:
    """The weight's int8 values (N, K) written into w8 (at least N * K int8 elements); returns the (N, K) view.
    overlap: the launch's PDL keywords (launch_overlap.launch_kwargs), by default off; block_n, groups:
    the rows and 128-groups of one program (bench/int8_pass_ab.py times the choices)."""
    qw, s2, zero = weight.qweight, weight.s2, weight.zero
    N, K = qw.shape[0], qw.shape[1] * 2
    require(w8.dtype == torch.int8 and w8.numel() >= N * K and w8.is_contiguous(), "w8: a contiguous int8 buffer of N * K")
    w8 = w8.view(-1)[: N * K].view(N, K)
    _g128_to_int8_kernel[(cdiv(N, block_n), cdiv(K // GROUP_SIZE, groups))](
        qw, s2, zero, w8, N, K, qw.stride(0), s2.stride(0), s2.stride(1),
        BLOCK_N=block_n, GROUPS=groups, FAST_UNPACK=qw.is_cuda, num_warps=4, **(overlap or {}),
    )
    return w8


def int8_path_gemm(x8, sx, weight: W4G128ProgressiveWeight, variant, scratch: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Checked operands (w4a8_gemm.w4a8_g128_gemm's contract) -> out = the g128 linear, through W8 in scratch."""
    M, K = x8.shape
    N = out.shape[1]
    # PDL at every M for this pair, past the rule's PDL_MAX_ROWS (its "late" trigger): the GEMM's programs
    # start under the pass's tail. H100, M = 512..4096: 0-4% faster, never slower beyond noise
    # (session 32, bench/results/h100/int8_pdl_ab.json).
    overlap = launch_kwargs(x8.device, min(M, PDL_MAX_ROWS))
    w8 = dequantize_g128_to_int8(weight, scratch, overlap)
    x8 = _tma_ready(x8)
    _int8_gemm_kernel[(_num_programs(variant, M, N, x8.device),)](
        TensorDescriptor.from_tensor(x8, [variant.block_m, INT8_BLOCK_K]),
        TensorDescriptor.from_tensor(w8, [variant.block_n, INT8_BLOCK_K]),
        sx, weight.s1, out, M, N, K, out.stride(0), out.stride(1),
        BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, BLOCK_K=INT8_BLOCK_K, GROUP_M=variant.group_m,
        **variant.launch_options, **overlap,
    )
    return out

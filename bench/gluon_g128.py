"""Experiment: the W4A8 GEMMs (g128 and per-channel) in Gluon, so the wgmma overlaps the next group's unpacking.

Triton 3.6 waits for each wgmma whose A operand comes from registers before the next dequantization
(services/worker/kernels/README.md, "Where the time goes"). Gluon (Triton's lower-level dialect, in
3.6 and later) lets a kernel place that wait itself. Two kernels:
- _g128_kernel: a cp.async ring brings each 128-group's packed bytes and x rows into shared memory two
  groups ahead; each wgmma is issued asynchronously and waited for one group later, after the next
  group's unpacking (OVERLAP), with the unpacked weight in registers or in shared memory (W_SMEM).
- _g128_ws_kernel: warp-specialized, producer warps unpacking into a shared-memory ring while one
  warpgroup issues the wgmma, mbarriers between them (the producer/consumer pipeline the README names).
bench/gluon_probe.py shows their SASS without a GPU.

On a GPU this measures them against the Triton kernel the policy table picks and cuBLAS fp16, on the
Llama-2-7B shapes, every output checked bit for bit against the reference linear:

    python3 bench/gluon_g128.py --out bench/results/<gpu>/gluon_g128.json [--m 16,64,128,256 --kinds w4g128p,w4chn]
    python3 bench/gluon_g128.py --out bench/results/<gpu>/gluon_g128_ws.json --modes ws4,ws8 --stages 4,5

Same arithmetic as services/worker/kernels/w4a8_gemm.py's kernels (see its module doc); tiles are
(BLOCK_N weight rows, BLOCK_M tokens), the weight the wgmma's A operand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import sys
import time
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                               warpgroup_mma_init, warpgroup_mma_wait)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.worker.kernels import gemm_common  # noqa: E402

# The product kernels' unpacking PTX (services/worker/kernels/gemm_common.py), as Gluon constexprs.
_DEQUANT_SWAR_PTX = gl.constexpr(gemm_common._DEQUANT_SWAR_PTX.value)
_SPLIT_NIBBLES_PTX = gl.constexpr(gemm_common._SPLIT_NIBBLES_PTX.value)
# Triton 3.6 spells the CTA barrier thread_barrier; later releases renamed it barrier.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
# ... and cp.async async_copy_global_to_shared, later async_load.
_copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@triton.constexpr_function
def _copy_layout(rows, num_warps):
    """A blocked layout for cp.async copies of a (rows, 64)-byte tile that no two threads repeat:
    16 bytes a thread where the tile has that many, fewer for small tiles (16 x 64 over 4 warps: 8)."""
    per_thread = max(4, min(16, rows * 64 // (32 * num_warps)))
    lanes_k = 64 // per_thread
    return gl.BlockedLayout([1, per_thread], [32 // lanes_k, lanes_k], [num_warps, 1], [1, 0])


@gluon.jit
def _slice_steps(K, GROUPS_PER_SPLIT):
    """This program's K slice: its first 128-group and how many it has."""
    g_start = gl.program_id(1) * GROUPS_PER_SPLIT
    return g_start, gl.minimum(g_start + GROUPS_PER_SPLIT, K // 128) - g_start


@gluon.jit
def _scale_pointers(s2_ptr, zero_ptr, stride_sn, N, g_start, BLOCK_N: gl.constexpr, rows: gl.constexpr):
    """g128: the pointers of the slice's first group's s2 and zero bytes for this tile's rows, in `rows`'s
    row slice (a row past N reads a valid row)."""
    rn = (gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, rows))) % N
    return s2_ptr + rn * stride_sn + g_start, zero_ptr + rn * stride_sn + g_start


@gluon.jit
def _copy_group(w_ring, x_lo_ring, x_hi_ring, slot, w_ptrs, x_ptrs, g):
    """cp.async of group g's packed weight bytes and its x rows' two 64-byte halves into ring slot `slot`."""
    HALF: gl.constexpr = 64
    _copy_to_shared(w_ring.index(slot), w_ptrs + g * HALF)
    _copy_to_shared(x_lo_ring.index(slot), x_ptrs + g * 2 * HALF)
    _copy_to_shared(x_hi_ring.index(slot), x_ptrs + g * 2 * HALF + HALF)


@gluon.jit
def _group_scales(s2_ptrs, z_ptrs, i, CHN: gl.constexpr):
    """g128: group i's s2 and zero bytes of the tile's rows. CHN: the pointers themselves, as
    placeholders _unpack ignores (a None here does not compile under Triton 3.6)."""
    if CHN:
        s2 = s2_ptrs
        z = z_ptrs
    else:
        s2 = gl.load(s2_ptrs + i)
        z = gl.load(z_ptrs + i)
    return s2, z


@gluon.jit
def _unpack(packed, s2, z, CHN: gl.constexpr):
    """Packed bytes -> the int8 wgmma operands of a group's low and high halves: the raw codes (CHN), or
    g128's (q - z) * s2 by SWAR (s2 / z: the rows' bytes, ignored for CHN)."""
    if CHN:
        w_lo, w_hi = gl.inline_asm_elementwise(asm=_SPLIT_NIBBLES_PTX, constraints="=r,=r,r", args=[packed],
                                               dtype=(gl.int8, gl.int8), is_pure=True, pack=4)
    else:
        zs = (z.to(gl.int32) * s2.to(gl.int32)).to(gl.uint8)
        w_lo, w_hi = gl.inline_asm_elementwise(
            asm=_DEQUANT_SWAR_PTX, constraints="=r,=r,r,r,r", args=[packed, s2[:, None], zs[:, None]],
            dtype=(gl.int8, gl.int8), is_pure=True, pack=4)
    return w_lo, w_hi


@gluon.jit
def _slice_pointers(x_ptr, qw_ptr, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, w_rows: gl.constexpr, x_rows: gl.constexpr):
    """This program's K slice (first 128-group, group count) and the pointers of that group's packed
    weight bytes (BLOCK_N, 64) and x rows (BLOCK_M, 64) in the copy layouts. Rows past N or M read a
    valid row and are dropped at the store: no masks in the loops."""
    g_start, steps = _slice_steps(K, GROUPS_PER_SPLIT)
    rn = (gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, w_rows))) % N
    rm = (gl.program_id(2) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_rows))) % M
    w_k = g_start * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, w_rows))
    x_k = g_start * 128 + gl.arange(0, 64, layout=gl.SliceLayout(0, x_rows))
    w_ptrs = qw_ptr + rn[:, None] * stride_qn + w_k[None, :]
    return g_start, steps, w_ptrs, x_ptr + rm[:, None] * stride_xm + x_k[None, :]


@gluon.jit
def _g128_kernel(x_ptr, sx_ptr, qw_ptr, s2_ptr, zero_ptr, s1_ptr, out_ptr, ws_ptr, rowsum_ptr,
                 M, N, K, GROUPS_PER_SPLIT,
                 stride_xm, stride_qn, stride_sn, stride_om,
                 BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, OVERLAP: gl.constexpr, USE_SPLIT: gl.constexpr,
                 W_SMEM: gl.constexpr, CHN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """acc (BLOCK_N, BLOCK_M) int32 = sum over 128-groups of W8 @ x8^T; fp16 out (or int32 split-K partials).

    Each group's packed weight bytes and x rows are copied to shared memory STAGES - 1 groups ahead
    (cp.async ring). A step: unpack the group's weight into registers (the wgmma A operand) while the
    previous group's wgmma may still run (OVERLAP), wait for that wgmma, refill the slot it was reading,
    issue this group's wgmma. CHN: the per-channel format instead (s1_ptr / zero_ptr its fp16 scale /
    zero, s2_ptr unused): MMA on the raw codes, rowsum * zero subtracted in the epilogue."""
    HALF: gl.constexpr = 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    w_rows: gl.constexpr = _copy_layout(BLOCK_N, num_warps)
    x_rows: gl.constexpr = _copy_layout(BLOCK_M, num_warps)
    w_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HALF],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.uint8))
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.int8)
    x_lo_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, HALF], x_layout)
    x_hi_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, HALF], x_layout)
    if W_SMEM:  # the unpacked weight goes through shared memory too: no register operand in flight
        w_smem = gl.allocate_shared_memory(gl.int8, [4, BLOCK_N, HALF],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.int8))

    g_start, steps, w_ptrs, x_ptrs = _slice_pointers(x_ptr, qw_ptr, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn,
                                                     BLOCK_N, BLOCK_M, w_rows, x_rows)
    s2_ptrs, z_ptrs = _scale_pointers(s2_ptr, zero_ptr, stride_sn, N, g_start, BLOCK_N, a_layout)

    for s in gl.static_range(STAGES - 1):
        # Past the slice's end: a harmless copy of its last group.
        _copy_group(w_ring, x_lo_ring, x_hi_ring, s, w_ptrs, x_ptrs, gl.minimum(s, steps - 1))
        async_copy.commit_group()

    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.int32, layout=mma)
    if OVERLAP:
        acc = warpgroup_mma_init(acc)  # the loop carries the in-flight accumulator
    for i in range(steps):
        slot = i % STAGES
        s2, z = _group_scales(s2_ptrs, z_ptrs, i, CHN)  # before the wait: its latency hides behind it
        async_copy.wait_group(STAGES - 2)  # this thread's copies of group i have landed
        _cta_barrier()  # ... and every thread's
        w_lo, w_hi = _unpack(w_ring.index(slot).load(a_layout), s2, z, CHN)
        if W_SMEM:
            w_smem.index((i % 2) * 2).store(w_lo)
            w_smem.index((i % 2) * 2 + 1).store(w_hi)
        if OVERLAP:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        fence_async_shared()
        _cta_barrier()  # every warpgroup's previous wgmma is done: its ring slot may be refilled
        _copy_group(w_ring, x_lo_ring, x_hi_ring, (i + STAGES - 1) % STAGES, w_ptrs, x_ptrs,
                    gl.minimum(i + STAGES - 1, steps - 1))
        async_copy.commit_group()
        if W_SMEM:
            acc = warpgroup_mma(w_smem.index((i % 2) * 2), x_lo_ring.index(slot).permute((1, 0)), acc,
                                is_async=OVERLAP)
            acc = warpgroup_mma(w_smem.index((i % 2) * 2 + 1), x_hi_ring.index(slot).permute((1, 0)), acc,
                                is_async=OVERLAP)
        else:
            acc = warpgroup_mma(w_lo, x_lo_ring.index(slot).permute((1, 0)), acc, is_async=OVERLAP)
            acc = warpgroup_mma(w_hi, x_hi_ring.index(slot).permute((1, 0)), acc, is_async=OVERLAP)
    if OVERLAP:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)

    _epilogue(acc, sx_ptr, zero_ptr, s1_ptr, rowsum_ptr, out_ptr, ws_ptr, M, N, stride_om, BLOCK_N, BLOCK_M, USE_SPLIT,
              CHN)


@gluon.jit
def _epilogue(acc, sx_ptr, zero_ptr, s1_ptr, rowsum_ptr, out_ptr, ws_ptr, M, N, stride_om,
              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, CHN: gl.constexpr):
    """The int32 tile -> fp16 out (as the Triton kernels' epilogue, op for op), or to its split-K slice."""
    out_n = gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc.type.layout))
    out_m = gl.program_id(2) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, acc.type.layout))
    mask = (out_n < N)[:, None] & (out_m < M)[None, :]
    if USE_SPLIT:
        gl.store(ws_ptr + gl.program_id(1) * M * N + out_m[None, :] * N + out_n[:, None], acc, mask=mask)
    else:
        sx = gl.load(sx_ptr + out_m % M)
        s1 = gl.load(s1_ptr + out_n % N).to(gl.float32)
        y = acc.to(gl.float32)
        if CHN:
            zero = gl.load(zero_ptr + out_n % N).to(gl.float32)
            y = y - gl.load(rowsum_ptr + out_m % M).to(gl.float32)[None, :] * zero[:, None]
        y = y * sx[None, :] * s1[:, None]
        gl.store(out_ptr + out_m[None, :] * stride_om + out_n[:, None], y.to(gl.float16), mask=mask)


@gluon.jit
def _ws_copy_group(w_raw_ring, x_lo_ring, x_hi_ring, empty, w_ptrs, x_ptrs, j, steps, STAGES: gl.constexpr):
    """Producer: group j's packed weight bytes and x rows copied (cp.async) into ring slot j % STAGES once the
    MMA warps have released it; past the slice's end an empty commit group keeps the count uniform."""
    if j < steps:
        # A fresh mbarrier counts as having completed the phase before 0: the first STAGES waits pass.
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _copy_group(w_raw_ring, x_lo_ring, x_hi_ring, j % STAGES, w_ptrs, x_ptrs, j)
    async_copy.commit_group()


@gluon.jit
def _ws_unpack_partition(x_ptr, qw_ptr, s2_ptr, zero_ptr, w_raw_ring, w_lo_ring, w_hi_ring, x_lo_ring, x_hi_ring,
                         ready, empty, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn, stride_sn,
                         BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CHN: gl.constexpr, STAGES: gl.constexpr,
                         WARPS: gl.constexpr):
    """Producer warps: each group's packed weight and x rows copied (cp.async) into its ring slot STAGES - 2
    groups ahead, then the weight unpacked from there into the slot's int8 operands; ready[slot] tells the
    MMA warps it is filled. Ahead by STAGES - 2, not - 1: the slot a copy waits for is the one the MMA
    warps release after issuing the group being unpacked now's predecessor, so they never wait on each other."""
    AHEAD: gl.constexpr = STAGES - 2
    w_rows: gl.constexpr = _copy_layout(BLOCK_N, WARPS)
    x_rows: gl.constexpr = _copy_layout(BLOCK_M, WARPS)
    g_start, steps, w_ptrs, x_ptrs = _slice_pointers(x_ptr, qw_ptr, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn,
                                                     BLOCK_N, BLOCK_M, w_rows, x_rows)
    s2_ptrs, z_ptrs = _scale_pointers(s2_ptr, zero_ptr, stride_sn, N, g_start, BLOCK_N, w_rows)
    for j in gl.static_range(AHEAD):
        _ws_copy_group(w_raw_ring, x_lo_ring, x_hi_ring, empty, w_ptrs, x_ptrs, j, steps, STAGES)
    for i in range(steps):
        slot = i % STAGES
        s2, z = _group_scales(s2_ptrs, z_ptrs, i, CHN)  # before the wait: its latency hides behind it
        _ws_copy_group(w_raw_ring, x_lo_ring, x_hi_ring, empty, w_ptrs, x_ptrs, i + AHEAD, steps, STAGES)
        async_copy.wait_group(AHEAD)  # this thread's copies of group i have landed
        _cta_barrier()  # ... and every producer thread's
        w_lo, w_hi = _unpack(w_raw_ring.index(slot).load(w_rows), s2, z, CHN)
        w_lo_ring.index(slot).store(w_lo)
        w_hi_ring.index(slot).store(w_hi)
        fence_async_shared()  # the wgmma reads through the async proxy
        _cta_barrier()  # every producer warp has stored before its first thread arrives
        mbarrier.arrive(ready.index(slot), count=1)
    async_copy.wait_group(0)


@gluon.jit
def _ws_mma_partition(w_lo_ring, w_hi_ring, x_lo_ring, x_hi_ring, ready, empty, K, GROUPS_PER_SPLIT,
                      BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Consumer warps (one warpgroup): a group's two wgmma issued as soon as its slot is ready, the
    previous group's waited for right after, and its slot released to the producer."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                   instr_shape=[16, BLOCK_M, 32])
    _, steps = _slice_steps(K, GROUPS_PER_SPLIT)
    acc = gl.zeros((BLOCK_N, BLOCK_M), dtype=gl.int32, layout=mma)
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        acc = warpgroup_mma(w_lo_ring.index(slot), x_lo_ring.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma(w_hi_ring.index(slot), x_hi_ring.index(slot).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))  # the previous group's two are done
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), count=1, pred=i > 0)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc,)),)  # a tuple: Triton 3.6 flattens the results


@gluon.jit
def _g128_ws_kernel(x_ptr, sx_ptr, qw_ptr, s2_ptr, zero_ptr, s1_ptr, out_ptr, ws_ptr, rowsum_ptr,
                    M, N, K, GROUPS_PER_SPLIT,
                    stride_xm, stride_qn, stride_sn, stride_om,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, USE_SPLIT: gl.constexpr, CHN: gl.constexpr,
                    STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                    num_warps: gl.constexpr):
    """_g128_kernel's product, warp-specialized: PRODUCER_WARPS warps load and unpack into a ring of
    STAGES shared-memory slots while num_warps (4: one warpgroup) issue the wgmma, mbarriers between."""
    HALF: gl.constexpr = 64
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.int8)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], gl.int8)
    w_raw_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, HALF],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], gl.uint8))
    w_lo_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HALF], w_layout)
    w_hi_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HALF], w_layout)
    x_lo_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, HALF], x_layout)
    x_hi_ring = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, HALF], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    results = gl.warp_specialize([
        (_ws_mma_partition, (w_lo_ring, w_hi_ring, x_lo_ring, x_hi_ring, ready, empty, K, GROUPS_PER_SPLIT,
                             BLOCK_N, BLOCK_M, STAGES, num_warps)),
        (_ws_unpack_partition, (x_ptr, qw_ptr, s2_ptr, zero_ptr, w_raw_ring, w_lo_ring, w_hi_ring, x_lo_ring,
                                x_hi_ring, ready, empty, M, N, K, GROUPS_PER_SPLIT, stride_xm, stride_qn, stride_sn,
                                BLOCK_N, BLOCK_M, CHN, STAGES, PRODUCER_WARPS)),
    ], [PRODUCER_WARPS], [PRODUCER_REGS])
    _epilogue(results[0], sx_ptr, zero_ptr, s1_ptr, rowsum_ptr, out_ptr, ws_ptr, M, N, stride_om, BLOCK_N, BLOCK_M,
              USE_SPLIT, CHN)


def gluon_gemm(x8, sx, weight, rowsum=None, *, block_n=128, block_m=64, warps=8, overlap=True, w_smem=False, split=1,
               stages=3, producer_warps=0, out=None):
    """x8 (M, K) int8, sx (M,) fp32, a g128 or per-channel weight (rowsum (M,) int32 for the latter) ->
    (M, N) fp16, as w4a8_g128_gemm / w4a8_channel_gemm. producer_warps > 0: the warp-specialized kernel
    (one consumer warpgroup; warps, overlap and w_smem do not apply)."""
    from services.worker.kernels.w4a8_gemm import WORKSPACE, _split_k_epilogue, _split_workspace_elements, k_slices

    chn = weight.kind == "w4chn"
    if chn:
        qw, s2, zero, s1 = weight.qweight, weight.zero, weight.zero, weight.scale
        assert rowsum is not None and rowsum.dtype == torch.int32
    else:
        qw, s2, zero, s1 = weight.qweight, weight.s2, weight.zero, weight.s1
        assert s2.stride(1) == 1 and zero.stride() == s2.stride()
    M, K = x8.shape
    N = qw.shape[0]
    assert qw.stride(1) == 1
    if out is None:
        out = torch.empty((M, N), dtype=torch.float16, device=x8.device)
    per_split, split = k_slices(K, split)
    ws = WORKSPACE.get(x8.device, _split_workspace_elements(split, M, N))  # the product kernels' split-K scratch
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    args = (x8, sx, qw, s2, zero, s1, out, ws, sx if rowsum is None else rowsum, M, N, K, per_split,
            x8.stride(0), qw.stride(0), s2.stride(0), out.stride(0))
    if producer_warps:
        assert stages >= 3, "the warp-specialized ring copies stages - 2 groups ahead"
        _g128_ws_kernel[grid](*args, BLOCK_N=block_n, BLOCK_M=block_m, USE_SPLIT=split > 1, CHN=chn, STAGES=stages,
                              PRODUCER_WARPS=producer_warps, PRODUCER_REGS=128 if producer_warps > 4 else 152,
                              num_warps=4)
    else:
        _g128_kernel[grid](*args, BLOCK_N=block_n, BLOCK_M=block_m, OVERLAP=overlap, USE_SPLIT=split > 1,
                           W_SMEM=w_smem, CHN=chn, STAGES=stages, num_warps=warps)
    if split > 1:
        _split_k_epilogue(ws, split, sx, s1, zero if chn else s1, rowsum if chn else None, out)
    return out


# (BLOCK_N, BLOCK_M, warps) by M.
TILES = {16: (64, 16, 4), 32: (64, 32, 4), 64: (128, 64, 8), 128: (128, 128, 8), 256: (128, 128, 8)}
# Each mode's gluon_gemm keywords. "overlap" is not safe: nothing keeps ptxas from reusing the in-flight wgmma's
# A registers before its wait (Gluon's wait lists only the accumulator), and under Triton 3.6 it does
# (bench/gluon_probe.py lists the writes; on an H100 its outputs were wrong, bench/results/h100/gluon_g128.json): opt-in
# only (--modes overlap).
# "overlap_smem" is the safe form. "ws4" / "ws8": warp-specialized, 4 or 8 producer warps unpacking into a
# shared-memory ring for one wgmma warpgroup; they need --stages >= 3. Right and hang-free on an H100, but slower
# than the Triton variants at 22 of 24 points (bench/results/h100/gluon_g128_ws_cpasync.json), so opt-in only.
MODES = {"sync": {"overlap": False}, "overlap": {"overlap": True}, "overlap_smem": {"overlap": True, "w_smem": True},
         "ws4": {"producer_warps": 4}, "ws8": {"producer_warps": 8}}
SHAPES = ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008))


def checks(runs: list[dict]) -> list[dict]:
    """The issue's W4A8-vs-cuBLAS-fp16 targets at each row's M, from the faster of the policy's Triton variant and
    the correct Gluon modes of this run."""
    from bench.kernels import fp16_target

    out = []
    for row in runs:
        target = fp16_target(row["M"])
        if target is None:
            continue
        best = min([row["triton_policy"]["us"]] + [v for k, v in row.items() if k.endswith("_best_us") and v])
        ratio = row["cublas_fp16_us"] / best
        name = f"{row['kind']} {row['N']}x{row['K']} M={row['M']} best W4A8 (Triton or Gluon) vs cuBLAS fp16"
        out.append({"name": name, "value": ratio, "target": target, "op": ">=", "met": ratio >= target})
    return out


def main():
    from bench.kernels import check_output, time_calls, w4a8_act_set, w4a8_weight_set, warm_gpu, x_sums
    from services.worker.engine.kernel_policy import GemmPolicy
    from services.worker.kernels.w4a8_gemm import w4a8_gemm
    from shared.model.linear import reference_linear

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--m", default="16,64,128,256")
    p.add_argument("--kinds", default="w4g128p,w4chn")
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--stages", default="3", help="ring depths to sweep with the splits (groups in flight + 1)")
    p.add_argument("--modes", default="sync,overlap_smem", help=f"of {','.join(MODES)}")
    p.add_argument("--policy", default=str(REPO / "bench/results/h200/policy.json"))
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    a = p.parse_args()
    dev = torch.device("cuda")
    policy = GemmPolicy.from_manifest(json.loads(Path(a.policy).read_text()))
    result = {"command": " ".join(["python3"] + sys.argv), "machine": {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "host": platform.node()},
        "timing": "bench/kernels.py time_calls (CUDA graph of 4 weight sets, L2 read-flushed)",
        "modes": {name: MODES[name] for name in a.modes.split(",")}, "runs": []}
    t0 = time.time()
    warm_gpu(dev)
    for n, k in SHAPES:
        ws = [w4a8_weight_set(n, k, dev) for _ in range(4)]
        w16 = [w["w"].half() for w in ws]
        for m in (int(v) for v in a.m.split(",")):
            acts = [w4a8_act_set(m, k, dev) for _ in range(4)]
            x16 = [x["x"].half() for x in acts]
            cublas_us = 1e3 * time_calls([lambda x=x, w=w: x @ w.T for x, w in zip(x16, w16)], a.warmup, a.rep)
            for kind in a.kinds.split(","):
                ref = reference_linear(ws[0][kind])(acts[0]["x"])
                row = {"kind": kind, "N": n, "K": k, "M": m, "cublas_fp16_us": cublas_us}
                name = policy.variant(kind, n, k, m)
                row["triton_policy"] = {"variant": name, "us": 1e3 * time_calls(
                    [lambda w=w, x=x: w4a8_gemm(x["x8"], x["sx"], w[kind], **x_sums(x), variant=name)
                     for w, x in zip(ws, acts)], a.warmup, a.rep)}
                bn, bm, warps = TILES[m]
                row["tile"] = f"n{bn}m{bm}w{warps}"
                for mode in a.modes.split(","):
                    best = None
                    for split, stages in itertools.product(*(map(int, v.split(",")) for v in (a.splits, a.stages))):
                        kw = dict(block_n=bn, block_m=bm, warps=warps, split=split, stages=stages, **MODES[mode])
                        try:
                            out = torch.full((m, n), float("nan"), dtype=torch.float16, device=dev)
                            gluon_gemm(acts[0]["x8"], acts[0]["sx"], ws[0][kind], acts[0]["rowsum"], out=out, **kw)
                            torch.cuda.synchronize()
                            entry = {"split": split, "stages": stages, **check_output(out, ref, False)}
                            outs = [torch.empty((m, n), dtype=torch.float16, device=dev) for _ in ws]
                            calls = [lambda w=w, x=x, o=o: gluon_gemm(x["x8"], x["sx"], w[kind], x["rowsum"], out=o,
                                                                      **kw) for w, x, o in zip(ws, acts, outs)]
                            entry["us"] = 1e3 * time_calls(calls, a.warmup, a.rep)
                        except Exception as e:  # a compile or launch failure: recorded, the other modes still run
                            entry = {"split": split, "stages": stages, "correct": False,
                                     "error": f"{type(e).__name__}: {str(e)[-800:]}"}
                            print(entry["error"], flush=True)
                        row.setdefault(f"gluon_{mode}_by_split", []).append(entry)
                        if entry["correct"] and (best is None or entry["us"] < best["us"]):
                            best = entry
                    g = best and best["us"]
                    row[f"gluon_{mode}_best_us"] = g
                    row[f"{mode}_over_triton_policy"] = g and row["triton_policy"]["us"] / g
                    row[f"{mode}_vs_cublas_fp16"] = g and cublas_us / g
                row["triton_policy_vs_cublas_fp16"] = cublas_us / row["triton_policy"]["us"]
                print(json.dumps({k2: v for k2, v in row.items() if not k2.endswith("_by_split")}), flush=True)
                result["runs"].append(row)
                result["checks"] = checks(result["runs"])
                Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    result["seconds"] = time.time() - t0
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

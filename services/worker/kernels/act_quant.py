"""Fused per-token int8 activation quantization: the op before each W4A8 GEMM writes its input.

    rmsnorm_quant(x, weight, eps)  -> before qkv and gate_up  (shared/model/llama.py rms_norm);
                                      with add=y, x += y first (the residual add, in place)
    silu_mul_quant(gate_up)        -> before down             (silu(gate) * up, gate_up = [gate | up])
    quantize(x)                    -> before o_proj

Each returns QuantizedActivations: x8 (M, K) int8 in [-127, 127], scale (M,) fp32, rowsum (M,)
int32 = x8.sum(-1) (the per-channel W4A8 GEMM's zero-point term) and, when asked for
(group_sums=True), (M, ceil(K / 128)) int32 sums of x8 over each 128-group: the zero-point term
of the g128 kernels that take them (w4a8_gemm GemmVariant.takes_group_sums: the M = 1 dp4a GEMV,
one multiply-add per weight row and group instead of x byte sums per weight word; the .zp MMA
kernels, no per-step reduction of the x tiles). Not written otherwise: that cost these kernels
3-6%. Numerics of shared/quant/activations.py:
scale = max(absmax / 127, 1e-8), x8 = round_half_even(x / scale). One program quantizes one row
in fp32. The per-row divisions and the square root are IEEE round-to-nearest, so the scale matches
the reference to fp32 rounding (the reduction order still differs). The per-element ones are not:
an IEEE division is a reciprocal, three FMAs, a range check and a branch to a slow path per value,
which made these kernels several times slower than their memory traffic. The codes are
x * (1 / scale) (an int8 code can move by one where x / scale sits within an ulp of a rounding
tie, as the summation order already allows) and silu's 1 / (1 + e^-x) the approximate reciprocal.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.worker.kernels.host_int import cdiv, next_power_of_2, require
from services.worker.kernels.launch_overlap import _overlap_entry, _overlap_release, launch_kwargs

# Adding and subtracting 1.5 * 2^23 rounds an fp32 |v| < 2^22 to the nearest integer, ties to
# even (torch.round's rule); the interpreter has no libdevice rint.
_ROUND_MAGIC = tl.constexpr(12582912.0)
# Widest row held in registers (fp32 values of one row per program), for every op and row count:
# on the H200 (bench/results/h200/act_quant_paths.json) one pass beat chunks at every M from 1 to
# 8192, silu_mul_quant at F = 11008 by 1.35x at 4096 rows (77.2 against 104.1 us). (Before the
# per-element divisions went, session 9, chunks had won from about 512 rows.)
ONE_PASS_MAX = 16384
CHUNK = 2048  # chunk of the multi-pass path for wider rows
GROUP = 128  # the width of one group sum (shared/formats GROUP_SIZE)


class QuantizedActivations(NamedTuple):
    x8: torch.Tensor  # (M, K) int8
    scale: torch.Tensor  # (M,) fp32
    rowsum: torch.Tensor  # (M,) int32
    group_sums: torch.Tensor | None  # (M, ceil(K / 128)) int32, when asked for


@triton.jit
def _normed(x, w_ptr, offs, mask, inv_rms):
    """rms_norm(x) * w of fp32 values x at offs, given the row's 1 / rms."""
    return x * inv_rms * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _values(in_ptr, w_ptr, offs, mask, F, inv_rms, OP: tl.constexpr):
    """The fp32 values to quantize at offs of one row: x, rms_norm(x) * w, or silu(gate) * up."""
    x = tl.load(in_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if OP == 1:
        x = _normed(x, w_ptr, offs, mask, inv_rms)
    elif OP == 2:
        up = tl.load(in_ptr + F + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.math.fdiv(x, 1.0 + tl.exp(-x)) * up  # the approximate division (div.full.f32)
    return x


@triton.jit
def _quantize_store(v, inv_scale, x8_row, offs, mask):
    """fp32 values v -> int8 codes round(v * inv_scale) stored at x8_row + offs; returns them as
    int32 (0 where masked)."""
    q = v * inv_scale
    q = (q + _ROUND_MAGIC) - _ROUND_MAGIC
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
    tl.store(x8_row + offs, q.to(tl.int8), mask=mask)
    return q  # masked lanes hold round(0 / scale) = 0


@triton.jit
def _store_group_sums(q, group_row, first_group, n_groups, BLOCK: tl.constexpr, GROUP_SUMS: tl.constexpr):
    """The sum of the int32 codes q (BLOCK values from group first_group on); with GROUP_SUMS their
    sums over each 128-group are stored at group_row + first_group ... as well."""
    if not GROUP_SUMS:
        return tl.sum(q, axis=0)
    sums = tl.sum(tl.reshape(q, (BLOCK // 128, 128)), axis=1)
    groups = first_group + tl.arange(0, BLOCK // 128)
    tl.store(group_row + groups, sums, mask=groups < n_groups)
    return tl.sum(sums, axis=0)


@triton.jit
def _add_residual(in_row, add_row, offs, mask):
    """x += y on one chunk of a row, rounded to x's dtype as torch's in-place add; returns the sum in fp32."""
    x = tl.load(in_row + offs, mask=mask, other=0.0).to(tl.float32) + tl.load(add_row + offs, mask=mask, other=0.0).to(tl.float32)
    x = x.to(in_row.dtype.element_ty)
    tl.store(in_row + offs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _act_quant_kernel(
    in_ptr, w_ptr, x8_ptr, scale_ptr, rowsum_ptr, group_sums_ptr, add_ptr,
    K, eps,
    stride_im, stride_qm, stride_am, stride_gm,
    OP: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, ADD: tl.constexpr,
    GROUP_SUMS: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    """One row per program. OP 0: x (M, K); OP 1: rms_norm(x) * w; OP 2: silu(gate) * up of [gate | up] (M, 2K).

    ADD (OP 1): x += y (add_ptr) first, stored back into x, and the norm taken of the stored sum:
    the residual add that follows a GEMM, without a kernel of its own (one read of x and y, one
    write of x, where a separate add reads both, writes x, and the norm reads x again).

    ONE_PASS (the row fits one BLOCK): the row is read once and held in registers, and silu /
    the norm are computed once: a decode step's rows are few, so each program's latency is the
    cost. Otherwise chunks of BLOCK: [sum of squares,] absmax, then quantize, the later passes
    re-reading the row from L2/L1, so a row of any width runs with few warps.
    """
    _overlap_entry(PDL)
    row = tl.program_id(0)
    in_row = in_ptr + row * stride_im
    x8_row = x8_ptr + row * stride_qm
    group_row = group_sums_ptr + row * stride_gm
    n_groups = tl.cdiv(K, 128)
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        inv_rms = 1.0
        if OP == 1:
            if ADD:
                x = _add_residual(in_row, add_ptr + row * stride_am, offs, mask)
            else:
                x = tl.load(in_row + offs, mask=mask, other=0.0).to(tl.float32)
            mean_sq = tl.math.div_rn(tl.sum(x * x, axis=0), K.to(tl.float32))
            inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
            v = _normed(x, w_ptr, offs, mask, inv_rms)  # x already in registers
        else:
            v = _values(in_row, w_ptr, offs, mask, K, inv_rms, OP)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(v), axis=0), 127.0), 1e-8)
        q = _quantize_store(v, tl.math.div_rn(1.0, scale), x8_row, offs, mask)
        rowsum = _store_group_sums(q, group_row, 0, n_groups, BLOCK, GROUP_SUMS)
    else:
        inv_rms = 1.0
        if OP == 1:
            sum_sq = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, K, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                if ADD:  # the later passes re-read the stored sum (each thread its own values)
                    x = _add_residual(in_row, add_ptr + row * stride_am, offs, offs < K)
                else:
                    x = tl.load(in_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                sum_sq += x * x
            mean_sq = tl.math.div_rn(tl.sum(sum_sq, axis=0), K.to(tl.float32))
            inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(_values(in_row, w_ptr, offs, offs < K, K, inv_rms, OP)))
        scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), 1e-8)
        inv_scale = tl.math.div_rn(1.0, scale)
        rowsum = 0
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < K
            q = _quantize_store(_values(in_row, w_ptr, offs, mask, K, inv_rms, OP), inv_scale, x8_row, offs, mask)
            rowsum += _store_group_sums(q, group_row, start // 128, n_groups, BLOCK, GROUP_SUMS)
    _overlap_release(PDL)
    tl.store(scale_ptr + row, scale)
    tl.store(rowsum_ptr + row, rowsum)


def _check_rows(name: str, x: torch.Tensor, k: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (tokens, features) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: expected fp16, bf16 or fp32, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous, got strides {x.stride()}")
    if k < 1:
        raise ValueError(f"{name}: empty rows (length {k})")


def _outputs(m: int, k: int, device: torch.device, group_sums: bool) -> QuantizedActivations:
    return QuantizedActivations(
        x8=torch.empty((m, k), dtype=torch.int8, device=device),
        scale=torch.empty((m,), dtype=torch.float32, device=device),
        rowsum=torch.empty((m,), dtype=torch.int32, device=device),
        group_sums=torch.empty((m, cdiv(k, GROUP)), dtype=torch.int32, device=device) if group_sums else None,
    )


def launch_plan(k: int) -> tuple[bool, int, int]:
    """(one_pass, BLOCK, num_warps) for rows of k values, whatever the op and row count
    (bench/act_quant_paths.py times the alternatives per op and M)."""
    one_pass = k <= ONE_PASS_MAX
    block = max(next_power_of_2(k), GROUP) if one_pass else CHUNK  # whole groups per block
    # one pass: 16 values a thread up to 8 warps (Llama-2-7B's 11008: 16 warps, 32 each); chunks: 8
    num_warps = max(1, min(16, block // 512)) if one_pass else max(1, min(4, block // 256))
    return one_pass, block, num_warps


def _launch(op: int, src: torch.Tensor, weight: torch.Tensor | None, k: int, eps: float = 0.0,
            add: torch.Tensor | None = None, plan: tuple[bool, int, int] | None = None,
            group_sums: bool = False) -> QuantizedActivations:
    m = src.shape[0]
    act = _outputs(m, k, src.device, group_sums)
    sums = act.rowsum if act.group_sums is None else act.group_sums
    one_pass, block, num_warps = plan or launch_plan(k)
    if m:
        _act_quant_kernel[(m,)](
            src, src if weight is None else weight, act.x8, act.scale, act.rowsum, sums,
            src if add is None else add,
            k, eps,
            src.stride(0), act.x8.stride(0), 0 if add is None else add.stride(0), sums.stride(0),
            OP=op, BLOCK=block, ONE_PASS=one_pass, ADD=add is not None, GROUP_SUMS=group_sums, num_warps=num_warps,
            **launch_kwargs(src.device, m),
        )
    return act


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None,
                  group_sums: bool = False):
    """x (M, K) residual stream, weight (K,) -> QuantizedActivations of rms_norm(x) * weight.

    With add (M, K): x += add first, in place (rounded to x's dtype, as `x += add`), and the
    quantized norm is that of the sum.
    """
    _check_rows("rmsnorm_quant x", x, x.shape[-1])
    m, k = x.shape
    require(weight.shape == (k,) and weight.stride(0) == 1, f"weight: expected ({k},) contiguous, got {tuple(weight.shape)}")
    require(weight.device == x.device, f"weight is on {weight.device}, x on {x.device}")
    if add is not None:
        _check_rows("rmsnorm_quant add", add, add.shape[-1])
        if add.shape != x.shape or add.device != x.device:
            raise ValueError(f"rmsnorm_quant add: expected shape {tuple(x.shape)} on {x.device}, "
                             f"got {tuple(add.shape)} on {add.device}")
    return _launch(1, x, weight, k, eps, add, group_sums=group_sums)


def silu_mul_quant(gate_up: torch.Tensor, group_sums: bool = False):
    """gate_up (M, 2F) = [gate | up] -> QuantizedActivations of silu(gate) * up (x8 (M, F))."""
    _check_rows("silu_mul_quant gate_up", gate_up, gate_up.shape[-1] // 2)
    m, two_f = gate_up.shape
    if two_f % 2:
        raise ValueError(f"silu_mul_quant: gate_up width {two_f} is odd; expected [gate | up] of 2F")
    return _launch(2, gate_up, None, two_f // 2, group_sums=group_sums)


def quantize(x: torch.Tensor, group_sums: bool = False):
    """x (M, K) -> QuantizedActivations of x."""
    _check_rows("quantize x", x, x.shape[-1])
    return _launch(0, x, None, x.shape[1], group_sums=group_sums)

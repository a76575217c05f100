"""Fused per-token int8 activation quantization: the op before each W4A8 GEMM writes its input.

    rmsnorm_quant(x, weight, eps)  -> before qkv and gate_up  (shared/model/llama.py rms_norm)
    silu_mul_quant(gate_up)        -> before down             (silu(gate) * up, gate_up = [gate | up])
    quantize(x)                    -> before o_proj

Each returns x8 (M, K) int8 in [-127, 127], scale (M,) fp32 and rowsum (M,) int32 = x8.sum(-1)
(the per-channel W4A8 GEMM's zero-point term), with shared/quant/activations.py numerics:
scale = max(absmax / 127, 1e-8), x8 = round_half_even(x / scale). One program quantizes one row
held whole in registers, in fp32; divisions and the square root are IEEE round-to-nearest so the
scale matches the reference to fp32 rounding (the reduction order still differs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Adding and subtracting 1.5 * 2^23 rounds an fp32 |v| < 2^22 to the nearest integer, ties to
# even (torch.round's rule); the interpreter has no libdevice rint.
_ROUND_MAGIC = tl.constexpr(12582912.0)
MAX_ROW = 65536  # one row lives in one program's registers


@triton.jit
def _quantize_row(v, mask, row, x8_ptr, scale_ptr, rowsum_ptr, stride_qm, offs):
    """v (BLOCK,) fp32, zero where masked -> x8 row, scale, rowsum."""
    amax = tl.max(tl.abs(v), axis=0)
    scale = tl.maximum(tl.math.div_rn(amax, 127.0), 1e-8)
    q = tl.math.div_rn(v, scale)
    q = (q + _ROUND_MAGIC) - _ROUND_MAGIC
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int32)
    tl.store(x8_ptr + row * stride_qm + offs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, scale)
    tl.store(rowsum_ptr + row, tl.sum(tl.where(mask, q, 0), axis=0))


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, w_ptr, x8_ptr, scale_ptr, rowsum_ptr,
    K, eps,
    stride_xm, stride_qm,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(x * x, axis=0), K.to(tl.float32))
    inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    _quantize_row(x * inv_rms * w, mask, row, x8_ptr, scale_ptr, rowsum_ptr, stride_qm, offs)


@triton.jit
def _silu_mul_quant_kernel(
    gu_ptr, x8_ptr, scale_ptr, rowsum_ptr,
    F,
    stride_gm, stride_qm,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < F
    gate = tl.load(gu_ptr + row * stride_gm + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gm + F + offs, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    _quantize_row(silu * up, mask, row, x8_ptr, scale_ptr, rowsum_ptr, stride_qm, offs)


@triton.jit
def _quant_kernel(
    x_ptr, x8_ptr, scale_ptr, rowsum_ptr,
    K,
    stride_xm, stride_qm,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    _quantize_row(x, mask, row, x8_ptr, scale_ptr, rowsum_ptr, stride_qm, offs)


def _check_rows(name: str, x: torch.Tensor, k: int) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D (tokens, features) tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: expected fp16, bf16 or fp32, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous, got strides {x.stride()}")
    if not 1 <= k <= MAX_ROW:
        raise ValueError(f"{name}: row length {k} outside [1, {MAX_ROW}]")


def _outputs(m: int, k: int, device: torch.device):
    x8 = torch.empty((m, k), dtype=torch.int8, device=device)
    scale = torch.empty((m,), dtype=torch.float32, device=device)
    rowsum = torch.empty((m,), dtype=torch.int32, device=device)
    return x8, scale, rowsum


def _meta(k: int) -> dict:
    block = triton.next_power_of_2(k)
    return {"BLOCK": block, "num_warps": max(1, min(16, block // 512))}


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """x (M, K) residual stream, weight (K,) -> x8 (M, K) int8, scale (M,) fp32, rowsum (M,) int32."""
    _check_rows("rmsnorm_quant x", x, x.shape[-1])
    m, k = x.shape
    assert weight.shape == (k,) and weight.stride(0) == 1, f"weight: expected ({k},) contiguous, got {tuple(weight.shape)}"
    assert weight.device == x.device
    x8, scale, rowsum = _outputs(m, k, x.device)
    if m:
        _rmsnorm_quant_kernel[(m,)](x, weight, x8, scale, rowsum, k, eps, x.stride(0), x8.stride(0), **_meta(k))
    return x8, scale, rowsum


def silu_mul_quant(gate_up: torch.Tensor):
    """gate_up (M, 2F) = [gate | up] -> quantized silu(gate) * up: x8 (M, F), scale (M,), rowsum (M,)."""
    _check_rows("silu_mul_quant gate_up", gate_up, gate_up.shape[-1] // 2)
    m, two_f = gate_up.shape
    if two_f % 2:
        raise ValueError(f"silu_mul_quant: gate_up width {two_f} is odd; expected [gate | up] of 2F")
    f = two_f // 2
    x8, scale, rowsum = _outputs(m, f, gate_up.device)
    if m:
        _silu_mul_quant_kernel[(m,)](gate_up, x8, scale, rowsum, f, gate_up.stride(0), x8.stride(0), **_meta(f))
    return x8, scale, rowsum


def quantize(x: torch.Tensor):
    """x (M, K) -> x8 (M, K) int8, scale (M,) fp32, rowsum (M,) int32."""
    _check_rows("quantize x", x, x.shape[-1])
    m, k = x.shape
    x8, scale, rowsum = _outputs(m, k, x.device)
    if m:
        _quant_kernel[(m,)](x, x8, scale, rowsum, k, x.stride(0), x8.stride(0), **_meta(k))
    return x8, scale, rowsum

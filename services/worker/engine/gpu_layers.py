"""The per-format pieces of a decoder block on the GPU: what feeds a linear layer and the linear.

Both classes turn the fp16 residual stream into each GEMM's input and run the GEMM:

* `W4A8Ops` (w4a8kv4-g128 / -chn): RMSNorm / SiLU*mul / plain quantization fused into one
  kernel each (services/worker/kernels/act_quant.py) give (x8, scale, sums); the W4A8 GEMM
  variant per shape comes from the artifact's kernel policy.
* `Fp16Ops` (fp16, the baseline engine): fp16 RMSNorm and SiLU*mul in one Triton kernel each
  (below), cuBLAS fp16 GEMMs (torch.nn.functional.linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.engine.kernel_policy import GemmPolicy
from services.worker.kernels import act_quant, w4a8_gemm
from services.worker.kernels.host_int import cdiv, next_power_of_2


@triton.jit
def _rmsnorm_fp16_kernel(x_ptr, w_ptr, out_ptr, K, eps, stride_xm, stride_om, BLOCK: tl.constexpr):
    """One row per program: out = fp16(x * rsqrt(mean(x^2) + eps) * w), fp32 math (the reference's)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, (x * inv_rms * w).to(tl.float16), mask=mask)


@triton.jit
def _silu_mul_fp16_kernel(gu_ptr, out_ptr, F_SIZE, stride_gm, stride_om, BLOCK: tl.constexpr):
    """gate_up (M, 2F) = [gate | up] -> fp16 silu(gate) * up, BLOCK columns per program."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F_SIZE
    gate = tl.load(gu_ptr + row * stride_gm + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gm + F_SIZE + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, (gate / (1.0 + tl.exp(-gate)) * up).to(tl.float16), mask=mask)


def rmsnorm_fp16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (M, K) fp16, weight (K,) -> (M, K) fp16."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x: expected (M, K) with contiguous rows, got {tuple(x.shape)}"
    m, k = x.shape
    assert weight.shape == (k,) and weight.stride(0) == 1
    out = torch.empty((m, k), dtype=torch.float16, device=x.device)
    if m:
        block = next_power_of_2(k)
        _rmsnorm_fp16_kernel[(m,)](x, weight, out, k, eps, x.stride(0), out.stride(0), BLOCK=block,
                                   num_warps=max(1, min(8, block // 512)))
    return out


def silu_mul_fp16(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up (M, 2F) fp16 -> (M, F) fp16 silu(gate) * up."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    m, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((m, f), dtype=torch.float16, device=gate_up.device)
    if m:
        block = 1024
        _silu_mul_fp16_kernel[(m, cdiv(f, block))](gate_up, out, f, gate_up.stride(0), out.stride(0),
                                                          BLOCK=block, num_warps=4)
    return out


class W4A8Ops:
    """Quantized activations (act_quant.QuantizedActivations) into W4A8 GEMMs."""

    def __init__(self, policy: GemmPolicy):
        self.policy = policy

    def _variant(self, weight, m: int) -> str:
        return self.policy.variant(weight.kind, weight.qweight.shape[0], weight.qweight.shape[1] * 2, m)

    def _group_sums(self, rows: int, feeds) -> bool:
        """Whether the GEMM this quantization feeds reads x8's 128-group sums (its variant at this M
        takes them: g128 .zp and the M = 1 dp4a loop); act_quant writes them only then."""
        return w4a8_gemm.get_variant(self._variant(feeds, rows)).takes_group_sums

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None, *, feeds):
        """Quantized RMSNorm of x, after x += add (a GEMM output linear_into_residual left for it) in
        the same kernel, for the GEMM on weight `feeds`."""
        return act_quant.rmsnorm_quant(x, weight, eps, add=add, group_sums=self._group_sums(x.shape[0], feeds))

    def silu_mul(self, gate_up: torch.Tensor, *, feeds):
        return act_quant.silu_mul_quant(gate_up, group_sums=self._group_sums(gate_up.shape[0], feeds))

    def plain(self, x: torch.Tensor, *, feeds):
        return act_quant.quantize(x, group_sums=self._group_sums(x.shape[0], feeds))

    def linear(self, act: act_quant.QuantizedActivations, weight, out: torch.Tensor | None = None) -> torch.Tensor:
        # Both sums: w4a8_gemm reads the ones its weight kind and variant use.
        return w4a8_gemm.w4a8_gemm(act.x8, act.scale, weight, act.rowsum, variant=self._variant(weight, act.x8.shape[0]),
                                   group_sums=act.group_sums, out=out)

    def linear_into_residual(self, act, weight, residual: torch.Tensor) -> torch.Tensor:
        """residual += linear(act, weight), left to the next norm: returns the GEMM output, which the
        caller passes to norm(add=...) (or adds itself when no norm follows). Not in the GEMM's
        epilogue: a load of the output tile there made the H200's prefill GEMMs 15% slower (90.3 ->
        103.8 ms of an 8192-token step) for 2.9 ms of separate adds saved."""
        return self.linear(act, weight)


class Fp16Ops:
    """fp16 activations into cuBLAS fp16 GEMMs (weights (N, K) fp16)."""

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, add: torch.Tensor | None = None, *,
             feeds=None) -> torch.Tensor:
        if add is not None:
            x += add
        return rmsnorm_fp16(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor, *, feeds=None) -> torch.Tensor:
        return silu_mul_fp16(gate_up)

    def plain(self, x: torch.Tensor, *, feeds=None) -> torch.Tensor:
        return x

    def linear(self, act: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(act, weight) if out is None else torch.matmul(act, weight.t(), out=out)

    def linear_into_residual(self, act: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
        """residual += linear(act, weight) now: cuBLAS adds it in its epilogue (beta = 1); nothing left over."""
        residual.addmm_(act, weight.t())

"""Reference linear layers: the exact arithmetic each format's GEMM kernel performs.

Integer formats quantize the input per token to int8, multiply int8 x int8 -> int32 exactly,
and apply scales (and the per-channel zero term) in an fp32 epilogue whose result is rounded
to fp16, as the kernels write fp16.
"""

from __future__ import annotations

import torch

from shared.formats.weights import (
    Fp16Weight,
    PackedWeight,
    W4ChannelWeight,
    W4G128ProgressiveWeight,
    W4G128Weight,
    W8Weight,
)
from shared.quant.activations import quantize_per_token


def int8_matmul(x8: torch.Tensor, w8: torch.Tensor) -> torch.Tensor:
    """x8 (M, K) int8 @ w8 (N, K)^T int8 -> (M, N) int32, exact."""
    m = x8.shape[0]
    if x8.device.type == "cuda" and m <= 16:
        # cuBLAS int8 GEMM needs M > 16; pad with zero rows (they contribute nothing).
        padded = torch.zeros(17, x8.shape[1], dtype=torch.int8, device=x8.device)
        padded[:m] = x8
        return torch._int_mm(padded, w8.t())[:m]
    if x8.device.type == "cuda":
        return torch._int_mm(x8.contiguous(), w8.t())
    # Elsewhere fp64: every product is below 2^14 and every partial sum an integer below 2^53 for any
    # K under 2^39, so the result is exact in any summation order. On CPUs without VNNI, torch's
    # int8 GEMM is 5-10x slower than this (measured on an AVX2 host: 320 ms vs 58 ms at 512x512x1536).
    return (x8.double() @ w8.double().t()).to(torch.int32)


def _round_fp16(y: torch.Tensor) -> torch.Tensor:
    return y.to(torch.float16).to(torch.float32)


class ReferenceLinear:
    """y = x W^T for x (..., K) fp32 -> (..., N) fp32."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self.forward_2d(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)

    def forward_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FpLinear(ReferenceLinear):
    def __init__(self, weight: torch.Tensor, dtype: torch.dtype = torch.float32):
        self.weight = weight.to(dtype)  # (N, K)

    def forward_2d(self, x):
        return (x.to(self.weight.dtype) @ self.weight.t()).float()


class W4A16Linear(ReferenceLinear):
    """Weight-only: dequantized to fp16 once, fp activations."""

    def __init__(self, packed: W4G128Weight, dtype: torch.dtype = torch.float32):
        self.weight = packed.dequantize().half().to(dtype)  # (N, K)

    def forward_2d(self, x):
        return _round_fp16(x.to(self.weight.dtype) @ self.weight.t())


class W8A8Linear(ReferenceLinear):
    def __init__(self, packed: W8Weight):
        self.w8 = packed.qweight  # (N, K) int8
        self.scale = packed.scale.float()  # (N,)

    def forward_2d(self, x):
        x8, sx = quantize_per_token(x)
        acc = int8_matmul(x8, self.w8)  # (M, N) int32
        return _round_fp16(acc.float() * sx * self.scale)


class W4A8G128Linear(ReferenceLinear):
    """Progressive groups: the level-2 dequantization gives int8 weights, then one int8 GEMM."""

    def __init__(self, packed: W4G128ProgressiveWeight):
        self.w8 = packed.int8_weight()  # (N, K) int8
        self.s1 = packed.s1.float()  # (N,)

    def forward_2d(self, x):
        x8, sx = quantize_per_token(x)
        acc = int8_matmul(x8, self.w8)
        return _round_fp16(acc.float() * sx * self.s1)


class W4A8ChannelLinear(ReferenceLinear):
    """Per-channel uint4: int8 GEMM on the raw codes, zero * rowsum(x8) subtracted in the epilogue."""

    def __init__(self, packed: W4ChannelWeight):
        self.codes = packed.codes().to(torch.int8)  # (N, K) in [0, 15]
        self.scale = packed.scale.float()
        self.zero = packed.zero.float()

    def forward_2d(self, x):
        x8, sx = quantize_per_token(x)
        acc = int8_matmul(x8, self.codes).float()  # (M, N)
        row_sum = x8.float().sum(dim=-1, keepdim=True)  # (M, 1), exact in fp32 for K < 2^17
        return _round_fp16((acc - row_sum * self.zero) * sx * self.scale)


def reference_linear(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> ReferenceLinear:
    if isinstance(packed, Fp16Weight):
        return FpLinear(packed.weight, dtype)
    if isinstance(packed, W4G128Weight):
        return W4A16Linear(packed, dtype)
    if isinstance(packed, W8Weight):
        return W8A8Linear(packed)
    if isinstance(packed, W4G128ProgressiveWeight):
        return W4A8G128Linear(packed)
    if isinstance(packed, W4ChannelWeight):
        return W4A8ChannelLinear(packed)
    raise TypeError(f"no reference linear for {type(packed).__name__}")

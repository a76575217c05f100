"""Per-token symmetric int8 activation quantization (what the fused norm/quant kernels produce)."""

from __future__ import annotations

import torch


def per_token_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> codes (..., K) fp32 holding integers in [-127, 127], scale (..., 1) fp32.

    The int8 values as fp32: the CPU reference multiplies them in fp32 (shared.model.linear), so
    keeping them there saves two full passes over the activations per linear layer."""
    xf = x.float()
    lo, hi = torch.aminmax(xf, dim=-1, keepdim=True)  # max |x| without an |x| tensor
    scale = (torch.maximum(hi, -lo) / 127).clamp_min(1e-8)
    return torch.div(xf, scale).round_().clamp_(-127, 127), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> x8 (..., K) int8 in [-127, 127], scale (..., 1) fp32; x ~= x8 * scale."""
    codes, scale = per_token_codes(x)
    return codes.to(torch.int8), scale


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    codes, scale = per_token_codes(x)
    return codes.mul_(scale).to(x.dtype)

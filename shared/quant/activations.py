"""Per-token symmetric int8 activation quantization (what the fused norm/quant kernels produce)."""

from __future__ import annotations

import torch


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) float -> x8 (..., K) int8 in [-127, 127], scale (..., 1) fp32; x ~= x8 * scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-8)
    x8 = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return x8, scale


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    x8, scale = quantize_per_token(x)
    return (x8.float() * scale).to(x.dtype)

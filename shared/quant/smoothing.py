"""Block-output smoothing: migrate activation outliers of o_proj and down_proj inputs into weights.

The input X (T, K) is divided per channel by s and the weight's columns multiplied by s,
s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha), with alpha searched to minimize the error of
the quantized layer's output. The division is folded into the producer of X (v_proj rows for
o_proj, up_proj rows for down_proj), so it costs nothing at run time.
"""

from __future__ import annotations

from typing import Callable

import torch

from shared.model.config import LlamaConfig
from shared.quant.activations import fake_quantize_per_token
from shared.quant.block import WorkBlock
from shared.quant.weights import WEIGHT_QUANTIZERS

ALPHAS = tuple(i / 10 for i in range(11))


def quantized_output_error(
    x: torch.Tensor, w: torch.Tensor, weight_kind: str, activation_bits: int, ref: torch.Tensor | None = None
) -> float:
    """||X W^T - Q(X) Q(W)^T||^2 for x (T, K), w (N, K); ref: X W^T when the caller has it (a
    smoothing scale leaves it unchanged, so a search computes it once)."""
    quantize = WEIGHT_QUANTIZERS[weight_kind][0]
    xq = fake_quantize_per_token(x) if activation_bits == 8 else x
    if ref is None:
        ref = x @ w.t()
    return (ref - xq @ quantize(w).dequantize().to(x).t()).pow(2).sum().item()


def search_scales(
    x: torch.Tensor,
    w: torch.Tensor,
    weight_kind: str,
    activation_bits: int,
    tie: Callable[[torch.Tensor], torch.Tensor] = lambda v: v,
) -> torch.Tensor:
    """Best per-channel s (K,) for x (T, K), w (N, K); ones when no alpha beats leaving X alone.

    `tie` makes channels that must share a scale (one V channel feeding several query heads) equal.
    """
    x_max = tie(x.abs().amax(dim=0)).clamp_min(1e-5)
    w_max = tie(w.abs().amax(dim=0)).clamp_min(1e-5)
    best_s = torch.ones_like(x_max)
    ref = x @ w.t()
    best_err = quantized_output_error(x, w, weight_kind, activation_bits, ref)
    for alpha in ALPHAS:
        s = (x_max.pow(alpha) / w_max.pow(1 - alpha)).clamp_min(1e-5)
        s = s / (s.max() * s.min()).sqrt()  # centre around 1 so neither side's magnitude drifts
        err = quantized_output_error(x / s, w * s, weight_kind, activation_bits, ref)
        if err < best_err:
            best_err, best_s = err, s
    return best_s


def tie_over_query_groups(config: LlamaConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """For o_proj inputs (heads*D,): channel (h, i) takes the max over the heads sharing V head kv(h)."""

    def tie(v: torch.Tensor) -> torch.Tensor:
        grouped = v.view(config.num_kv_heads, config.group_size, config.head_dim).amax(dim=1, keepdim=True)
        return grouped.expand(-1, config.group_size, -1).reshape(-1)

    return tie


def apply_o_smoothing(config: LlamaConfig, block: WorkBlock, s: torch.Tensor) -> None:
    """s (heads*D,) tied over query groups: V rows /= s, o_proj columns *= s."""
    _, _, v_rows = block.q_k_v_rows(config)
    per_kv = s.view(config.num_kv_heads, config.group_size, config.head_dim)[:, 0].reshape(-1)
    block.qkv[v_rows] /= per_kv[:, None]
    block.o *= s[None, :]


def apply_down_smoothing(block: WorkBlock, s: torch.Tensor) -> None:
    """s (F,): up_proj rows /= s (SiLU(gate) * up is linear in up), down_proj columns *= s."""
    _, up_rows = block.gate_up_rows()
    block.gate_up[up_rows] /= s[:, None]
    block.down *= s[None, :]

"""KV4 range ratios: per layer, how far V's [min, max] shrinks before 4-bit quantization.

A 4-bit grid stretched over the full range of a head vector spends its end levels on the one or
two extreme values; narrowing the range (those values clamp) refines the step for all the others.
Each layer's V gets the ratio, among RATIOS, of least squared error on calibration tokens, each
channel weighted by o_proj's squared column norms (V's error reaches the block output through
the attention average and o_proj) (beyond QServe). The rule itself, and its fp32 arithmetic, is
shared.formats.kv4's.

K keeps its full range (ratio 1). The format carries a K ratio too, but on the fixture every
narrowing of K measured worse perplexity, even where it lowered the logit error of
SmoothAttention's search (g128: K 0.975 in 3 of 6 layers with V 0.9 -> 5.1191, K 1 -> 5.1170):
clamping a key's extremes moves exactly the logits that decide where attention goes.
"""

from __future__ import annotations

import torch

from shared.formats.kv4 import fake_quantize_kv4
from shared.model.config import LlamaConfig

# fp32-exact candidates: the artifact stores ratios as fp32, so the search scores the very values served.
RATIOS = tuple(torch.tensor([1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.8], dtype=torch.float32).tolist())


def value_channel_weights(config: LlamaConfig, o_weight: torch.Tensor) -> torch.Tensor:
    """o_weight (H, heads*D) -> (kv_heads, D): squared column norms summed over each V head's query heads."""
    col = o_weight.pow(2).sum(dim=0).view(config.num_kv_heads, config.group_size, config.head_dim)
    return col.sum(dim=1)


def search_value_ratio(v: torch.Tensor, channel_weights: torch.Tensor) -> float:
    """v (S, kv_heads, D) as it reaches the cache; channel_weights (kv_heads, D) -> ratio."""
    errors = {r: ((fake_quantize_kv4(v, r) - v).pow(2) * channel_weights).sum().item() for r in RATIOS}
    return min(RATIOS, key=lambda r: (errors[r], -r))  # ties keep the wider range

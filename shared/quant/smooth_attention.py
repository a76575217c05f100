"""SmoothAttention: divide the outlier channels of K by lambda and multiply Q's by lambda.

q . k is unchanged, so the model computes the same function, but the K that lands in the
4-bit cache has a far smaller range. lambda_i = max|K_i| ** alpha, made equal for channels
i and i + D/2 (the pair RoPE rotates together) so that the scaling commutes with RoPE.
With grouped-query attention, one lambda per KV-head channel scales every query head of the group.
"""

from __future__ import annotations

import torch

from shared.model.config import LlamaConfig
from shared.quant.block import WorkBlock


def smooth_attention_scales(config: LlamaConfig, k_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """k_absmax (kv_heads, D), max |K| pre-RoPE over calibration tokens -> lambda (kv_heads, D),
    equal across RoPE halves."""
    kmax = k_absmax
    half = config.head_dim // 2
    paired = torch.maximum(kmax[:, :half], kmax[:, half:])
    kmax = torch.cat([paired, paired], dim=1)
    return kmax.clamp_min(1e-5).pow(alpha)


def apply_smooth_attention(config: LlamaConfig, block: WorkBlock, lam: torch.Tensor) -> None:
    q_rows, k_rows, _ = block.q_k_v_rows(config)
    per_q_head = lam.repeat_interleave(config.group_size, dim=0)  # (heads, D)
    block.qkv[q_rows] *= per_q_head.reshape(-1, 1)
    block.qkv[k_rows] /= lam.reshape(-1, 1)

"""SmoothAttention: divide the outlier channels of K by lambda and multiply Q's by lambda.

q . k is unchanged, so the model computes the same function, but the K that lands in the
4-bit cache has a far smaller range. lambda_i = max|K_i| ** alpha, made equal for channels
i and i + D/2 (the pair RoPE rotates together) so that the scaling commutes with RoPE.
With grouped-query attention, one lambda per KV-head channel scales every query head of the group.
"""

from __future__ import annotations

import torch

from shared.formats.kv4 import fake_quantize_kv4

from shared.model.config import LlamaConfig
from shared.quant.block import WorkBlock
from shared.quant.key_feedback import query_second_moment


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


def rope_at(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (S, heads, D) pre-RoPE vectors rotated to their own positions (S,) (HF rotate_half)."""
    c, s = cos[positions][:, None], sin[positions][:, None]
    half = x.shape[-1] // 2
    return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s


K_EXPONENTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
Q_EXPONENTS = (0.0, 0.25, 0.5)


def _pair(v: torch.Tensor) -> torch.Tensor:
    """Max over RoPE pairs (i, i + D/2), written back to both: (..., D) -> (..., D)."""
    half = v.shape[-1] // 2
    paired = torch.maximum(v[..., :half], v[..., half:])
    return torch.cat([paired, paired], dim=-1)


def kv4_logit_error(config: LlamaConfig, q_rope: torch.Tensor, k_rope: torch.Tensor, lam: torch.Tensor) -> float:
    """sum over (query, key) pairs and heads of (q~ . (Q(k~) - k~))^2 with q~ = q lambda, k~ = k / lambda.

    q_rope (S, heads, D), k_rope (S, kv_heads, D) post-RoPE; lam (kv_heads, D).
    """
    k_s = k_rope / lam
    err = fake_quantize_kv4(k_s) - k_s  # (S, kv_heads, D)
    m = query_second_moment(config, q_rope * lam.repeat_interleave(config.group_size, dim=0))  # (kv_heads, D, D)
    return torch.einsum("sgd,gde,sge->", err, m, err).item()


def search_smooth_attention(
    config: LlamaConfig,
    q_sub: torch.Tensor,
    k_sub: torch.Tensor,
    positions: torch.Tensor,
    q_absmax: torch.Tensor,
    k_absmax: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """The lambda (kv_heads, D), among max|K|^a / max|Q|^b and no scaling, with the least KV4 logit error.

    Q's magnitude enters because the logit error of a K channel is weighted by the matching Q channel.
    """
    q_rope, k_rope = rope_at(q_sub, positions, cos, sin), rope_at(k_sub, positions, cos, sin)
    k_max = _pair(k_absmax).clamp_min(1e-5)
    q_max = _pair(q_absmax.view(config.num_kv_heads, config.group_size, -1).amax(dim=1)).clamp_min(1e-5)
    best = torch.ones_like(k_max)
    best_err = kv4_logit_error(config, q_rope, k_rope, best)
    for a in K_EXPONENTS:
        for b in Q_EXPONENTS:
            lam = k_max.pow(a) / q_max.pow(b)
            err = kv4_logit_error(config, q_rope, k_rope, lam)
            if err < best_err:
                best, best_err = lam, err
    return best

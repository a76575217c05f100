"""A plain Llama forward over reference linears: the numerics every backend is checked against.

Weights are fused as the kernels want them: qkv = [q; k; v] rows and gate_up = [gate; up] rows.
The same block function serves the quantizer (fp32 weights, activations captured for
calibration), perplexity evaluation and the CPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from shared.formats.kv4 import FULL_KV_RANGE, fake_quantize_kv4
from shared.model.config import LlamaConfig
from shared.model.rope import apply_rope, cos_sin, inverse_frequencies

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Block:
    attn_norm: torch.Tensor  # (H,) fp32
    qkv: Linear  # H -> heads*D + 2*kv_heads*D
    o: Linear  # heads*D -> H
    mlp_norm: torch.Tensor  # (H,) fp32
    gate_up: Linear  # H -> 2F
    down: Linear  # F -> H
    kv_range: tuple[float, float] = FULL_KV_RANGE  # KV4 range ratios of K and V (shared.formats.kv4)
    key_feedback: torch.Tensor | None = None  # KV4 keys' error-feedback factor (kv_heads, D, D), or nearest rounding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def attention(
    config: LlamaConfig,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_bits: int,
    capture: dict | None = None,
    attention_dtype: torch.dtype = torch.float32,
    kv_range: tuple[float, float] = FULL_KV_RANGE,
    key_feedback: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv (B, T, q+2kv) fp32 -> causal attention output (B, T, heads*D) fp32.

    kv_range, key_feedback: the layer's KV4 write (shared.formats.kv4), with kv_bits 4.

    attention_dtype float64 makes the result independent of summation order (to fp32 precision), so
    a forward over the whole sequence and a KV-cached decode of it agree bit for bit; see
    services/worker/engine/reference_runner.py."""
    c = config
    b, t, _ = qkv.shape
    q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
    q = q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # (B, heads, T, D)
    k = k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, kv_heads, T, D)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    if capture is not None:
        capture["q_pre_rope"], capture["k_pre_rope"], capture["v"] = q, k, v
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if kv_bits == 4:
        feedback = None if key_feedback is None else key_feedback[:, None]  # (kv_heads, 1, D, D) against (B, kv_heads, T, D)
        k, v = fake_quantize_kv4(k, kv_range[0], feedback), fake_quantize_kv4(v, kv_range[1])
    if c.group_size > 1:
        k = k.repeat_interleave(c.group_size, dim=1)
        v = v.repeat_interleave(c.group_size, dim=1)
    a = attention_dtype
    out = F.scaled_dot_product_attention(q.to(a), k.to(a), v.to(a), is_causal=True).float()  # (B, heads, T, D)
    return out.transpose(1, 2).reshape(b, t, c.q_size)


def block_forward(
    config: LlamaConfig,
    block: Block,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_bits: int = 16,
    capture: dict | None = None,
    attention_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x (B, T, H) fp32 residual stream -> (B, T, H). `capture` receives each GEMM's input."""
    h = rms_norm(x, block.attn_norm, config.rms_norm_eps)
    attn = attention(config, block.qkv(h), cos, sin, kv_bits, capture, attention_dtype, block.kv_range, block.key_feedback)
    x = x + block.o(attn)
    h2 = rms_norm(x, block.mlp_norm, config.rms_norm_eps)
    gate, up = block.gate_up(h2).chunk(2, dim=-1)
    act = F.silu(gate) * up
    if capture is not None:
        capture.update(qkv_in=h, o_in=attn, gate_up_in=h2, down_in=act)
    return x + block.down(act)


class LlamaModel:
    """Embedding, blocks, final norm and LM head: tokens (B, T) -> logits (B, T, V) fp32."""

    def __init__(
        self,
        config: LlamaConfig,
        embed: torch.Tensor,
        blocks: list[Block],
        final_norm: torch.Tensor,
        lm_head: Linear,
        kv_bits: int = 16,
        attention_dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.embed = embed  # (V, H)
        self.blocks = blocks
        self.final_norm = final_norm.float()
        self.lm_head = lm_head
        self.kv_bits = kv_bits
        self.attention_dtype = attention_dtype  # float64: order-independent sums (the worker's CPU backend)
        self.inv_freq = inverse_frequencies(config.rope, config.head_dim)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = cos_sin(positions, self.inv_freq)
        x = self.embed[tokens].float()
        for block in self.blocks:
            x = block_forward(self.config, block, x, cos, sin, self.kv_bits, attention_dtype=self.attention_dtype)
        return self.lm_head(rms_norm(x, self.final_norm, self.config.rms_norm_eps))

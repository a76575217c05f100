"""A decoder block's weights in fp32 while the quantizer transforms them (fused as the kernels want)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.model.checkpoint import FpBlock
from shared.model.config import LlamaConfig
from shared.model.linear import FpLinear
from shared.model.llama import Block


@dataclass(slots=True)
class WorkBlock:
    attn_norm: torch.Tensor  # (H,)
    qkv: torch.Tensor  # (q + 2kv, H): rows [q; k; v]
    o: torch.Tensor  # (H, q)
    mlp_norm: torch.Tensor  # (H,)
    gate_up: torch.Tensor  # (2F, H): rows [gate; up]
    down: torch.Tensor  # (H, F)

    @classmethod
    def from_fp(cls, b: FpBlock, device) -> "WorkBlock":
        f32 = dict(device=device, dtype=torch.float32)
        return cls(
            attn_norm=b.input_norm.to(**f32),
            qkv=torch.cat([b.q, b.k, b.v]).to(**f32),
            o=b.o.to(**f32),
            mlp_norm=b.post_attn_norm.to(**f32),
            gate_up=torch.cat([b.gate, b.up]).to(**f32),
            down=b.down.to(**f32),
        )

    def as_fp_block(self) -> Block:
        """The block as a reference Block in fp32 (for calibration forwards)."""
        return Block(
            attn_norm=self.attn_norm,
            qkv=FpLinear(self.qkv),
            o=FpLinear(self.o),
            mlp_norm=self.mlp_norm,
            gate_up=FpLinear(self.gate_up),
            down=FpLinear(self.down),
        )

    def q_k_v_rows(self, config: LlamaConfig) -> tuple[slice, slice, slice]:
        q, kv = config.q_size, config.kv_size
        return slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)

    def gate_up_rows(self) -> tuple[slice, slice]:
        f = self.down.shape[1]
        return slice(0, f), slice(f, 2 * f)

    def fold_norms(self) -> None:
        """Move RMSNorm weights into the following linears (needed before rotation)."""
        self.qkv *= self.attn_norm[None, :]
        self.gate_up *= self.mlp_norm[None, :]
        self.attn_norm = torch.ones_like(self.attn_norm)
        self.mlp_norm = torch.ones_like(self.mlp_norm)

    def rotate_values(self, config: LlamaConfig, r: torch.Tensor) -> None:
        """Per-head V -> V R (R (D, D) orthogonal): v_proj rows -> R^T W_v, o_proj columns -> W_o R.

        Attention outputs are weighted sums of V rows, so each head's output turns by the same R
        and o_proj turns it back: the function is unchanged, V's outlier channels are spread out.
        """
        r = r.to(self.qkv)
        _, _, v_rows = self.q_k_v_rows(config)
        d = config.head_dim
        w_v = self.qkv[v_rows].view(config.num_kv_heads, d, -1)  # (kv_heads, D, H)
        self.qkv[v_rows] = (r.t() @ w_v).reshape(-1, w_v.shape[-1])
        w_o = self.o.view(self.o.shape[0], config.num_heads, d)  # (H, heads, D)
        self.o = (w_o @ r).reshape(self.o.shape[0], -1)

    def rotate(self, r: torch.Tensor) -> None:
        """Residual stream x -> x R: inputs read x R, so W -> W R; outputs write y R, so W -> R^T W."""
        r = r.to(self.qkv)
        self.qkv = self.qkv @ r
        self.gate_up = self.gate_up @ r
        self.o = r.t() @ self.o
        self.down = r.t() @ self.down

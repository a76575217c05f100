"""An artifact's weights moved to the runner's device, in the layouts the kernels read.

Anything with ArtifactReader's reading interface works as the source (`manifest`, `spec`,
`embed()`, `head()`, `block(i)`): the GPU benchmark passes an in-memory random model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from shared.formats.artifact import BLOCK_LINEARS
from shared.formats.kv4 import FULL_KV_RANGE
from shared.formats.weights import Fp16Weight, PackedWeight, W4ChannelWeight, W4G128ProgressiveWeight

SUPPORTED_KINDS = (W4G128ProgressiveWeight.kind, W4ChannelWeight.kind, Fp16Weight.kind)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (H,) fp32
    mlp_norm: torch.Tensor  # (H,) fp32
    qkv: object  # packed W4A8 weight (N = q + 2 kv, K = H), or (N, K) fp16 for the baseline
    o: object  # heads*D -> H
    gate_up: object  # H -> 2F ([gate; up] rows)
    down: object  # F -> H
    kv_range: tuple[float, float] = FULL_KV_RANGE  # KV4 range ratios of K and V (shared.formats.kv4)
    key_feedback: torch.Tensor | None = None  # (kv_heads, D, D) fp32: the KV4 keys' error-feedback factor


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # (V, H) fp16
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (H,) fp32
    lm_head: torch.Tensor  # (V, H) fp16

    def tensors(self) -> list[torch.Tensor]:
        out = [self.embed, self.final_norm, self.lm_head]
        for layer in self.layers:
            out += [layer.attn_norm, layer.mlp_norm]
            for name in BLOCK_LINEARS:
                w = getattr(layer, name)
                out += [w] if isinstance(w, torch.Tensor) else [getattr(w, f.name) for f in fields(w)]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def bytes_read_per_step(self) -> int:
        """What one forward step reads whatever its batch: all but the embedding table (rows gathered)."""
        return self.nbytes() - self.embed.numel() * self.embed.element_size()


def _to_device(packed: PackedWeight, device: torch.device):
    if isinstance(packed, Fp16Weight):
        return packed.weight.to(device=device, dtype=torch.float16).contiguous()
    return type(packed)(**{f.name: getattr(packed, f.name).to(device).contiguous() for f in fields(packed)})


def load_weights(reader, device: torch.device) -> ModelWeights:
    kind = reader.spec.weight_kind
    if kind not in SUPPORTED_KINDS:
        raise ValueError(
            f"the Triton runner serves weight kinds {SUPPORTED_KINDS}; format {reader.spec.name} uses {kind!r}"
        )
    layers = []
    num_layers = reader.manifest.model_config["num_layers"]
    for i in range(num_layers):
        norms, linears = reader.block(i)
        key_feedback = reader.block_key_feedback(i)
        layers.append(
            LayerWeights(
                attn_norm=norms["attn_norm"].to(device=device, dtype=torch.float32),
                mlp_norm=norms["mlp_norm"].to(device=device, dtype=torch.float32),
                **{name: _to_device(linears[name], device) for name in BLOCK_LINEARS},
                kv_range=reader.block_kv_range(i),
                key_feedback=None if key_feedback is None else key_feedback.to(device),
            )
        )
    final_norm, lm_head = reader.head()
    return ModelWeights(
        embed=reader.embed().to(device=device, dtype=torch.float16),
        layers=layers,
        final_norm=final_norm.to(device=device, dtype=torch.float32),
        lm_head=lm_head.weight.to(device=device, dtype=torch.float16),
    )

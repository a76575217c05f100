"""Builds a reference LlamaModel from an fp checkpoint or from a quantized artifact."""

from __future__ import annotations

from dataclasses import fields

import torch

from shared.formats.artifact import ArtifactReader
from shared.formats.weights import PackedWeight
from shared.model.checkpoint import HfCheckpoint
from shared.model.config import LlamaConfig
from shared.model.linear import FpLinear, reference_linear
from shared.model.llama import Block, LlamaModel


def fp_model(ckpt: HfCheckpoint, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LlamaModel:
    """The unquantized model (fp32 on the CPU: the reference every quantized result is compared to)."""
    blocks = []
    for i in range(ckpt.config.num_layers):
        b = ckpt.block(i).to(device)
        blocks.append(
            Block(
                attn_norm=b.input_norm.float(),
                qkv=FpLinear(torch.cat([b.q, b.k, b.v]), dtype),
                o=FpLinear(b.o, dtype),
                mlp_norm=b.post_attn_norm.float(),
                gate_up=FpLinear(torch.cat([b.gate, b.up]), dtype),
                down=FpLinear(b.down, dtype),
            )
        )
    return LlamaModel(
        ckpt.config,
        embed=ckpt.embed_tokens().to(device=device, dtype=dtype),
        blocks=blocks,
        final_norm=ckpt.final_norm().to(device),
        lm_head=FpLinear(ckpt.lm_head().to(device), dtype),
    )


def artifact_model(
    reader: ArtifactReader, device: str | torch.device = "cpu", attention_dtype: torch.dtype = torch.float32
) -> LlamaModel:
    """The model exactly as the artifact's format computes it (integer GEMMs, KV4 when the format says).
    attention_dtype: see shared.model.llama.attention."""
    config = LlamaConfig.from_dict(reader.manifest.model_config)
    blocks = []
    for i in range(config.num_layers):
        norms, linears = reader.block(i)
        lin = {name: reference_linear(_to(p, device)) for name, p in linears.items()}
        blocks.append(
            Block(
                attn_norm=norms["attn_norm"].to(device).float(),
                qkv=lin["qkv"],
                o=lin["o"],
                mlp_norm=norms["mlp_norm"].to(device).float(),
                gate_up=lin["gate_up"],
                down=lin["down"],
                kv_range=reader.block_kv_range(i),
                key_feedback=_on(reader.block_key_feedback(i), device),
            )
        )
    final_norm, lm_head = reader.head()
    return LlamaModel(
        config,
        embed=reader.embed().to(device).float(),
        blocks=blocks,
        final_norm=final_norm.to(device),
        lm_head=FpLinear(lm_head.weight.to(device)),
        kv_bits=reader.spec.kv_bits,
        attention_dtype=attention_dtype,
    )


def _on(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _to(packed: PackedWeight, device) -> PackedWeight:
    return type(packed)(**{f.name: getattr(packed, f.name).to(device) for f in fields(packed)})

"""Builds a reference LlamaModel from an fp checkpoint or from a quantized artifact."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import fields

import torch

from shared.formats.artifact import ArtifactReader
from shared.formats.probe import DECODE_TOKENS, PROMPT_TOKENS, Probe, probe_token_ids
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
    reader: ArtifactReader, device: str | torch.device = "cpu", attention_dtype: torch.dtype = torch.float32,
    *, streamed: bool = False,
) -> LlamaModel:
    """The model exactly as the artifact's format computes it (integer GEMMs, KV4 when the format says).
    attention_dtype: see shared.model.llama.attention. streamed: each block is read when the forward reaches
    it and dropped after, so a forward holds one block (plus embeddings and head) in memory: what the quantizer
    can afford for its probe of a 70B model, at the cost of reading the blocks again for every forward."""
    config = LlamaConfig.from_dict(reader.manifest.model_config)
    blocks = _StreamedBlocks(reader, device) if streamed else [artifact_block(reader, i, device)
                                                               for i in range(config.num_layers)]
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


def artifact_block(reader: ArtifactReader, i: int, device: str | torch.device) -> Block:
    norms, linears = reader.block(i)
    lin = {name: reference_linear(_to(p, device)) for name, p in linears.items()}
    return Block(
        attn_norm=norms["attn_norm"].to(device).float(),
        qkv=lin["qkv"],
        o=lin["o"],
        mlp_norm=norms["mlp_norm"].to(device).float(),
        gate_up=lin["gate_up"],
        down=lin["down"],
        kv_range=reader.block_kv_range(i),
        key_feedback=_on(reader.block_key_feedback(i), device),
    )


class _StreamedBlocks:
    """The artifact's blocks as LlamaModel.forward iterates them, each read from disk when reached."""

    def __init__(self, reader: ArtifactReader, device: str | torch.device):
        self.reader, self.device = reader, device
        self.num_layers = int(reader.manifest.model_config["num_layers"])

    def __iter__(self) -> Iterator[Block]:
        return (artifact_block(self.reader, i, self.device) for i in range(self.num_layers))


@torch.no_grad()
def reference_probe(reader: ArtifactReader, device: str | torch.device = "cpu") -> Probe:
    """The artifact's probe (shared.formats.probe): its token ids and the reference logits for them, computed
    one block at a time. A model whose context is shorter than the probe gets a shorter one."""
    config = LlamaConfig.from_dict(reader.manifest.model_config)
    length = max(2, min(PROMPT_TOKENS + DECODE_TOKENS, config.max_position_embeddings))
    decode = min(DECODE_TOKENS, length - 1)
    ids = probe_token_ids(config.vocab_size, length)
    logits = artifact_model(reader, device, streamed=True).forward(torch.tensor([ids], device=device))[0]
    return Probe(ids[: length - decode], ids[length - decode :], logits[length - decode - 1 :].float().cpu())


def _on(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _to(packed: PackedWeight, device) -> PackedWeight:
    return type(packed)(**{f.name: getattr(packed, f.name).to(device) for f in fields(packed)})

"""Random-weight Llama checkpoints of real shapes, made offline (no download).

Used by `qctl up` when no model is given, and by the GPU benchmarks for speed and memory
(random weights are fine for those; accuracy needs a trained model). The tokenizer is a
byte-level BPE trained on the running Python's standard library sources, so it exists offline.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.quant.calibration import default_calibration_text


@dataclass(slots=True, frozen=True)
class DemoShape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


SHAPES = {
    "tiny": DemoShape(hidden=256, ffn=768, layers=2, heads=2, kv_heads=1, vocab=2048),
    "llama2-7b": DemoShape(hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32, vocab=32000),
}


def train_demo_tokenizer(folder: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab, 4096), special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    _, text = default_calibration_text(max_bytes=300_000)
    tok.train_from_iterator([text], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )


# The files write_demo_checkpoint writes after the shards. Versions that wrote in place (not into a temporary
# folder) wrote them in this order, after every shard: a folder without all of them was left by a stopped run.
DEMO_FILES = ("model.safetensors.index.json", "config.json", "tokenizer.json", "tokenizer_config.json")


def demo_checkpoint_complete(folder: Path) -> bool:
    """Whether folder holds a whole demo checkpoint (False for one an older version left half written)."""
    return all((folder / name).is_file() for name in DEMO_FILES)


def write_demo_checkpoint(folder: str | Path, shape: str = "tiny", seed: int = 0) -> Path:
    """Writes config.json, one safetensors shard per block (with an index) and a tokenizer into folder, which
    must not exist yet (or be empty). They are written into a temporary sibling folder, renamed to folder once
    complete: a write stopped midway (Ctrl-C, a kill) leaves no folder that looks like a checkpoint but lacks
    its tokenizer (every later `qctl up` took such a folder as the model and failed to load it)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown demo shape {shape!r}; expected one of: {', '.join(SHAPES)}")
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        _write(tmp, SHAPES[shape], seed)
        os.replace(tmp, folder)  # an OSError if folder is there and not empty: it is not replaced
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def _write(folder: Path, s: DemoShape, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    head_dim = s.hidden // s.heads

    def rand(*dims, std):
        return (torch.randn(*dims, generator=g) * std).half()

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})

    std = s.hidden**-0.5
    shard("embed.safetensors", {"model.embed_tokens.weight": rand(s.vocab, s.hidden, std=1.0)})
    for i in range(s.layers):
        p = f"model.layers.{i}."
        shard(f"block_{i:03d}.safetensors", {
            p + "input_layernorm.weight": torch.ones(s.hidden, dtype=torch.float16),
            p + "post_attention_layernorm.weight": torch.ones(s.hidden, dtype=torch.float16),
            p + "self_attn.q_proj.weight": rand(s.heads * head_dim, s.hidden, std=std),
            p + "self_attn.k_proj.weight": rand(s.kv_heads * head_dim, s.hidden, std=std),
            p + "self_attn.v_proj.weight": rand(s.kv_heads * head_dim, s.hidden, std=std),
            p + "self_attn.o_proj.weight": rand(s.hidden, s.heads * head_dim, std=std),
            p + "mlp.gate_proj.weight": rand(s.ffn, s.hidden, std=std),
            p + "mlp.up_proj.weight": rand(s.ffn, s.hidden, std=std),
            p + "mlp.down_proj.weight": rand(s.hidden, s.ffn, std=s.ffn**-0.5),
        })
    shard("head.safetensors", {
        "model.norm.weight": torch.ones(s.hidden, dtype=torch.float16),
        "lm_head.weight": rand(s.vocab, s.hidden, std=std),
    })
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": s.hidden,
        "intermediate_size": s.ffn, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": head_dim, "vocab_size": s.vocab,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0, "rope_theta": 10000.0, "torch_dtype": "float16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    train_demo_tokenizer(folder, s.vocab)

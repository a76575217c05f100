"""The reference Llama forward computes what Hugging Face transformers computes."""

import pytest
import torch

from shared.model.checkpoint import HfCheckpoint
from shared.model.config import CheckpointError, LlamaConfig
from shared.model.load import fp_model
from tests.conftest import write_random_llama

transformers = pytest.importorskip("transformers")


def _hf_logits(folder, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def _ours(folder, tokens):
    return fp_model(HfCheckpoint(folder)).forward(tokens)


def test_trained_fixture_matches_transformers(tiny_llama):
    tokens = torch.randint(0, 4096, (2, 33), generator=torch.Generator().manual_seed(1))
    ours, ref = _ours(tiny_llama, tokens), _hf_logits(tiny_llama, tokens)
    assert (ours - ref).abs().max() < 2e-3 * ref.abs().max()


@pytest.mark.parametrize(
    "variant",
    [
        dict(tie=True),  # tied embeddings
        dict(heads=8, kv_heads=1, hidden=256),  # multi-query attention, head_dim 32
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    ],
    ids=["tied", "mqa", "llama3-rope"],
)
def test_architecture_variants_match_transformers(tmp_path, variant):
    folder = write_random_llama(tmp_path / "m", layers=2, **variant)
    tokens = torch.randint(0, 4096, (1, 200), generator=torch.Generator().manual_seed(2))
    ours, ref = _ours(folder, tokens), _hf_logits(folder, tokens)
    assert (ours - ref).abs().max() < 2e-3 * ref.abs().max()


def test_non_llama_checkpoint_is_refused(tmp_path):
    folder = write_random_llama(tmp_path / "m")
    text = (folder / "config.json").read_text().replace('"llama"', '"gpt2"').replace("LlamaForCausalLM", "GPT2LMHeadModel")
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="not a Llama-family checkpoint"):
        HfCheckpoint(folder)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_random_llama(tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        HfCheckpoint(folder)


def test_truncated_weights_file_is_refused(tmp_path):
    folder = write_random_llama(tmp_path / "m")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        HfCheckpoint(folder)


def test_rope_parameters_of_transformers_5_are_read():
    cfg = LlamaConfig.from_hf({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 2, "vocab_size": 10,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0},
    })
    assert cfg.rope.theta == 500000.0 and cfg.rope.type == "llama3" and cfg.rope.factor == 32.0

"""Which Hugging Face checkpoints the loader accepts, and that what it accepts computes what
transformers computes: every architecture detail of a config.json is either reproduced by the
reference forward or refused at load time with a CheckpointError naming it.

Checkpoints are written by transformers itself (save_pretrained of a tiny random model), then
config.json is edited where a case is about a config transformers would not write (legacy keys,
another model_type); the reference is AutoModelForCausalLM, which is what transformers does with
the folder as it stands.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model.checkpoint import HfCheckpoint
from shared.model.config import CheckpointError, LlamaConfig
from shared.model.load import fp_model

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
SEQ = 200


def save_hf_llama(folder: Path, dtype: torch.dtype = torch.float16, save_kw: dict | None = None, scale: float = 0.1,
                  **config) -> Path:
    """A tiny random LlamaForCausalLM saved by transformers. Weights at the scale of a trained model
    (unit embeddings, norms near 1, projections of std `scale`) so that attention is neither uniform
    nor one-hot and a RoPE or head_dim mistake shows in the logits."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**TINY, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, scale)
    model.to(dtype).save_pretrained(folder, **(save_kw or {}))
    return folder


def edit_config(folder: Path, **changes) -> Path:
    """Sets keys of config.json (a value None deletes the key)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


def assert_matches_transformers(folder: Path) -> None:
    tokens = torch.randint(0, TINY["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(tokens).logits
    ours = fp_model(HfCheckpoint(folder)).forward(tokens)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-3, f"relative max error {err:.2e} against transformers"


LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


# ---------------------------------------------------------------- accepted, and computed like transformers

@pytest.mark.parametrize(
    "config",
    [
        dict(tie_word_embeddings=True),
        dict(tie_word_embeddings=False),
        dict(num_key_value_heads=2),  # GQA, 2 query heads per KV head
        dict(num_key_value_heads=1),  # MQA
        dict(head_dim=32),  # wider than hidden_size / heads (16): q_proj is (128, 64)
        dict(head_dim=8, num_key_value_heads=4),  # narrower
        dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        dict(rope_parameters={**LLAMA3, "original_max_position_embeddings": 64}),
        dict(rms_norm_eps=1e-2),
    ],
    ids=["tied", "untied", "gqa", "mqa", "head-dim-wide", "head-dim-narrow", "rope-theta", "rope-linear",
         "rope-llama3", "rms-norm-eps"],
)
def test_llama_variants_match_transformers(tmp_path, config):
    assert_matches_transformers(save_hf_llama(tmp_path / "m", **config))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_weight_dtypes_match_transformers(tmp_path, dtype):
    assert_matches_transformers(save_hf_llama(tmp_path / "m", dtype=dtype))


def test_sharded_safetensors_with_index_match_transformers(tmp_path):
    folder = save_hf_llama(tmp_path / "m", save_kw={"max_shard_size": "40KB"})
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    assert_matches_transformers(folder)


def test_legacy_rope_scaling_keys_match_transformers(tmp_path):
    """A transformers 4 config.json: rope_theta at the top, the scaling under rope_scaling with 'type'."""
    folder = save_hf_llama(tmp_path / "m")
    edit_config(folder, rope_parameters=None, rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    assert LlamaConfig.from_folder(folder).rope.theta == 5000.0
    assert_matches_transformers(folder)


def test_llama3_rope_without_original_length_uses_max_position_embeddings(tmp_path):
    """transformers fills a missing original_max_position_embeddings of llama3 RoPE with
    max_position_embeddings (not Llama-3.1's 8192), which moves the frequency bands."""
    folder = save_hf_llama(tmp_path / "m")
    edit_config(folder, rope_parameters=None, rope_theta=10000.0, rope_scaling=LLAMA3)
    assert LlamaConfig.from_folder(folder).rope.original_max_position_embeddings == TINY["max_position_embeddings"]
    assert_matches_transformers(folder)


def test_llama3_rope_prefers_a_top_level_original_length(tmp_path):
    """transformers takes a top-level original_max_position_embeddings over the one in the RoPE
    parameters (a Phi-3 convention it applies to every model)."""
    folder = save_hf_llama(tmp_path / "m", rope_parameters={**LLAMA3, "original_max_position_embeddings": 64})
    edit_config(folder, original_max_position_embeddings=32)
    assert LlamaConfig.from_folder(folder).rope.original_max_position_embeddings == 32
    assert_matches_transformers(folder)


# ---------------------------------------------------------------- refused at load time, naming the feature

@pytest.mark.parametrize(
    "config,feature",
    [
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "dynamic"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": 64}), "yarn"),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0] * 8,
                               "short_factor": [1.0] * 8, "original_max_position_embeddings": 64}), "longrope"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(mlp_bias=True), "mlp_bias"),
    ],
    ids=["rope-dynamic", "rope-yarn", "rope-longrope", "attention-bias", "mlp-bias"],
)
def test_unsupported_llama_features_are_refused(tmp_path, config, feature):
    folder = save_hf_llama(tmp_path / "m", **config)
    with pytest.raises(CheckpointError, match=feature):
        HfCheckpoint(folder)


@pytest.mark.parametrize("where", ["top-level", "rope-parameters"])
def test_partial_rotary_factor_is_refused(tmp_path, where):
    """Llama rotates whole heads: transformers ignores partial_rotary_factor for default RoPE and
    fails on it for scaled RoPE. A checkpoint that carries one was trained otherwise: refuse it."""
    folder = save_hf_llama(tmp_path / "m")
    if where == "top-level":
        edit_config(folder, partial_rotary_factor=0.5)
    else:
        edit_config(folder, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with pytest.raises(CheckpointError, match="partial_rotary_factor"):
        HfCheckpoint(folder)


def test_full_partial_rotary_factor_is_accepted(tmp_path):
    folder = edit_config(save_hf_llama(tmp_path / "m"), partial_rotary_factor=1.0)
    assert_matches_transformers(folder)


def test_other_model_type_with_llama_architecture_is_refused(tmp_path):
    """transformers builds the class of model_type (here Mistral, with its sliding window), whatever
    architectures says: a folder is Llama only if model_type is."""
    folder = edit_config(save_hf_llama(tmp_path / "m"), model_type="mistral", sliding_window=16)
    with pytest.raises(CheckpointError, match="model_type='mistral'"):
        HfCheckpoint(folder)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_families_are_refused(tmp_path, family):
    """Mistral (sliding window) and Qwen2 (q/k/v biases) checkpoints, as transformers writes them."""
    config_cls = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[family]
    model_cls = {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[family]
    model_cls(config_cls(**TINY)).save_pretrained(tmp_path / "m")
    with pytest.raises(CheckpointError, match=f"model_type='{family}'"):
        HfCheckpoint(tmp_path / "m")


def _to_fp8(folder: Path) -> None:
    """Projections in float8_e4m3fn with a per-tensor scale beside them, as FP8 checkpoints store them."""
    tensors = load_file(str(folder / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        scale = tensors[name].float().abs().amax() / 448
        tensors[name] = (tensors[name].float() / scale).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale")] = scale.reshape(1)
    save_file(tensors, str(folder / "model.safetensors"))


def test_prequantized_checkpoint_is_refused(tmp_path):
    """The weights are codes that mean something only with their scales: read as plain floats they
    would quantize and serve as garbage."""
    folder = save_hf_llama(tmp_path / "m")
    _to_fp8(folder)
    edit_config(folder, quantization_config={"quant_method": "fbgemm_fp8"})
    with pytest.raises(CheckpointError, match="quantization_config"):
        LlamaConfig.from_folder(folder)


def test_non_float_weights_are_refused_at_load(tmp_path):
    """The same codes without a quantization_config: refused from the tensors' dtype, before any is read."""
    folder = save_hf_llama(tmp_path / "m")
    _to_fp8(folder)
    with pytest.raises(CheckpointError, match="q_proj.weight is stored as F8_E4M3"):
        HfCheckpoint(folder)


def test_pytorch_bin_only_checkpoint_is_refused(tmp_path):
    folder = save_hf_llama(tmp_path / "m")
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="only safetensors checkpoints are supported"):
        HfCheckpoint(folder)


def test_a_tied_checkpoint_holding_a_different_head_is_refused(tmp_path):
    """tie_word_embeddings true beside a stored lm_head.weight of its own: transformers 5 runs that head, the
    reference ran the embeddings (logits unrelated to the model's). Refused; a stored head equal to the
    embeddings (some exporters write both) loads."""
    folder = save_hf_llama(tmp_path / "m", tie_word_embeddings=False)
    edit_config(folder, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="ties the word embeddings .* lm_head.weight that differs"):
        HfCheckpoint(folder).lm_head()
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    checkpoint = HfCheckpoint(folder)
    assert torch.equal(checkpoint.lm_head(), checkpoint.embed_tokens())

"""config.json is user input: a value of the wrong type or range is refused by name (CheckpointError),
not left to fail deep in the arithmetic (TypeError, ZeroDivisionError) or, worse, later inside a job."""

from __future__ import annotations

import json
import re

import pytest

from shared.model.config import CheckpointError, LlamaConfig
from shared.model.rope import inverse_frequencies

BASE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@pytest.mark.parametrize("key, value, named", [
    ("hidden_size", "64", "hidden_size='64'"),
    ("num_attention_heads", 0, "num_attention_heads=0"),
    ("num_attention_heads", None, "num_attention_heads=None"),
    ("vocab_size", "256", "vocab_size='256'"),
    ("num_hidden_layers", 2.5, "num_hidden_layers=2.5"),
    ("intermediate_size", -128, "intermediate_size=-128"),
    ("num_key_value_heads", True, "num_key_value_heads=True"),
    ("max_position_embeddings", 0, "max_position_embeddings=0"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps='1e-6'"),
])
def test_a_value_of_the_wrong_type_or_range_is_refused_by_name(key, value, named):
    with pytest.raises(CheckpointError, match=f"^{named.replace('.', '[.]')} must be a positive"):
        LlamaConfig.from_hf({**BASE, key: value})


def test_a_valid_config_still_loads():
    config = LlamaConfig.from_hf(BASE)
    assert (config.head_dim, config.group_size, config.num_layers) == (16, 2, 2)


@pytest.mark.parametrize("value", ["false", 0, 1])
def test_tie_word_embeddings_must_be_a_boolean(value):
    """A string "false" was truthy: the head read from the embedding table, a model answering garbage."""
    with pytest.raises(CheckpointError, match=f"^tie_word_embeddings={value!r} must be true or false"):
        LlamaConfig.from_hf({**BASE, "tie_word_embeddings": value})
    with pytest.raises(CheckpointError, match="tie_word_embeddings"):
        LlamaConfig.from_dict({**LlamaConfig.from_hf(BASE).to_dict(), "tie_word_embeddings": value})
    assert LlamaConfig.from_hf({**BASE, "tie_word_embeddings": None}).tie_word_embeddings is False
    assert LlamaConfig.from_hf({**BASE, "tie_word_embeddings": True}).tie_word_embeddings is True


def test_a_config_json_that_is_not_utf8_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "llama", "x": "\xff"}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LlamaConfig.from_folder(tmp_path)


@pytest.mark.parametrize("key, value, named", [
    # A null was a TypeError from float(None) / int(None): a traceback in qctl instead of one line.
    ("rope_theta", None, "rope_theta=None must be a positive number"),
    ("rope_theta", "abc", "rope_theta='abc' must be a positive number"),
    ("max_position_embeddings", None, "max_position_embeddings=None must be a positive integer"),
    ("rope_scaling", {"rope_type": "linear", "factor": None}, "rope_scaling.factor=None must be a positive number"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": None},
     "rope_parameters.rope_theta=None must be a positive number"),
    ("rope_scaling", 4, "rope_scaling=4 must be a JSON object or null"),
    ("rope_scaling", ["linear", 2.0], "rope_scaling=['linear', 2.0] must be a JSON object or null"),
    ("rope_scaling", "linear", "rope_scaling='linear' must be a JSON object or null"),
    ("rope_parameters", 10000.0, "rope_parameters=10000.0 must be a JSON object or null"),
])
def test_a_null_or_non_object_rope_value_is_refused_by_name(key, value, named):
    with pytest.raises(CheckpointError, match=re.escape(named)):
        LlamaConfig.from_hf({**BASE, key: value})


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("key, value, named", [
    # Each of these gave inf or NaN inverse frequencies, and a model that answered garbage without an error.
    ("rope_theta", 0, "rope_theta=0.0 must be a positive number"),
    ("rope_theta", -1.0, "rope_theta=-1.0 must be a positive number"),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}, "factor=0.0 must be a positive number"),
    ("rope_scaling", {"rope_type": "linear", "factor": -2.0}, "factor=-2.0 must be a positive number"),
    ("rope_scaling", {**LLAMA3, "factor": 0.0}, "factor=0.0 must be a positive number"),
    ("rope_scaling", {**LLAMA3, "original_max_position_embeddings": 0},
     "original_max_position_embeddings=0 must be a positive integer"),
    ("rope_scaling", {**LLAMA3, "low_freq_factor": 0.0}, "low_freq_factor=0.0 must be a positive number"),
    ("rope_scaling", {**LLAMA3, "low_freq_factor": 4.0}, "high_freq_factor=4.0 must be greater than low_freq_factor=4.0"),
    ("rope_scaling", {**LLAMA3, "high_freq_factor": 0.5}, "high_freq_factor=0.5 must be greater than low_freq_factor=1.0"),
])
def test_a_rope_value_out_of_range_is_refused_by_name(key, value, named):
    with pytest.raises(CheckpointError, match=re.escape(named)):
        LlamaConfig.from_hf({**BASE, key: value})


@pytest.mark.parametrize("extra", [
    {"rope_scaling": None},  # null: no scaling, as transformers reads it
    {"rope_parameters": None, "rope_theta": 500000.0},
    {"rope_theta": 500000.0, "rope_scaling": LLAMA3},  # Llama-3.1
    {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},  # Llama-3.1 as transformers >= 5 writes it
    {"rope_theta": 500000.0, "max_position_embeddings": 8192},  # Llama-3: plain RoPE
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
])
def test_valid_rope_configs_still_load_with_finite_frequencies(extra):
    config = LlamaConfig.from_hf({**BASE, **extra})
    inv_freq = inverse_frequencies(config.rope, config.head_dim)
    assert inv_freq.isfinite().all() and (inv_freq > 0).all()


def test_an_artifact_manifest_with_a_bad_rope_is_refused_too():
    """from_dict (a manifest's model_config) builds RopeConfig directly: the same checks hold there."""
    d = LlamaConfig.from_hf(BASE).to_dict()
    d["rope"]["theta"] = 0.0
    with pytest.raises(CheckpointError, match="rope_theta=0.0 must be a positive number"):
        LlamaConfig.from_dict(d)


@pytest.mark.parametrize("key, value, named", [
    # Each was a TypeError (iterating a number or a null, joining an int key): a worker's traceback at start-up.
    ("eos_token_ids", 5, "model_config.eos_token_ids=5 must be a list"),
    ("rope", None, "model_config.rope=None must be an object"),
    ("rope", [1], "model_config.rope=[1] must be an object"),
])
def test_a_manifest_model_config_field_of_the_wrong_json_type_is_refused_by_name(key, value, named):
    d = json.loads(json.dumps(LlamaConfig.from_hf(BASE).to_dict()))  # as a manifest holds it
    d[key] = value
    with pytest.raises(CheckpointError, match=re.escape(named)):
        LlamaConfig.from_dict(d)


@pytest.mark.parametrize("key, value, named", [
    # A negative BOS id passed the start-up checks (they feed token ids) and failed every text prompt once the
    # worker served; a string one was a TypeError.
    ("bos_token_id", -1, "bos_token_id -1 is not a token id of the vocabulary [0, 256)"),
    ("bos_token_id", 256, "bos_token_id 256 is not a token id"),
    ("bos_token_id", "1", "bos_token_id '1' is not a token id"),
    ("bos_token_id", True, "bos_token_id True is not a token id"),
    ("eos_token_ids", [2, -1], "eos_token_ids entry -1 is not a token id"),
    ("eos_token_ids", [256], "eos_token_ids entry 256 is not a token id"),
    ("eos_token_ids", [2.0], "eos_token_ids entry 2.0 is not a token id"),
])
def test_a_token_id_outside_the_vocabulary_is_refused_by_name(key, value, named):
    d = LlamaConfig.from_hf(BASE).to_dict()
    d[key] = value
    with pytest.raises(CheckpointError, match=re.escape(named)):
        LlamaConfig.from_dict(d)
    hf_key = {"eos_token_ids": "eos_token_id"}.get(key, key)  # config.json's name
    with pytest.raises(CheckpointError, match="is not a token id"):
        LlamaConfig.from_hf({**BASE, hf_key: value})


def test_token_ids_inside_the_vocabulary_still_load():
    config = LlamaConfig.from_hf({**BASE, "bos_token_id": 0, "eos_token_id": [1, 255]})
    assert (config.bos_token_id, config.eos_token_ids) == (0, (1, 255))
    assert LlamaConfig.from_dict(config.to_dict()) == config


def test_rope_given_twice_and_differently_is_refused():
    """rope_parameters (transformers 5) beside a legacy rope_scaling that says otherwise: transformers 5 runs
    rope_scaling whole, a merge ran rope_parameters' entries: quantized and served with another RoPE than the
    model's, no error. Refused, naming both; given twice the same way, it loads."""
    both = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "rope_scaling": {"type": "linear", "factor": 4.0}}
    with pytest.raises(CheckpointError, match="gives RoPE twice, and differently: rope_parameters=.* rope_scaling="):
        LlamaConfig.from_hf({**BASE, **both})
    same = {"rope_theta": 500000.0, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "rope_scaling": LLAMA3}
    rope = LlamaConfig.from_hf({**BASE, **same}).rope
    assert (rope.type, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)

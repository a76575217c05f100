"""config.json is user input: a value of the wrong type or range is refused by name (CheckpointError),
not left to fail deep in the arithmetic (TypeError, ZeroDivisionError) or, worse, later inside a job."""

from __future__ import annotations

import json

import pytest

from shared.model.config import CheckpointError, LlamaConfig

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


def test_a_config_json_that_is_not_utf8_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_bytes(b'{"model_type": "llama", "x": "\xff"}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LlamaConfig.from_folder(tmp_path)

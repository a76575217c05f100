"""A checkpoint folder without tokenizer.json: its tokenizer goes through transformers, which reads
tokenizer.model only with the sentencepiece package (no dependency of ours) and builds an empty tokenizer
from a lone tokenizer_config.json. Both are refused in one line that says what to add."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from shared.model.config import CheckpointError
from shared.model.tokenizer import Tokenizer
from tests.conftest import TINY_LLAMA


def _write_sentencepiece_model(folder):
    """A tiny BPE tokenizer.model (+ a Llama-2 tokenizer_config.json), as Llama-2-era fine-tunes ship."""
    from transformers.utils import sentencepiece_model_pb2_new as pb

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = 8
    for piece, kind in [("<unk>", 2), ("<s>", 3), ("</s>", 3), ("\u2581", 1), ("a", 1), ("b", 1), ("\u2581a", 1)]:
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, 0.0, kind
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(m.SerializeToString())
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
                                                              "eos_token": "</s>", "unk_token": "<unk>"}))


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is not None, reason="sentencepiece is installed")
def test_a_sentencepiece_only_tokenizer_says_what_is_needed(tmp_path):
    """Was transformers' ValueError "`tiktoken` is required to read a `tiktoken` file", after a log of five lines."""
    _write_sentencepiece_model(tmp_path / "m")
    with pytest.raises(CheckpointError) as e:
        Tokenizer(tmp_path / "m")
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "m") in message
    assert "tokenizer.model (SentencePiece)" in message and "install the sentencepiece package" in message
    assert "tokenizer.json" in message and "tiktoken" not in message


@pytest.mark.parametrize("config", [{"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}, None],
                         ids=["llama-class", "fixture-config"])
def test_a_lone_tokenizer_config_is_refused_in_one_line(tmp_path, config):
    """With the Llama class, transformers built a tokenizer that encoded every text to []; with the fixture's
    config, its error was eight lines long."""
    folder = tmp_path / "m"
    folder.mkdir()
    if config is None:
        shutil.copy(TINY_LLAMA / "tokenizer_config.json", folder)
    else:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        Tokenizer(folder)
    assert "\n" not in str(e.value) and str(folder) in str(e.value)


def test_a_checkpoints_tokenizer_json_still_loads():
    assert Tokenizer(TINY_LLAMA).encode("def main():")

"""What a served prompt looks like to the model: BOS in front where the checkpoint's tokenizer puts it
(transformers' tokenizer(prompt)), and the end-of-sequence ids of generation_config.json."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import models, pre_tokenizers, processors

from shared.model.config import CheckpointError
from shared.model.tokenizer import Tokenizer, generation_eos_ids, prompt_adds_bos

BOS = 1


def write_tokenizer(folder, *, template_bos: bool, config: dict | None = None):
    """A word-level tokenizer.json whose post-processor adds BOS or not (Llama-3's adds it there)."""
    vocab = {"<unk>": 0, "<s>": BOS, "</s>": 2, "a": 3, "b": 4}
    tok = FastTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if template_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer(folder)


def test_a_template_that_adds_bos_gets_bos_without_a_config_saying_so(tmp_path):
    """Llama-3: tokenizer_config.json has no add_bos_token; tokenizer.json's template adds it."""
    tok = write_tokenizer(tmp_path, template_bos=True, config={"bos_token": "<s>"})
    assert tok.encode("a b") == [3, 4]  # plain encode never adds it (eval windows, calibration)
    assert prompt_adds_bos(tmp_path, tok, BOS)


@pytest.mark.parametrize("template_bos, config, expected", [
    (False, None, False),                         # no template, no config (the fixture's tokenizer)
    (False, {"add_bos_token": True}, True),       # Llama-2: the config says so
    (True, {"add_bos_token": False}, False),      # the config's explicit word wins, as in transformers
])
def test_the_config_decides_where_it_speaks(tmp_path, template_bos, config, expected):
    tok = write_tokenizer(tmp_path, template_bos=template_bos, config=config)
    assert prompt_adds_bos(tmp_path, tok, BOS) is expected


def test_no_bos_id_means_no_bos(tmp_path):
    tok = write_tokenizer(tmp_path, template_bos=True)
    assert not prompt_adds_bos(tmp_path, tok, None)


@pytest.mark.parametrize("content, expected", [
    ({"eos_token_id": [128001, 128008, 128009]}, (128001, 128008, 128009)),
    ({"eos_token_id": 2}, (2,)),
    ({"bos_token_id": 1}, ()),
    (None, ()),
])
def test_generation_config_eos_ids(tmp_path, content, expected):
    if content is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(content))
    assert generation_eos_ids(tmp_path) == expected


def test_an_unreadable_generation_config_is_named(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="generation_config.json is not readable JSON"):
        generation_eos_ids(tmp_path)


def test_the_vocabulary_digest_follows_the_id_to_token_table_only(tmp_path):
    """Same ids for the same tokens: the same digest, whatever else the files say (a template, a config);
    a token added (a fine-tune's special token) or an id moved: another digest."""
    plain = write_tokenizer(tmp_path / "plain", template_bos=False)
    templated = write_tokenizer(tmp_path / "templated", template_bos=True, config={"chat_template": "{{ x }}"})
    assert plain.vocabulary_digest() == templated.vocabulary_digest()
    assert len(plain.vocabulary_digest()) == 64
    added = FastTokenizer.from_file(str(tmp_path / "plain" / "tokenizer.json"))
    added.add_special_tokens(["<|tool|>"])
    (tmp_path / "added").mkdir()
    added.save(str(tmp_path / "added" / "tokenizer.json"))
    assert Tokenizer(tmp_path / "added").vocabulary_digest() != plain.vocabulary_digest()
    moved = FastTokenizer(models.WordLevel({"<unk>": 0, "<s>": BOS, "</s>": 2, "b": 3, "a": 4}, unk_token="<unk>"))
    (tmp_path / "moved").mkdir()
    moved.save(str(tmp_path / "moved" / "tokenizer.json"))
    assert Tokenizer(tmp_path / "moved").vocabulary_digest() != plain.vocabulary_digest()

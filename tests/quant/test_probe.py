"""The artifact's probe (shared/formats/probe.py): quantize_checkpoint writes the reference logits of the
weights as written, computed one block at a time, for the worker's start-up check."""

from __future__ import annotations

import json

import pytest
import torch

from shared.formats.artifact import ArtifactError, ArtifactReader
from shared.formats.probe import DECODE_TOKENS, PROBE_FILE, PROMPT_TOKENS, probe_token_ids
from shared.model.load import artifact_model
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from tests.conftest import write_random_llama


@pytest.mark.parametrize("fmt", ["w4a8kv4-g128", "fp16"])
def test_the_probe_holds_the_reference_logits_of_the_written_weights(tmp_path, fmt):
    model = write_random_llama(tmp_path / "m")
    quantize_checkpoint(QuantizeSettings(model, tmp_path / "a", fmt, options=QoQOptions.rtn()))
    reader = ArtifactReader(tmp_path / "a")  # verified: the probe file is listed with its sha256
    assert PROBE_FILE in {f.path for f in reader.manifest.files}
    probe = reader.probe()
    vocab = reader.manifest.model_config["vocab_size"]
    assert (len(probe.prompt_ids), len(probe.decode_ids)) == (PROMPT_TOKENS, DECODE_TOKENS)
    assert probe.token_ids == probe_token_ids(vocab, PROMPT_TOKENS + DECODE_TOKENS)
    assert probe.logits.shape == (DECODE_TOKENS + 1, vocab)
    logits = artifact_model(reader).forward(torch.tensor([probe.token_ids]))[0]
    assert max(probe.errors(logits[PROMPT_TOKENS - 1:])) == 0.0  # streamed block by block, the same numbers


def test_a_model_with_a_short_context_gets_a_shorter_probe(tmp_path):
    model = write_random_llama(tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 12
    (model / "config.json").write_text(json.dumps(config))
    quantize_checkpoint(QuantizeSettings(model, tmp_path / "a", "fp16"))
    probe = ArtifactReader(tmp_path / "a").probe()
    assert (len(probe.prompt_ids), len(probe.decode_ids), probe.logits.shape[0]) == (4, DECODE_TOKENS, DECODE_TOKENS + 1)


def test_an_unreadable_probe_is_an_artifact_error(tmp_path):
    model = write_random_llama(tmp_path / "m")
    quantize_checkpoint(QuantizeSettings(model, tmp_path / "a", "fp16"))
    (tmp_path / "a" / PROBE_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ArtifactError, match=f"unreadable {PROBE_FILE}"):
        ArtifactReader(tmp_path / "a", verify=False).probe()

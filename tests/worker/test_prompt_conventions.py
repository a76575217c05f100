"""A served artifact stops on generation_config.json's end-of-sequence ids as well as config.json's, and
gives text prompts BOS first where its tokenizer's template does (Llama-3's tokenizer_config.json is silent
about it). Either missing makes a served model answer worse than transformers does with the same weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest

from services.worker.config import WorkerConfig
from services.worker.errors import ArtifactCorrupt
from services.worker.serving import load_served_model
from shared.storage.hashing import sha256_file


@pytest.fixture
def artifact_copy(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["fp16"], tmp_path / "artifact"))


def _rewrite(folder: Path, relpath: str, content: str) -> None:
    """Writes a tokenizer-side file and lists its size and sha256 in the manifest, as a quantizer would."""
    (folder / relpath).write_text(content)
    size, digest = sha256_file(folder / relpath)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != relpath]
    manifest["files"].append({"path": relpath, "sha256": digest, "size": size})
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _served(folder: Path):
    return load_served_model(WorkerConfig(artifact=str(folder), kv_blocks=8, block_size=4, metrics_port=None))


def test_generation_config_eos_ids_end_generations_too(artifact_copy):
    config_eos = json.loads((artifact_copy / "manifest.json").read_text())["model_config"]["eos_token_ids"]
    _rewrite(artifact_copy, "tokenizer/generation_config.json", json.dumps({"eos_token_id": [7, *config_eos, 9]}))
    served = _served(artifact_copy)
    assert served.engine.eos_token_ids == frozenset({*config_eos, 7, 9})


def test_a_tokenizer_template_adding_bos_gives_prompts_bos(artifact_copy):
    served = _served(artifact_copy)
    assert not served.add_bos  # the fixture's template adds nothing
    tokenizer = json.loads((artifact_copy / "tokenizer/tokenizer.json").read_text())
    bos = served.bos_token_id
    token = next(t for t, i in tokenizer["model"]["vocab"].items() if i == bos)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {token: {"id": token, "ids": [bos], "tokens": [token]}},
    }
    _rewrite(artifact_copy, "tokenizer/tokenizer.json", json.dumps(tokenizer))
    assert _served(artifact_copy).add_bos


def test_an_unreadable_generation_config_is_one_artifact_error(artifact_copy):
    _rewrite(artifact_copy, "tokenizer/generation_config.json", "{not json")
    with pytest.raises(ArtifactCorrupt, match="generation_config.json is not readable JSON") as err:
        _served(artifact_copy)
    assert err.value.code == grpc.StatusCode.DATA_LOSS

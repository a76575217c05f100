"""Every byte a worker loads is covered by the manifest's sha256 list, and the tensors must have the
shapes the manifest's model_config says: otherwise the artifact is refused before serving."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.config import WorkerConfig
from services.worker.engine.loading import open_artifact
from services.worker.errors import ArtifactCorrupt
from services.worker.server import main
from services.worker.serving import load_served_model
from shared.formats.artifact import ArtifactReader
from shared.storage.hashing import sha256_file


@pytest.fixture
def artifact_copy(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["w4a8kv4-g128"], tmp_path / "artifact"))


def _edit_manifest(folder: Path, edit) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _unlist(folder: Path, relpath: str) -> None:
    _edit_manifest(folder, lambda m: m.update(files=[f for f in m["files"] if f["path"] != relpath]))


def test_a_weights_file_the_manifest_does_not_list_is_refused(artifact_copy):
    """A valid but altered weights file whose sha256 entry was dropped must not load unchecked."""
    relpath = "weights/block_001.safetensors"
    tensors = load_file(str(artifact_copy / relpath))
    tensors["attn_norm"] = tensors["attn_norm"] * 2
    save_file(tensors, str(artifact_copy / relpath))
    _unlist(artifact_copy, relpath)
    with pytest.raises(ArtifactCorrupt) as err:
        open_artifact(str(artifact_copy), gpu_target="cpu")
    assert relpath in str(err.value)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


def test_a_tokenizer_file_the_manifest_does_not_list_is_refused(artifact_copy):
    relpath = next(p for p in sorted((artifact_copy / "tokenizer").iterdir())).relative_to(artifact_copy).as_posix()
    _unlist(artifact_copy, relpath)
    with pytest.raises(ArtifactCorrupt, match=relpath):
        open_artifact(str(artifact_copy), gpu_target="cpu")


def test_a_listed_weights_file_that_is_not_safetensors_is_a_one_line_data_loss_refusal(artifact_copy, capsys):
    """Truncated to nothing and re-signed (listed with its true size and sha256, which the file checks pass):
    safetensors' own error escaped, and the worker command died with a traceback and exit 1."""
    relpath = "weights/block_000.safetensors"
    (artifact_copy / relpath).write_bytes(b"")
    size, digest = sha256_file(artifact_copy / relpath)
    _edit_manifest(artifact_copy, lambda m: next(f for f in m["files"] if f["path"] == relpath).update(
        size=size, sha256=digest))
    assert main(["--artifact", str(artifact_copy), "--port", "0", "--metrics-port", "-1", "--kv-blocks", "8"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error (DATA_LOSS):") and f"{relpath} is not a readable safetensors file" in line


def test_a_model_config_with_fewer_layers_than_the_weights_is_refused(artifact_copy):
    """num_layers=1 over a 6-block artifact would serve a truncated model (garbage) without error."""
    _edit_manifest(artifact_copy, lambda m: m["model_config"].update(num_layers=1))
    with pytest.raises(ArtifactCorrupt, match="num_layers"):
        open_artifact(str(artifact_copy), gpu_target="cpu")


def test_a_manifest_path_outside_the_folder_is_refused(artifact_copy):
    def add_escape(m):
        m["files"].append({"path": "../outside.bin", "sha256": "0" * 64, "size": 0})

    (artifact_copy.parent / "outside.bin").write_bytes(b"")
    _edit_manifest(artifact_copy, add_escape)
    with pytest.raises(ArtifactCorrupt, match="outside.bin"):
        open_artifact(str(artifact_copy), gpu_target="cpu")


@pytest.mark.parametrize("field, factor", [("intermediate_size", 2), ("hidden_size", 2), ("vocab_size", 2)])
def test_weights_of_another_shape_than_the_model_config_are_refused_at_start(artifact_copy, field, factor):
    """The GPU runner sizes its buffers from model_config: tensors of other shapes must be refused
    at start-up (a clear DATA_LOSS error), not run."""
    _edit_manifest(artifact_copy, lambda m: m["model_config"].update({field: m["model_config"][field] * factor}))
    config = WorkerConfig(artifact=str(artifact_copy), kv_blocks=8, block_size=4, metrics_port=None)
    with pytest.raises(ArtifactCorrupt, match="model_config") as err:
        load_served_model(config)
    assert err.value.code == grpc.StatusCode.DATA_LOSS


class _StandInTritonRunner:
    """What the GPU runner's constructor does first with the artifact (its config, then its weights), on the
    CPU: a host without a GPU runs the GPU path's error handling."""

    SUPPORTED_FORMATS = ("w4a8kv4-g128", "w4a8kv4-chn", "fp16")

    def __init__(self, reader, device, block_size, settings):
        from services.worker.engine.gpu_weights import load_weights
        from shared.model.config import LlamaConfig

        self.config = LlamaConfig.from_dict(reader.manifest.model_config)
        self.weights = load_weights(reader, torch.device("cpu"))


@pytest.mark.parametrize("field, factor", [("intermediate_size", 2), ("hidden_size", 2), ("head_dim", None)])
def test_a_corrupt_artifact_on_the_gpu_path_is_data_loss_not_a_mismatch(artifact_copy, monkeypatch, field, factor):
    """The GPU runner's ValueErrors name a format or shape it cannot run (FAILED_PRECONDITION); an ArtifactError
    or CheckpointError (also ValueErrors) from its constructor is the artifact's fault, as on the CPU."""
    from services.worker.engine import loading

    new = (lambda v: v * factor) if factor else (lambda v: 127)  # head_dim 127: no Llama has it
    _edit_manifest(artifact_copy, lambda m: m["model_config"].update({field: new(m["model_config"].get(field, 0))}))
    runner_module = types.ModuleType("stand_in_triton_runner")
    runner_module.TritonRunner = _StandInTritonRunner
    runner_module.TritonRunnerSettings = lambda **options: options
    monkeypatch.setitem(sys.modules, runner_module.__name__, runner_module)
    monkeypatch.setattr(loading, "TRITON_RUNNER_MODULE", runner_module.__name__)
    reader = ArtifactReader(artifact_copy)  # every listed file matches: manifest.json is not in its own list
    with pytest.raises(ArtifactCorrupt) as err:
        loading.load_runner(reader, torch.device("cuda"), 16, max_batch_tokens=512)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert reader.manifest.artifact_id in str(err.value)

"""An artifact whose manifest the model cannot run is refused at start-up as the artifact's fault
(ArtifactCorrupt, DATA_LOSS; the command says so in one line and exits 2), before any traffic: a
model_config no Llama can have, and text prompts that would begin with a BOS id past the vocabulary.
A start that fails gives back the ports it took."""

from __future__ import annotations

import json
import re
import shutil
import socket
from pathlib import Path

import grpc
import pytest

from services.worker.config import WorkerConfig
from services.worker.errors import ArtifactCorrupt
from services.worker.server import main
from services.worker.serving import load_served_model
from tests.worker.test_prompt_conventions import _rewrite


@pytest.fixture
def artifact_copy(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["fp16"], tmp_path / "artifact"))


def _edit_model_config(folder: Path, **changes) -> None:
    # manifest.json is not in its own file list: the edit passes every file's sha256 check.
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["model_config"].update(changes)
    path.write_text(json.dumps(manifest))


def _load(folder: Path):
    return load_served_model(WorkerConfig(artifact=str(folder), kv_blocks=8, block_size=4, metrics_port=None))


def test_a_model_config_no_llama_can_have_is_an_artifact_refusal(artifact_copy, capsys):
    """It was a bare CheckpointError: the worker command died with a traceback instead of its one-line
    refusal, and an embedder catching ArtifactRefused (WorkerError) missed it."""
    _edit_model_config(artifact_copy, head_dim=127)
    with pytest.raises(ArtifactCorrupt, match="head_dim=127 must be even") as err:
        _load(artifact_copy)
    assert err.value.code == grpc.StatusCode.DATA_LOSS
    assert main(["--artifact", str(artifact_copy), "--port", "0", "--metrics-port", "-1", "--kv-blocks", "8"]) == 2
    assert "error (DATA_LOSS)" in capsys.readouterr().err


def test_text_prompts_that_would_begin_outside_the_vocabulary_are_refused_at_start_up(artifact_copy):
    """The worker served, and refused (or, before the per-request check, failed with their whole batch)
    every text prompt. A negative BOS id passed even the start-up check, and every text prompt then failed
    in the detokenizer (gRPC UNKNOWN)."""
    _rewrite(artifact_copy, "tokenizer/tokenizer_config.json", json.dumps({"add_bos_token": True}))
    vocab = json.loads((artifact_copy / "manifest.json").read_text())["model_config"]["vocab_size"]
    for bos in (vocab + 10, -1):
        _edit_model_config(artifact_copy, bos_token_id=bos)
        with pytest.raises(ArtifactCorrupt, match=re.escape(f"bos_token_id {bos} is not a token id of the "
                                                            f"vocabulary [0, {vocab})")):
            _load(artifact_copy)
    _edit_model_config(artifact_copy, bos_token_id=vocab - 1)  # inside the vocabulary: served, BOS first
    assert _load(artifact_copy).add_bos


def test_a_start_that_fails_on_the_metrics_port_releases_the_grpc_port(artifacts):
    """The gRPC port was bound before the metrics port was opened: a start that failed on the latter left
    the former bound, and accepting connections, in the embedding process (`qctl up`, a test run), so a
    second start on the same ports failed on the gRPC port too."""
    from services.worker.config import ConfigError
    from services.worker.server import BackgroundWorker

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_port = probe.getsockname()[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = WorkerConfig(artifact=str(artifacts["fp16"]), host="127.0.0.1", port=grpc_port,
                              metrics_port=taken.getsockname()[1], kv_blocks=16, block_size=4)
        with pytest.raises(ConfigError, match="--metrics-port"):
            BackgroundWorker(config)
    with socket.socket() as again:
        again.bind(("127.0.0.1", grpc_port))  # raised EADDRINUSE: the failed worker still held it


def test_a_model_config_key_this_version_does_not_know_is_refused_by_name(artifact_copy):
    """A newer quantizer's manifest key made LlamaConfig(**d) raise a bare TypeError: a traceback at
    start-up instead of the one-line refusal naming the key."""
    _edit_model_config(artifact_copy, sliding_window=4096)
    with pytest.raises(ArtifactCorrupt, match="keys this version does not know: sliding_window"):
        _load(artifact_copy)
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    del manifest["model_config"]["sliding_window"], manifest["model_config"]["hidden_size"]
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactCorrupt, match="model_config lacks hidden_size"):
        _load(artifact_copy)


def test_an_artifact_whose_logits_are_not_finite_fails_the_start_up_self_check(artifact_copy, capsys):
    """Its files pass every sha256 check (the manifest lists the poisoned file's own), so it loaded,
    registered and answered every request with garbage (or, sampled, failed the batch)."""
    from bench.self_check_gpu import poison_final_norm
    from services.worker.errors import ArtifactBroken

    poison_final_norm(artifact_copy)
    with pytest.raises(ArtifactBroken, match="failed the start-up self-check .*non-finite logits") as err:
        _load(artifact_copy)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert main(["--artifact", str(artifact_copy), "--port", "0", "--metrics-port", "-1", "--kv-blocks", "8"]) == 2
    assert "start-up self-check" in capsys.readouterr().err


def test_a_context_window_shorter_than_the_self_check_still_starts(artifact_copy):
    """The self-check's prompt shrinks to the window (here 8 KV-cache tokens: a 4-token prompt, 4 new)."""
    served = load_served_model(WorkerConfig(artifact=str(artifact_copy), kv_blocks=2, block_size=4, metrics_port=None))
    assert served.engine.limits.max_context == 8 and served.engine.num_in_flight == 0


def test_a_cache_of_fewer_than_two_tokens_is_refused_at_start_up(artifacts):
    """--max-context-tokens 1 is refused; the same window reached through the cache's size was served: a worker
    that announced itself and refused every request (INVALID_ARGUMENT, the client's fault to the gateway)."""
    from services.worker.config import ConfigError

    with pytest.raises(ConfigError, match=r"the KV cache holds 1 token\(s\) \(1 blocks of 1\).*raise --kv-blocks"):
        load_served_model(WorkerConfig(artifact=str(artifacts["fp16"]), kv_blocks=1, block_size=1, metrics_port=None))

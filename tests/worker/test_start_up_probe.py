"""The start-up probe (services/worker/probe_check.py): a worker whose logits for the artifact's probe tokens
differ from the quantizer's reference logits is refused before it serves; the NaN self-check passes finite
numbers, however wrong."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.config import ConfigError, WorkerConfig
from services.worker.errors import ArtifactBroken, ArtifactCorrupt
from services.worker.serving import load_served_model
from shared.formats.probe import PROBE_FILE
from shared.storage.hashing import sha256_file

BLOCKS = [f"weights/block_{i:03d}.safetensors" for i in range(6)]  # the tiny fixture's layers


@pytest.fixture
def artifact_copy(artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(artifacts["fp16"], tmp_path / "artifact"))


def _relist(folder: Path, relpath: str) -> None:
    """Lists a rewritten file's size and sha256 in the manifest: every file check passes."""
    manifest = json.loads((folder / "manifest.json").read_text())
    size, digest = sha256_file(folder / relpath)
    next(f for f in manifest["files"] if f["path"] == relpath).update(size=size, sha256=digest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _edit_down_proj(folder: Path, factor: float = 1.0, swap_pairs: bool = False) -> None:
    """Every layer's down_proj weight scaled, and its output channels swapped two by two as a GEMM with a wrong
    epilogue layout would give them (a kernel's bug hits every layer of its shape)."""
    for block in BLOCKS:
        tensors = load_file(str(folder / block))
        w = tensors["down.weight"].float() * factor
        if swap_pairs:
            w = w.view(-1, 2, w.shape[1]).flip(1).reshape(w.shape)
        tensors["down.weight"] = w.half()
        save_file(tensors, str(folder / block))
        _relist(folder, block)


def _load(folder: Path, **options):
    return load_served_model(WorkerConfig(artifact=str(folder), kv_blocks=8, block_size=4, metrics_port=None,
                                          **options))


def test_a_worker_computing_other_numbers_than_the_reference_is_refused(artifact_copy):
    _edit_down_proj(artifact_copy, swap_pairs=True)
    with pytest.raises(ArtifactBroken, match=r"failed the start-up probe: this worker's logits differ from the "
                                             r"quantizer's reference by \d\.\d+ on average .* above --probe-max-error"):
        _load(artifact_copy)
    assert _load(artifact_copy, probe_max_error=0.0) is not None  # the check off: it serves


def test_equivalent_arithmetic_passes(artifact_copy, caplog):
    """A difference far inside the threshold (here the down_proj weights 0.1% larger) is served."""
    _edit_down_proj(artifact_copy, 1.001)
    with caplog.at_level(logging.INFO, logger="services.worker.probe_check"):
        assert _load(artifact_copy) is not None
    assert any("probe: logits within" in r.getMessage() for r in caplog.records)


def test_a_step_budget_shorter_than_the_probes_prompt_takes_it_in_chunks(artifacts, artifact_copy):
    """The prompt goes in chunks of at most max_batch_tokens (the GPU runner's workspace is sized by it)."""
    whole = _load(artifacts["fp16"]).probe_error
    chunked = _load(artifacts["fp16"], max_batch_tokens=5).probe_error
    assert chunked == pytest.approx(whole, abs=1e-3) and chunked < 0.01
    _edit_down_proj(artifact_copy, swap_pairs=True)
    with pytest.raises(ArtifactBroken, match="failed the start-up probe"):
        _load(artifact_copy, max_batch_tokens=5)


def test_an_artifact_made_before_probes_is_served_with_a_warning(artifact_copy, caplog):
    (artifact_copy / PROBE_FILE).unlink()
    manifest = json.loads((artifact_copy / "manifest.json").read_text())
    manifest["files"] = [f for f in manifest["files"] if f["path"] != PROBE_FILE]
    (artifact_copy / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="services.worker.probe_check"):
        assert _load(artifact_copy) is not None
    assert any("has no probe" in r.getMessage() for r in caplog.records)


def test_an_unreadable_probe_is_a_corrupt_artifact(artifact_copy):
    (artifact_copy / PROBE_FILE).write_bytes(b"not safetensors")
    _relist(artifact_copy, PROBE_FILE)
    with pytest.raises(ArtifactCorrupt, match=f"unreadable {PROBE_FILE}"):
        _load(artifact_copy)


def test_a_probe_longer_than_the_kv_cache_is_skipped(artifacts, caplog):
    with caplog.at_level(logging.WARNING, logger="services.worker.probe_check"):
        load_served_model(WorkerConfig(artifact=str(artifacts["fp16"]), kv_blocks=4, block_size=4, metrics_port=None))
    assert any("do not fit this worker's context" in r.getMessage() for r in caplog.records)


def test_the_threshold_is_checked_and_parsed(artifacts):
    with pytest.raises(ConfigError, match="probe_max_error=-1"):
        WorkerConfig(artifact="x", probe_max_error=-1)
    with pytest.raises(ConfigError, match="probe_max_error=nan"):
        WorkerConfig(artifact="x", probe_max_error=float("nan"))
    assert WorkerConfig.from_args(["--artifact", "x", "--probe-max-error", "0.5"]).probe_max_error == 0.5
    assert WorkerConfig(artifact="x").probe_max_error == 0.5


def test_a_worker_starts_serving_with_nothing_in_its_prefix_cache(artifacts):
    """The probe writes its K/V into blocks 0.. behind the engine, over the blocks the self-check's prompt left
    named in the prefix cache: a request starting like that prompt would have reused the probe's K/V."""
    stats = _load(artifacts["fp16"]).engine.stats()
    assert stats.kv_blocks_cached == 0 and stats.kv_blocks_free == stats.kv_blocks_total
    # The self-check went through the engine, but its lookups are not traffic: a fresh worker's counters read
    # nothing (its prefix cache had "queried" the self-check's prompt, skewing the hit rate).
    assert (stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens, stats.preemptions) == (0, 0, 0)


@pytest.mark.parametrize("edit, message", [
    (lambda t, vocab: t.update(logits=torch.zeros(t["logits"].shape[0], vocab + 8)), r"logits are \(\d+, {vocab8}\)"),
    (lambda t, vocab: t["decode_ids"].__setitem__(0, vocab + 5), r"token id {vocab5} is outside"),
], ids=["logits_columns", "token_id"])
def test_a_probe_of_another_vocabulary_is_a_corrupt_artifact(artifact_copy, edit, message):
    """Listed with its sha256, so it passes the file checks; run, it would crash start-up with a traceback."""
    vocab = json.loads((artifact_copy / "manifest.json").read_text())["model_config"]["vocab_size"]
    tensors = load_file(str(artifact_copy / PROBE_FILE))
    edit(tensors, vocab)
    save_file(tensors, str(artifact_copy / PROBE_FILE))
    _relist(artifact_copy, PROBE_FILE)
    with pytest.raises(ArtifactCorrupt, match=message.format(vocab8=vocab + 8, vocab5=vocab + 5)):
        _load(artifact_copy)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update(prompt_ids=t["prompt_ids"][None]), r"prompt_ids is \(1, \d+\) torch.int64, not a 1-D"),
    (lambda t: t.update(decode_ids=t["decode_ids"].double()), r"decode_ids is \(\d+,\) torch.float64, not a 1-D"),
    (lambda t: t.update(logits=t["logits"].to(torch.int32)), r"logits are \(\d+, \d+\) torch.int32, not a 2-D"),
    (lambda t: t.update(logits=t["logits"][:, None]), r"logits are \(\d+, 1, \d+\) torch.float32, not a 2-D"),
], ids=["prompt_ids_2d", "decode_ids_float", "logits_int", "logits_3d"])
def test_a_probe_of_the_wrong_rank_or_dtype_is_a_corrupt_artifact(artifact_copy, edit, message):
    """2-D ids and integer logits crashed the start-up probe with a traceback (a TypeError comparing a list, the
    norm of integer logits); float ids were truncated without a word."""
    tensors = load_file(str(artifact_copy / PROBE_FILE))
    edit(tensors)
    save_file(tensors, str(artifact_copy / PROBE_FILE))
    _relist(artifact_copy, PROBE_FILE)
    with pytest.raises(ArtifactCorrupt, match=f"unreadable {PROBE_FILE}: .*{message}"):
        _load(artifact_copy)


def test_the_probe_prompt_goes_in_two_chunks_so_the_continuing_chunk_kernel_is_checked(artifacts):
    """A chunk continuing a cached prefix (prefix caching, a chunked prompt) runs its own attention kernel: the
    probe's second prompt chunk checks its numbers (and, on a GPU, compiles it) before the worker serves."""
    from services.worker.engine.reference_runner import ReferenceRunner
    from services.worker.probe_check import probe_logits
    from shared.formats.artifact import ArtifactReader

    reader = ArtifactReader(artifacts["fp16"], verify=False)
    runner = ReferenceRunner(reader, "cpu", block_size=4)
    runner.allocate_cache(16)
    steps, real_step = [], runner.step
    runner.step = lambda batch: steps.append([(c.start_position, len(c.token_ids)) for c in batch.chunks]) \
        or real_step(batch)
    probe = reader.probe()
    rows = probe_logits(runner, probe, max_batch_tokens=256)
    half = len(probe.prompt_ids) // 2
    assert steps[:2] == [[(0, half)], [(half, len(probe.prompt_ids) - half)]]
    assert max(probe.errors(rows)) < 0.01  # fp16: the chunks change no number

"""ArtifactWriter's output folder: what it refuses to replace, where it stages, what a killed run leaves
behind, and the files' modes. Synthetic tensors: the writer does not look at them."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

from shared.file_modes import FILE_MODE
from shared.formats import artifact as artifact_module
from shared.formats.artifact import ArtifactError, ArtifactWriter
from shared.formats.manifest import Manifest

IDENTITY = {"model_version": "v" * 64, "format": "fp16", "gpu_target": "cpu", "options": {}, "calibration": None}


def _write(out: str | Path, before_finish=None) -> Path:
    with ArtifactWriter(out, IDENTITY) as writer:
        writer.write_tensors("weights/embed.safetensors", {"embed": torch.zeros(4, 2, dtype=torch.float16)})
        if before_finish is not None:
            before_finish(writer)
        return writer.finish(Manifest(artifact_id="a1" * 16, model_name="m", quantizer_version="0.1.0",
                                      model_config={}, created_at="2026-12-07T00:00:00+00:00", **IDENTITY))


def test_remaking_an_artifact_beside_files_of_the_users_is_refused_and_keeps_them(tmp_path):
    """The folder is replaced whole: the same artifact re-made over a folder that also held notes (or a project
    holding a copy of its manifest.json) deleted them, exit 0."""
    out = _write(tmp_path / "out")
    (out / "notes.txt").write_text("eval results")
    with pytest.raises(ArtifactError, match=r"holds files that are not its artifact's \(notes.txt\)"):
        _write(out)
    assert (out / "notes.txt").read_text() == "eval results"
    (out / "notes.txt").unlink()
    assert _write(out) == out  # the artifact alone: re-made


def test_the_current_folder_and_a_symlink_are_written_as_the_folder_they_name(tmp_path, monkeypatch):
    """`--out .` failed at the very end (renaming '.'), and `--out link` replaced the link by a folder, then
    failed removing the old link with rmtree."""
    target = _write(tmp_path / "real")
    link = tmp_path / "current"
    link.symlink_to(target)
    assert _write(link) == target and link.is_symlink() and (link / "manifest.json").is_file()
    monkeypatch.chdir(target)
    assert _write(".") == target and sorted(p.name for p in tmp_path.iterdir()) == [".real.lock", "current", "real"]


def test_a_mount_point_is_refused_before_any_work(tmp_path, monkeypatch):
    """Staged beside the folder and renamed into place: a mount point (a container's volume) cannot be, and the
    run failed after the whole quantization."""
    out = tmp_path / "volume"
    out.mkdir()
    monkeypatch.setattr(artifact_module.os.path, "ismount", lambda path: Path(path) == out)
    with pytest.raises(ArtifactError, match="is a mount point.*give a folder inside it"):
        ArtifactWriter(out, IDENTITY)
    assert list(tmp_path.iterdir()) == [out]


def test_what_a_killed_run_left_is_removed_and_two_runs_do_not_write_one_folder(tmp_path):
    """A killed run's hidden staging folder (as large as the artifact) stayed for good, and the next run was refused
    for want of disk space. The next writer of that folder removes it; one writer at a time per folder."""
    left = tmp_path / ".out.partial-0badc0de"
    (left / "weights").mkdir(parents=True)
    (left / "weights" / "block_000.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / ".out.old-12345678").mkdir()
    (tmp_path / ".other.partial-0badc0de").mkdir()  # another output's: not this run's business
    started, release = threading.Event(), threading.Event()
    errors = []

    def first():
        _write(tmp_path / "out", before_finish=lambda writer: (started.set(), release.wait(10)))

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(10)
    try:
        with pytest.raises(ArtifactError, match="another run is writing an artifact to"):
            ArtifactWriter(tmp_path / "out", IDENTITY)
    except BaseException as exc:  # pragma: no cover - reported after the thread ends
        errors.append(exc)
    release.set()
    thread.join(10)
    assert not errors
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-0badc0de", ".out.lock", "out"]


def test_weights_get_the_processes_file_mode_not_owner_only(tmp_path):
    """safetensors writes 0600 whatever the umask: a worker running as another account could not read them."""
    previous = os.umask(0o022)
    try:
        out = _write(tmp_path / "out")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((out / "weights" / "embed.safetensors").stat().st_mode) == FILE_MODE


def test_a_write_that_fails_is_an_os_error_naming_the_file(tmp_path, monkeypatch):
    """A full disk made safetensors raise its own error (not an OSError): qctl printed a traceback."""
    def full(tensors, path):
        raise SafetensorError("Error while serializing: IoError(No space left on device)")

    monkeypatch.setattr(artifact_module, "save_file", full)
    with pytest.raises(OSError, match=r"cannot write .*embed.safetensors: .*No space left on device"):
        _write(tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.lock"]  # the staging is removed


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 1e5])
def test_a_tensor_that_is_not_finite_in_fp16_is_refused_and_nothing_is_left(tmp_path, bad):
    """A bf16 checkpoint's weight beyond fp16's range (1e5 in a norm) became inf in fp16: the artifact was written
    without a word and answered NaN (qctl eval: perplexity nan; a worker refused it at start-up only)."""
    norm = torch.ones(8, dtype=torch.bfloat16)
    norm[3] = bad

    def write_norm(writer):
        writer.write_tensors("weights/block_000.safetensors", {"attn_norm": norm.half(), "codes": torch.ones(2)})

    with pytest.raises(ArtifactError, match=r"weights/block_000.safetensors: tensor 'attn_norm' holds 1 value\(s\) "
                                            r"that are inf or NaN"):
        _write(tmp_path / "out", before_finish=write_norm)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))

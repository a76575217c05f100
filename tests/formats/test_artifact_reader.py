"""The artifact reader refuses a damaged or hostile artifact folder with an ArtifactError (a worker's
ArtifactCorrupt, DATA_LOSS), whatever its files hold: never another exception, never unbounded memory.
The folders here are synthetic: each check runs before any tensor has to make sense."""

from __future__ import annotations

import hashlib
import json
import signal
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from shared.formats.artifact import EMBED_FILE, HEAD_FILE, ArtifactError, ArtifactReader, block_file
from shared.formats.manifest import FileEntry, Manifest

CONFIG = dict(vocab_size=8, hidden_size=4, intermediate_size=8, num_heads=2, num_kv_heads=1, head_dim=2,
              num_layers=1)


def _artifact(folder: Path, files: dict[str, bytes], **model_config) -> Path:
    """An artifact folder holding `files`, each listed with its true size and sha256 (a re-signed manifest)."""
    entries = []
    for relpath, data in files.items():
        (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
        (folder / relpath).write_bytes(data)
        entries.append(FileEntry(relpath, hashlib.sha256(data).hexdigest(), len(data)))
    Manifest(artifact_id="a1" * 16, model_name="m", model_version="v" * 64, format="fp16", gpu_target="cpu",
             quantizer_version="0.1.0", model_config={**CONFIG, **model_config}, options={}, calibration=None,
             created_at="2026-11-29T00:00:00+00:00", files=entries).write(folder)
    return folder


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """TimeoutError once `seconds` have passed: a check that loops over a claimed count fails here, early,
    rather than after eating the host's memory."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_num_layers_past_the_listed_files_is_refused_at_once(tmp_path):
    """The file-list check built the name of every claimed layer's file before comparing: num_layers=10**12 in
    manifest.json took all the host's memory (the worker, and others, OOM-killed) instead of a refusal."""
    folder = _artifact(tmp_path / "artifact", {EMBED_FILE: b"", HEAD_FILE: b"", block_file(0): b""},
                       num_layers=10**12)
    with _deadline(0.5), pytest.raises(ArtifactError, match=r"num_layers=1000000000000, but the manifest lists "
                                                            r"only 3 files"):
        ArtifactReader(folder)


_HEADER = json.dumps({"attn_norm": {"dtype": "F16", "shape": [1 << 40], "data_offsets": [0, 2 << 40]}}).encode()
NOT_SAFETENSORS = {
    "zero-length": b"",
    "header-claims-2**60-bytes": struct.pack("<Q", 1 << 60) + b"{}",
    "tensor-beyond-the-file": struct.pack("<Q", len(_HEADER)) + _HEADER + b"\0" * 16,
    "garbage-header": struct.pack("<Q", 8) + b"{garbage",
}


@pytest.mark.parametrize("data", NOT_SAFETENSORS.values(), ids=NOT_SAFETENSORS.keys())
@pytest.mark.parametrize("read, relpath", [
    (lambda reader: reader.embed(), EMBED_FILE),
    (lambda reader: reader.head(), HEAD_FILE),
    (lambda reader: reader.block(0), block_file(0)),
    (lambda reader: reader.block_kv_range(0), block_file(0)),
    (lambda reader: reader.block_key_feedback(0), block_file(0)),
], ids=["embed", "head", "block", "kv_range", "key_feedback"])
def test_a_listed_file_that_is_not_safetensors_is_an_artifact_error(tmp_path, data, read, relpath):
    """safetensors' own error escaped (not a ValueError): the worker died with a traceback and exit 1 instead of
    its one-line DATA_LOSS refusal."""
    folder = _artifact(tmp_path / "artifact", {EMBED_FILE: b"", HEAD_FILE: b"", block_file(0): b"", relpath: data})
    reader = ArtifactReader(folder)  # every listed file matches its sha256
    with pytest.raises(ArtifactError, match=f"{relpath} is not a readable safetensors file"):
        read(reader)


@pytest.mark.parametrize("relpath, name, read", [
    (EMBED_FILE, "embed", lambda reader: reader.embed()),
    (HEAD_FILE, "final_norm", lambda reader: reader.head()),
    (block_file(0), "attn_norm", lambda reader: reader.block(0)),
])
def test_an_embedding_or_norm_of_integers_is_an_artifact_error(tmp_path, relpath, name, read):
    """Read as numbers, an int64 norm was served as long as the probe's error stayed under its limit."""
    import torch
    from safetensors.torch import save

    shape = {"embed": (8, 4)}.get(name, (4,))
    data = save({name: torch.ones(shape, dtype=torch.int64)})
    folder = _artifact(tmp_path / "artifact", {EMBED_FILE: b"", HEAD_FILE: b"", block_file(0): b"", relpath: data})
    with pytest.raises(ArtifactError, match=f"{relpath}: {name} is torch.int64, not floating point"):
        read(ArtifactReader(folder))

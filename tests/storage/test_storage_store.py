"""The ObjectStore interface, the same tests against the local-folder store and S3 (moto)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from shared.storage import (STAGING_ROOT, InsufficientSpace, InvalidKey, LocalStore, ObjectInfo, ObjectNotFound, StorageError,
                            TransferProgress)

MIB = 1024 * 1024


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def folder_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_store_empty(store) -> None:
    assert store.list() == []
    if isinstance(store, LocalStore):  # no temporary files or empty folders left behind either
        assert list(store.root.rglob("*")) == [store.root / ".tmp"]


def test_put_get_round_trip_with_sha256(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(10_000))

    put = store.put_file(src, "models/a/weights.bin")
    assert (put.key, put.size, put.sha256) == ("models/a/weights.bin", 10_000, sha256_of(src))
    assert store.head("models/a/weights.bin") == put
    assert store.exists("models/a/weights.bin")

    got = store.get_file("models/a/weights.bin", tmp_path / "out.bin")
    assert (tmp_path / "out.bin").read_bytes() == src.read_bytes()
    assert got == put
    assert store.get_bytes("models/a/weights.bin") == src.read_bytes()


def test_put_replaces_an_object(store):
    store.put_bytes(b"first", "k.json")
    info = store.put_bytes(b"second version", "k.json")
    assert store.get_bytes("k.json") == b"second version"
    assert store.head("k.json") == info


def test_missing_object_is_object_not_found(store, tmp_path):
    assert not store.exists("nope/missing.bin")
    with pytest.raises(ObjectNotFound, match="nope/missing.bin"):
        store.head("nope/missing.bin")
    with pytest.raises(ObjectNotFound, match="nope/missing.bin"):
        store.get_file("nope/missing.bin", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


def test_large_file_round_trip_through_parts(store, tmp_path):
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * MIB))  # the S3 stores here use 5 MiB parts: three parts

    put = store.put_file(src, "big/shard.bin")
    assert put.sha256 == sha256_of(src) and put.size == 12 * MIB
    assert store.head("big/shard.bin").sha256 == put.sha256
    got = store.get_file("big/shard.bin", tmp_path / "back.bin")
    assert got.sha256 == put.sha256
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_list_and_delete_prefix(store):
    for key in ["a/1", "a/2", "a/sub/3", "ab/4", "b/5"]:
        store.put_bytes(key.encode(), key)

    assert [o.key for o in store.list("a/")] == ["a/1", "a/2", "a/sub/3"]
    assert [o.key for o in store.list("a")] == ["a/1", "a/2", "a/sub/3", "ab/4"]
    assert [(o.key, o.size) for o in store.list("a/sub/")] == [("a/sub/3", 7)]
    assert store.list("zzz/") == []

    assert store.delete_prefix("a/") == 3
    assert [o.key for o in store.list()] == ["ab/4", "b/5"]
    store.delete("b/5")
    store.delete("b/5")  # deleting a missing key is not an error
    assert [o.key for o in store.list()] == ["ab/4"]
    with pytest.raises(InvalidKey, match="non-empty prefix"):
        store.delete_prefix("")


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/abs/key", "a//b", "./a", ""])
def test_keys_that_leave_the_store_are_rejected(store, tmp_path, key):
    src = tmp_path / "f"
    src.write_bytes(b"x")
    with pytest.raises(InvalidKey):
        store.put_file(src, key)
    assert store.list() == []


def test_publish_folder_moves_everything_to_the_final_prefix(store, artifact_dir, tmp_path):
    final = "llama/v1/w4a8kv4-g128/sm90/art-1"
    seen = []

    published = store.publish_folder(artifact_dir, final, progress=seen.append)

    expected = sorted(artifact_dir.rglob("*.*"))
    assert [o.key for o in published] == [f"{final}/{p.relative_to(artifact_dir).as_posix()}" for p in expected]
    assert [o.sha256 for o in published] == [sha256_of(p) for p in expected]
    assert [o.key for o in store.list()] == [o.key for o in published]  # nothing staged is left
    assert store.list(STAGING_ROOT) == []
    assert all(o.key.startswith(STAGING_ROOT) for o in seen) and len(seen) == len(expected)
    for obj in published:
        assert store.head(obj.key) == obj

    downloaded = store.download_folder(final, tmp_path / "worker" / "art-1")
    assert folder_files(tmp_path / "worker" / "art-1") == folder_files(artifact_dir)
    assert [o.sha256 for o in downloaded] == [o.sha256 for o in published]
    assert [p.name for p in (tmp_path / "worker").iterdir()] == ["art-1"]  # no partial folder left


def test_publish_large_file_keeps_its_checksum(store, tmp_path):
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "model.safetensors").write_bytes(os.urandom(12 * MIB))
    (artifact / "manifest.json").write_text("{}")

    published = store.publish_folder(artifact, "m/v/fmt/gpu/big")

    head = store.head("m/v/fmt/gpu/big/model.safetensors")
    assert head.size == 12 * MIB and head.sha256 == sha256_of(artifact / "model.safetensors")
    assert {o.key for o in store.list()} == {o.key for o in published}


def test_publish_refuses_a_prefix_that_has_objects(store, artifact_dir):
    store.publish_folder(artifact_dir, "m/v/f/g/a1")
    with pytest.raises(StorageError, match="already exist"):
        store.publish_folder(artifact_dir, "m/v/f/g/a1")
    with pytest.raises(InvalidKey):
        store.publish_folder(artifact_dir, STAGING_ROOT + "x")


def test_publish_failing_verification_leaves_no_objects(store, artifact_dir):
    def corrupt_after_upload(info):
        if info.key.endswith("layer0.bin"):  # same size, other bytes: only the checksum can tell
            store.put_bytes(b"\0" * info.size, info.key)

    with pytest.raises(StorageError, match="verification of .*layer0.bin failed.*sha256"):
        store.publish_folder(artifact_dir, "m/v/f/g/a1", progress=corrupt_after_upload)

    assert_store_empty(store)


def test_publish_failing_in_the_move_leaves_no_objects(store, artifact_dir, monkeypatch):
    real_move = store.move
    moves = []

    def move_then_fail(src, dst):
        if moves:
            raise StorageError("injected failure in the second move")
        moves.append(dst)
        real_move(src, dst)

    monkeypatch.setattr(store, "move", move_then_fail)
    with pytest.raises(StorageError, match="injected failure"):
        store.publish_folder(artifact_dir, "m/v/f/g/a1")

    assert len(moves) == 1
    assert_store_empty(store)


def test_download_folder_refuses_a_non_empty_folder_and_a_missing_prefix(store, artifact_dir, tmp_path):
    store.publish_folder(artifact_dir, "m/v/f/g/a1")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "other").write_text("x")
    with pytest.raises(StorageError, match="not an empty folder"):
        store.download_folder("m/v/f/g/a1", busy)
    with pytest.raises(ObjectNotFound, match="no objects under"):
        store.download_folder("m/v/f/g/missing", tmp_path / "dl")
    assert not (tmp_path / "dl").exists()


def test_purge_staging_removes_only_old_attempts(store, tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"abc")
    store.put_file(src, f"{STAGING_ROOT}{int(time.time() * 1000)}-alive/f")  # a publish that started now
    store.put_file(src, "kept/f")

    assert store.purge_staging(older_than_s=3600) == 0
    assert len(store.list()) == 2


def test_purge_staging_spares_an_old_attempt_that_is_still_writing(store, tmp_path):
    """A publish that started long ago but still uploads (a large model on a slow link) is not purged
    under its feet; one that stopped writing as long ago is. Stores keep times to the second, hence
    a threshold of 2 s and a wait of 3."""
    src = tmp_path / "f"
    src.write_bytes(b"abc")
    store.put_file(src, f"{STAGING_ROOT}1000-dead/a")  # both started in 1970
    store.put_file(src, f"{STAGING_ROOT}1000-slow/a")
    time.sleep(3.0)
    store.put_file(src, f"{STAGING_ROOT}1000-slow/b")  # ... and this one is still uploading

    assert store.purge_staging(older_than_s=2) == 1
    assert [o.key for o in store.list()] == [f"{STAGING_ROOT}1000-slow/a", f"{STAGING_ROOT}1000-slow/b"]
    assert all(o.modified is not None for o in store.list())


def test_a_download_the_disk_cannot_hold_is_refused_before_any_byte(store, artifact_dir, tmp_path, monkeypatch):
    """A worker fetching a 40 GB artifact onto a 30 GB disk (or a quantizer its source) fails at once, naming both
    figures, instead of on ENOSPC part-way with the disk full for everything else on the host."""
    published = store.publish_folder(artifact_dir, "m/v/f/g/a1")
    total = sum(info.size for info in published)
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: total - 1)
    with pytest.raises(InsufficientSpace, match=r"not enough disk space for the download of .*: it needs about 0\.00 GiB"):
        store.download_folder("m/v/f/g/a1", tmp_path / "dl")
    assert not (tmp_path / "dl").exists() and not any(p.name.startswith(".dl") for p in tmp_path.iterdir())
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: total)  # exactly enough
    assert len(store.download_folder("m/v/f/g/a1", tmp_path / "dl")) == len(published)


def test_transfer_progress_reports_at_most_every_interval(monkeypatch):
    reports = []
    progress = TransferProgress(reports.append, total_bytes=3 << 30)
    progress(ObjectInfo("a", 1 << 30, None))  # under the interval: no report yet
    assert reports == [] and (progress.files, progress.bytes) == (1, 1 << 30)
    monkeypatch.setattr(TransferProgress, "EVERY_S", 0.0)
    progress(ObjectInfo("b", 1 << 30, None))
    assert reports == ["2.00 GiB of 3.00 GiB (2 files, 0 s)"]
    unsized = TransferProgress(reports.append)  # a source folder whose size is not listed first
    unsized(ObjectInfo("c", 1 << 29, None))
    assert reports[-1] == "0.50 GiB (1 files, 0 s)"
    assert progress.summary().startswith("2.00 GiB in ") and progress.summary().endswith(" MB/s)")


def test_a_downloaded_folder_gets_the_processes_folder_mode(store, artifact_dir, tmp_path):
    """mkdtemp's 0700 was the cached artifact's mode: a worker of another account sharing the cache could neither
    read it nor, finding it there, download a copy of its own."""
    import stat

    from shared.file_modes import FOLDER_MODE

    store.publish_folder(artifact_dir, "m/id/")
    copy = tmp_path / "cache" / "id"
    copy.parent.mkdir()
    store.download_folder("m/id/", copy)
    assert stat.S_IMODE(copy.stat().st_mode) == FOLDER_MODE

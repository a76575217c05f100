"""The worker's artifact cache makes room for a download by deleting the cached artifacts no worker holds,
least recently held first (services/worker/engine/artifact_cache.py)."""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

import pytest

from services.worker.engine import artifact_cache
from services.worker.engine.artifact_cache import LOCKS_DIR, hold, make_room
from services.worker.engine.loading import open_artifact
from services.worker.errors import ArtifactRefused
from shared.formats.artifact import ArtifactReader
from shared.storage import LocalStore, StorageConfig, TransferProgress

A, B, C, KEEP = "a" * 32, "b" * 32, "c" * 32, "d" * 32


def _cached(cache, artifact_id: str, held_at: float | None) -> None:
    (cache / artifact_id).mkdir(parents=True)
    (cache / artifact_id / "weights.bin").write_bytes(b"x" * 10)
    if held_at is not None:
        os.close(hold(cache, artifact_id))
        os.utime(cache / LOCKS_DIR / artifact_id, (held_at, held_at))


def _free_grows_as_folders_go(monkeypatch, cache, ids, base: int) -> None:
    monkeypatch.setattr("shared.disk_space.free_bytes",
                        lambda path: base + 10 * sum(not (cache / i).exists() for i in ids))


def test_the_least_recently_held_unused_artifacts_go_first_and_only_as_many_as_needed(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    now = time.time()
    _cached(cache, C, held_at=now - 100)
    _cached(cache, A, held_at=now - 300)  # the oldest
    _cached(cache, B, held_at=now - 200)
    _cached(cache, KEEP, held_at=now - 400)  # older still, but the one being fetched
    in_use = hold(cache, B)  # a worker serves B
    try:
        _free_grows_as_folders_go(monkeypatch, cache, (A, B, C, KEEP), base=0)
        assert make_room(cache, 10, keep=KEEP) == [A]
        # B is in use: skipped. C alone cannot free the 20 bytes missing, so it stays (it used to be deleted
        # for a refusal all the same).
        assert make_room(cache, 30, keep=KEEP) == []
        assert sorted(p.name for p in cache.iterdir()) == sorted([LOCKS_DIR, B, C, KEEP])
    finally:
        os.close(in_use)
    assert make_room(cache, 30, keep=KEEP) == [C, B]  # its worker has exited: together they free enough
    assert sorted(p.name for p in cache.iterdir()) == sorted([LOCKS_DIR, KEEP])


def test_a_download_no_deletion_could_make_room_for_deletes_nothing(artifacts, tmp_path, monkeypatch, caplog):
    """An artifact too large for the cache's disk even with every unused copy gone (oversized, hostile, a wrong
    id) emptied the cache of them (the copies a rollback, or a restart while the store is down, serves) and was
    refused all the same."""
    manifest, store = _store_with_g128(artifacts, tmp_path)
    cache = tmp_path / "cache"
    now = time.time()
    _cached(cache, A, held_at=now - 200)
    _cached(cache, B, held_at=now - 100)
    _free_grows_as_folders_go(monkeypatch, cache, (A, B), base=1000)  # the artifact needs megabytes
    with caplog.at_level(logging.WARNING, logger=artifact_cache.__name__), \
            pytest.raises(ArtifactRefused, match="not enough disk space"):
        open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert (cache / A / "weights.bin").is_file() and (cache / B / "weights.bin").is_file()
    assert not any("deleted cached artifact" in r.getMessage() for r in caplog.records)
    assert any(f"no cached artifact deleted in {cache}" in r.getMessage() for r in caplog.records)


def test_a_hold_waits_while_another_worker_deletes_the_copy(tmp_path):
    cache = tmp_path / "cache"
    _cached(cache, A, held_at=None)
    (cache / LOCKS_DIR).mkdir()
    deleting = os.open(cache / LOCKS_DIR / A, os.O_RDWR | os.O_CREAT)
    fcntl.flock(deleting, fcntl.LOCK_EX)
    held = []
    waiter = threading.Thread(target=lambda: held.append(hold(cache, A)))
    waiter.start()
    time.sleep(0.2)
    assert not held  # still waiting for the deletion to end
    os.close(deleting)
    waiter.join(5)
    assert len(held) == 1
    os.close(held[0])


def _store_with_g128(artifacts, tmp_path):
    manifest = ArtifactReader(artifacts["w4a8kv4-g128"], verify=False).manifest
    store_root = tmp_path / "store"
    prefix = f"{manifest.model_name}/{manifest.model_version}/{manifest.format}/cpu/{manifest.artifact_id}/"
    LocalStore(store_root, create=True).publish_folder(artifacts["w4a8kv4-g128"], prefix)
    return manifest, StorageConfig(kind="local", root=store_root)


def test_a_worker_fetching_onto_a_full_cache_deletes_an_unused_artifact_then_downloads(artifacts, tmp_path,
                                                                                       monkeypatch, caplog):
    manifest, store = _store_with_g128(artifacts, tmp_path)
    cache = tmp_path / "cache"
    _cached(cache, A, held_at=time.time() - 3600)  # the artifact of the last rollout, no longer served
    # Large enough that deleting it makes the room (make_room deletes nothing otherwise): sparse, takes no disk.
    os.truncate(cache / A / "weights.bin", 1 << 30)
    # The disk has room for the new artifact only once A is gone.
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: 1 << 40 if not (cache / A).exists() else 1000)
    with caplog.at_level(logging.WARNING, logger=artifact_cache.__name__):
        loaded = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    loaded.reader.verify()
    assert not (cache / A).exists()
    assert any(f"deleted cached artifact {A}" in r.getMessage() for r in caplog.records)
    os.close(loaded.cache_hold)


def test_a_partial_download_a_killed_worker_left_is_removed_by_the_next_download(artifacts, tmp_path, monkeypatch):
    """Swept only after an hour without writes: a worker restarted right after a kill counted the dead partial copy
    as used and refused its artifact for want of room. In a download turn no other worker downloads: it goes."""
    manifest, store = _store_with_g128(artifacts, tmp_path)
    cache = tmp_path / "cache"
    left = cache / f".{manifest.artifact_id}.download-abcd1234"  # shared.storage's download_folder's name
    (left / "weights").mkdir(parents=True)
    (left / "weights" / "block_000.safetensors").write_bytes(b"x" * 10)  # written a moment ago
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: 1 << 40 if not left.exists() else 1000)
    loaded = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    loaded.reader.verify()
    assert not left.exists()
    os.close(loaded.cache_hold)


def test_an_artifact_another_worker_serves_is_never_deleted_for_room(artifacts, tmp_path, monkeypatch):
    manifest, store = _store_with_g128(artifacts, tmp_path)
    cache = tmp_path / "cache"
    _cached(cache, A, held_at=time.time() - 3600)
    other_worker = hold(cache, A)
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: 1000)
    try:
        with pytest.raises(ArtifactRefused, match="cannot be fetched into --cache-dir .*not enough disk space"):
            open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
        assert (cache / A / "weights.bin").is_file()
    finally:
        os.close(other_worker)


def test_a_read_only_cache_filled_beforehand_still_serves(artifacts, tmp_path, monkeypatch, caplog):
    """No lock file can be made there: the worker says so and serves the copy it finds."""
    manifest, store = _store_with_g128(artifacts, tmp_path)
    cache = tmp_path / "cache"
    os.close(open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache).cache_hold)
    real_open = os.open

    def read_only(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(30, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with caplog.at_level(logging.WARNING, logger=artifact_cache.__name__):
        loaded = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache)
    assert loaded.cache_hold is None and loaded.folder == cache / manifest.artifact_id
    assert any("cannot mark artifact" in r.getMessage() for r in caplog.records)


def test_a_download_logs_its_progress_and_its_rate(artifacts, tmp_path, monkeypatch, caplog):
    manifest, store = _store_with_g128(artifacts, tmp_path)
    monkeypatch.setattr(TransferProgress, "EVERY_S", 0.0)  # a report at every file
    with caplog.at_level(logging.INFO, logger=artifact_cache.__name__):
        loaded = open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=tmp_path / "cache")
    total = artifact_cache.disk_space.gib(sum(f.stat().st_size for f in loaded.folder.rglob("*") if f.is_file()))
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"artifact {manifest.artifact_id}: ") and f"of {total} (1 files" in m for m in lines), lines
    assert any(m.startswith(f"artifact {manifest.artifact_id} downloaded: {total} in ") and "MB/s" in m for m in lines)
    os.close(loaded.cache_hold)


def test_workers_starting_together_download_an_artifact_once(artifacts, tmp_path, monkeypatch, caplog):
    """The workers of a host start together and ask for the same artifact: one downloads it, the others wait
    for its copy instead of each fetching (and storing) their own."""
    manifest, store = _store_with_g128(artifacts, tmp_path)
    cache = tmp_path / "cache"
    downloads, first_started = [], threading.Event()
    download = LocalStore.download_folder

    def slow_download(self, prefix, local_dir, **kwargs):
        downloads.append(prefix)
        first_started.set()
        time.sleep(0.5)  # long enough for the other workers to arrive while it runs
        return download(self, prefix, local_dir, **kwargs)

    monkeypatch.setattr(LocalStore, "download_folder", slow_download)
    loaded = []

    def worker():
        loaded.append(open_artifact(manifest.artifact_id, gpu_target="cpu", store=store, cache_dir=cache))

    with caplog.at_level(logging.INFO, logger=artifact_cache.__name__):
        first = threading.Thread(target=worker)
        first.start()
        assert first_started.wait(10)
        others = [threading.Thread(target=worker) for _ in range(3)]
        for thread in others:
            thread.start()
        for thread in [first, *others]:
            thread.join(60)
    assert len(loaded) == 4 and len(downloads) == 1
    assert all(item.folder == cache / manifest.artifact_id for item in loaded)
    waits = [r.getMessage() for r in caplog.records if "another worker is downloading" in r.getMessage()]
    assert len(waits) == 3 and all(f"downloading artifact {manifest.artifact_id} (pid " in w for w in waits)
    for item in loaded:
        os.close(item.cache_hold)


def test_downloads_of_different_artifacts_into_one_cache_take_turns(artifacts, tmp_path, monkeypatch):
    """Each checks the disk (and makes room) only once the one before it has ended: two downloads running at
    once would each count the same free bytes."""
    g128, store = _store_with_g128(artifacts, tmp_path)
    fp16 = ArtifactReader(artifacts["fp16"], verify=False).manifest
    LocalStore(store.root).publish_folder(
        artifacts["fp16"], f"{fp16.model_name}/{fp16.model_version}/{fp16.format}/cpu/{fp16.artifact_id}/")
    cache = tmp_path / "cache"
    spans, running = [], threading.Event()
    download = LocalStore.download_folder

    def slow_download(self, prefix, local_dir, **kwargs):
        running.set()
        start = time.monotonic()
        time.sleep(0.3)
        try:
            return download(self, prefix, local_dir, **kwargs)
        finally:
            spans.append((start, time.monotonic()))

    monkeypatch.setattr(LocalStore, "download_folder", slow_download)
    loaded = []

    def worker(artifact_id):
        loaded.append(open_artifact(artifact_id, gpu_target="cpu", store=store, cache_dir=cache))

    first = threading.Thread(target=worker, args=(g128.artifact_id,))
    first.start()
    assert running.wait(10)
    second = threading.Thread(target=worker, args=(fp16.artifact_id,))
    second.start()
    for thread in (first, second):
        thread.join(60)
    assert len(loaded) == 2 and len(spans) == 2
    (start_a, end_a), (start_b, end_b) = sorted(spans)
    assert end_a <= start_b
    for item in loaded:
        os.close(item.cache_hold)


@pytest.mark.parametrize("why", ["evicted", "damaged"])
def test_a_copy_left_half_deleted_by_a_killed_worker_is_reclaimed_for_room(tmp_path, monkeypatch, why):
    """A worker killed while deleting a cached copy (renamed aside, then removed) leaves the aside folder: the
    next worker that needs room removes it, rather than refusing the download for room that garbage holds."""
    cache = tmp_path / "cache"
    left = cache / f".{A}.{why}-{'0' * 32}"  # artifact_cache.aside_path's name
    (left / "weights").mkdir(parents=True)
    (left / "weights" / "block_000.safetensors").write_bytes(b"x" * 10)
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: 100 + 10 * (not left.exists()))
    assert make_room(cache, 110, keep=KEEP) == []  # no artifact was evicted: the garbage was the room
    assert not left.exists()


def test_a_damaged_copy_just_moved_aside_by_a_live_worker_is_left_to_it(tmp_path):
    """For a few system calls the aside name of a damaged copy may hold another worker's fresh copy, which the
    worker discarding it (holding the artifact) puts back: not garbage until no worker holds the artifact."""
    cache = tmp_path / "cache"
    cache.mkdir()
    held = hold(cache, A)
    aside = artifact_cache.aside_path(cache / A, artifact_cache.DAMAGED)
    aside.mkdir()
    try:
        assert artifact_cache.remove_leftovers(cache) == 0 and aside.exists()
    finally:
        os.close(held)
    assert artifact_cache.remove_leftovers(cache) == 1 and not aside.exists()

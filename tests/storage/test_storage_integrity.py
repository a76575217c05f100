"""Publication and download under concurrency: what another reader of the store or of the local
cache can see while a publish or a download is under way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.storage import StorageError

MANIFEST = "manifest.json"


def test_publish_moves_the_manifest_to_the_final_prefix_last(store, artifact_dir):
    """The manifest marks a prefix as an artifact (the worker finds an id by it): while it is not
    there, the other files must already all be in place."""
    final = "m/v/f/g/a1/"
    seen_at_manifest_move = []
    real_move = store.move

    def move(src_key, dst_key):
        if dst_key == final + MANIFEST:
            seen_at_manifest_move.append(sorted(info.key for info in store.list(final)))
        real_move(src_key, dst_key)

    store.move = move
    store.publish_folder(artifact_dir, final)
    others = sorted(final + p.relative_to(artifact_dir).as_posix()
                    for p in artifact_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert seen_at_manifest_move == [others]


def test_two_downloads_of_the_same_objects_into_one_folder_both_succeed(store, artifact_dir, tmp_path):
    """Two workers on one host sharing a cache folder fetch the same artifact at once: the one that
    finishes second must find the first one's complete copy, not fail the worker's start-up."""
    final = "m/v/f/g/a1/"
    store.publish_folder(artifact_dir, final)
    dest = tmp_path / "cache" / "a1"
    raced = []

    def other_worker_finishes_first(_info):
        if not raced:
            raced.append(True)
            store.download_folder(final, dest)

    got = store.download_folder(final, dest, progress=other_worker_finishes_first)
    assert raced
    assert len(got) == len(list(p for p in artifact_dir.rglob("*") if p.is_file()))
    for p in artifact_dir.rglob("*"):
        if p.is_file():
            assert (dest / p.relative_to(artifact_dir)).read_bytes() == p.read_bytes()
    assert sorted(os.listdir(dest.parent)) == ["a1"]  # no partial folder left behind


def test_a_download_that_finds_other_files_in_its_folder_still_fails(store, artifact_dir, tmp_path):
    final = "m/v/f/g/a1/"
    store.publish_folder(artifact_dir, final)
    dest = tmp_path / "cache" / "a1"

    def someone_else_writes_there(_info):
        if not dest.exists():
            dest.mkdir(parents=True)
            (dest / "other.bin").write_bytes(b"not the artifact")

    with pytest.raises(StorageError, match="a1"):
        store.download_folder(final, dest, progress=someone_else_writes_there)
    assert [p.name for p in dest.iterdir()] == ["other.bin"]
    assert sorted(os.listdir(dest.parent)) == ["a1"]

"""The local-folder store answers like S3: listings under concurrent deletes, a "folder" key, partial
writes, sibling prefixes, atomic puts and a disk that fills up mid-publish."""

from __future__ import annotations

import errno
import os

import pytest

from shared.storage import LocalStore, StorageError
from shared.storage import local as local_module


@pytest.fixture
def local(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store", create=True)


def test_listing_while_another_process_deletes_an_object(local, monkeypatch):
    """A quantizer purging staging objects while another lists the same folder store: the object that
    went is not listed, and the listing does not fail (S3's listing is a snapshot)."""
    for key in ("a/1", "a/2", "a/3"):
        local.put_bytes(b"x", key)
    real_walk = os.walk

    def walk_then_delete(top, *args, **kwargs):
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            if "2" in filenames:
                os.unlink(os.path.join(dirpath, "2"))  # gone between the directory read and the stat
            yield dirpath, dirnames, filenames

    monkeypatch.setattr(local_module.os, "walk", walk_then_delete)
    assert [info.key for info in local.list("a/")] == ["a/1", "a/3"]


def test_deleting_a_key_that_is_only_a_prefix_is_deleting_a_missing_key(local):
    local.put_bytes(b"x", "a/b/c")
    local.delete("a/b")  # S3: no object 'a/b', nothing to do
    local.delete("a")
    assert [info.key for info in local.list()] == ["a/b/c"]


def test_partial_writes_are_never_listed(local):
    (local.root / ".tmp" / "half-written").write_bytes(b"half")
    assert local.list() == [] and local.list(".tmp/") == [] and local.list(".tmp") == []
    local.put_bytes(b"x", ".tmpfoo/k")  # an ordinary key that merely starts like the folder
    assert [info.key for info in local.list(".tmp")] == [".tmpfoo/k"]


def test_a_prefix_without_a_slash_is_a_plain_string_prefix_as_on_s3(local):
    for key in ("a/b/1", "a/bc/2"):
        local.put_bytes(b"x", key)
    assert [info.key for info in local.list("a/b/")] == ["a/b/1"]
    assert [info.key for info in local.list("a/b")] == ["a/b/1", "a/bc/2"]
    assert local.delete_prefix("a/b/") == 1
    assert [info.key for info in local.list()] == ["a/bc/2"]


def test_a_reader_never_sees_a_half_written_object(local, tmp_path, monkeypatch):
    local.put_bytes(b"old", "k")
    src = tmp_path / "new"
    src.write_bytes(b"new" * 1000)
    seen = []
    real_copy = local_module.copy_hashing

    def copy_and_look(source, dest):
        result = real_copy(source, dest)
        # Written, not yet placed: a reader (another process) still finds the old object, whole.
        seen.append(((local.root / "k").read_bytes(), [(i.key, i.size) for i in local.list()]))
        return result

    monkeypatch.setattr(local_module, "copy_hashing", copy_and_look)
    local.put_file(src, "k")
    assert seen == [(b"old", [("k", 3)])]
    assert local.get_bytes("k") == src.read_bytes()


def test_a_disk_filling_up_mid_publish_leaves_nothing(local, artifact_dir, monkeypatch):
    real_copy = local_module.copy_hashing
    copies = []

    def fill_up_on_the_third_file(source, dest):
        copies.append(dest)
        if len(copies) == 3:
            with open(dest, "wb") as partial:
                partial.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copy(source, dest)

    monkeypatch.setattr(local_module, "copy_hashing", fill_up_on_the_third_file)
    with pytest.raises(StorageError, match="No space left on device"):
        local.publish_folder(artifact_dir, "m/v/f/g/a1")
    assert list(local.root.rglob("*")) == [local.root / ".tmp"]

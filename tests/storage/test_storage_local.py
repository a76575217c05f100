"""Local-folder store specifics: keys stay under root, writes are atomic, the folder must exist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.storage import InvalidKey, LocalStore, StorageError


def test_root_must_exist_unless_created(tmp_path):
    with pytest.raises(StorageError, match=f"local store folder {tmp_path / 'absent'} does not exist"):
        LocalStore(tmp_path / "absent")
    store = LocalStore(tmp_path / "absent", create=True)
    assert store.root.is_dir()
    assert store.uri("a/b") == f"{(tmp_path / 'absent').as_uri()}/a/b"


def test_symlink_out_of_root_is_rejected(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    store = LocalStore(tmp_path / "store", create=True)
    (store.root / "link").symlink_to(outside, target_is_directory=True)
    src = tmp_path / "f"
    src.write_bytes(b"x")

    with pytest.raises(InvalidKey, match="outside the store folder"):
        store.put_file(src, "link/escaped")
    assert list(outside.iterdir()) == []


def test_temporary_folder_is_reserved_and_hidden(tmp_path):
    store = LocalStore(tmp_path / "store", create=True)
    src = tmp_path / "f"
    src.write_bytes(b"x")
    with pytest.raises(InvalidKey, match="reserved"):
        store.put_file(src, ".tmp/x")
    (store.root / ".tmp" / "partial-write").write_bytes(b"half")
    assert store.list() == []


def test_failed_write_leaves_nothing(tmp_path):
    store = LocalStore(tmp_path / "store", create=True)
    with pytest.raises(StorageError, match="cannot write .*a/b from .*missing"):
        store.put_file(tmp_path / "missing", "a/b")
    assert list(store.root.rglob("*")) == [store.root / ".tmp"]


def test_delete_removes_emptied_folders(tmp_path):
    store = LocalStore(tmp_path / "store", create=True)
    store.put_bytes(b"1", "a/b/c/one")
    store.put_bytes(b"2", "a/two")
    store.delete("a/b/c/one")
    assert not (store.root / "a" / "b").exists()
    assert (store.root / "a" / "two").is_file()


def _unreadable(monkeypatch, folder):
    """os.scandir of folder fails as for a folder this user may not read (the tests run as root, which may)."""
    scandir = os.scandir

    def refusing(path="."):
        if os.fspath(path) == os.fspath(folder):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)


def test_a_folder_that_cannot_be_read_is_an_error_not_an_empty_folder(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store", create=True)
    store.put_bytes(b"{}", "m/id/manifest.json")
    store.put_bytes(b"w", "m/id/weights/w0.bin")
    _unreadable(monkeypatch, tmp_path / "store" / "m" / "id" / "weights")
    # Skipped, the download held the manifest alone and was renamed into place as complete.
    with pytest.raises(StorageError, match="cannot list .*Permission denied"):
        store.list("m/id/")
    with pytest.raises(StorageError, match="cannot list .*Permission denied"):
        store.download_folder("m/id/", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    folder = tmp_path / "artifact"
    (folder / "weights").mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    (folder / "weights" / "w0.bin").write_bytes(b"w")
    _unreadable(monkeypatch, folder / "weights")
    with pytest.raises(StorageError, match="cannot read the folder .*Permission denied"):
        store.publish_folder(folder, "m/other/")


def test_a_long_file_name_downloads(tmp_path):
    # The partial download was named after the file (+18 characters): a 240-byte name never downloaded.
    store = LocalStore(tmp_path / "store", create=True)
    name = "w" * 240 + ".bin"
    store.put_bytes(b"x", f"m/{name}")
    store.get_file(f"m/{name}", tmp_path / "copy" / name)
    assert (tmp_path / "copy" / name).read_bytes() == b"x"
    with pytest.raises(StorageError, match="cannot read"):  # over the file system's limit: not a raw OSError
        store.exists("m/" + "w" * 300)


def test_a_store_that_cannot_be_written_opens_for_reading(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "store", create=True)
    store.put_bytes(b"x", "k")
    (tmp_path / "store" / ".tmp").rmdir()
    mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name == ".tmp":
            raise OSError(30, "Read-only file system", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    reader = LocalStore(tmp_path / "store")  # raised a raw OSError: a worker on a read-only mount never started
    assert reader.get_bytes("k") == b"x"
    with pytest.raises(StorageError, match="cannot write"):
        reader.put_bytes(b"y", "k2")

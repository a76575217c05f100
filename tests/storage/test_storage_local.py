"""Local-folder store specifics: keys stay under root, writes are atomic, the folder must exist."""

from __future__ import annotations

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

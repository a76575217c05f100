"""A folder as an object store: `qctl up`, tests, and single-host setups.

Writes go to a temporary file under `<root>/.tmp/` (same filesystem) and are renamed into place,
so a reader never sees a partial object. Keys map to paths under root and cannot leave it.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from .base import ObjectInfo, ObjectStore, walk_error
from .errors import InvalidKey, ObjectNotFound, StorageError
from .hashing import copy_hashing, sha256_file
from .keys import check_key, check_prefix

TMP_DIR = ".tmp"


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike[str], *, create: bool = False):
        root = Path(root).expanduser().resolve()
        if not root.is_dir():
            if not create:
                raise StorageError(
                    f"local store folder {root} does not exist: create it first (the quantizer does with "
                    f"--create-bucket; in code, create=True)"
                )
            root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self._tmp = root / TMP_DIR
        try:
            self._tmp.mkdir(exist_ok=True)
        except OSError:  # a read-only mount, another user's folder: reading needs no .tmp (writes then fail there)
            pass

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def uri(self, key: str = "") -> str:
        return f"{self.root.as_uri()}/{key}"

    def put_file(self, local_path: str | os.PathLike[str], key: str) -> ObjectInfo:
        dest = self._path(key)
        tmp = self._tmp / uuid.uuid4().hex
        try:
            size, sha = copy_hashing(local_path, tmp)
            self._place(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise StorageError(f"cannot write {self.uri(key)} from {local_path}: {exc}") from exc
        return ObjectInfo(key, size, sha)

    def create_bytes(self, data: bytes, key: str) -> bool:
        dest = self._path(key)
        tmp = self._tmp / uuid.uuid4().hex
        try:
            tmp.write_bytes(data)
            for _ in range(3):
                try:
                    self._place(tmp, dest, put=os.link)  # a link fails where a file is: of two writers, one links
                    return True
                except FileExistsError as exc:
                    if dest.is_file():
                        return False
                    conflict = exc  # deleted since the link failed (released): try again; or see below
            # A folder where the object would be, or a file where a folder of its path would be: a key that is
            # a prefix of another (a claim on a/b beside one on a/b/c), which a folder cannot hold at once.
            raise StorageError(f"cannot write {self.uri(key)}: {conflict}") from conflict
        except OSError as exc:
            raise StorageError(f"cannot write {self.uri(key)}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, local_path: str | os.PathLike[str]) -> ObjectInfo:
        src = self._existing(key)
        dest = Path(local_path)
        # Not named after dest: a file name near the 255-byte limit would leave no room for the suffix.
        tmp = dest.with_name(f".{uuid.uuid4().hex}.partial")
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            size, sha = copy_hashing(src, tmp)
            os.replace(tmp, dest)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, FileNotFoundError) and not src.exists():  # deleted meanwhile, as S3 would say
                raise ObjectNotFound(f"no object {self.uri(key)}") from exc
            raise StorageError(f"cannot copy {self.uri(key)} to {dest}: {exc}") from exc
        return ObjectInfo(key, size, sha)

    def head(self, key: str) -> ObjectInfo:
        # A folder keeps no checksum beside the file, so this reads the whole object.
        size, sha = sha256_file(self._existing(key))
        return ObjectInfo(key, size, sha)

    def exists(self, key: str) -> bool:
        return self._is_file(self._path(key), key)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        if prefix.startswith(TMP_DIR + "/"):  # partial writes are not objects
            return []
        top = self.root / prefix.rpartition("/")[0]
        found = []
        for dirpath, dirnames, filenames in os.walk(top, onerror=walk_error(f"cannot list {self.uri(prefix)}")):
            if Path(dirpath) == self.root and TMP_DIR in dirnames:
                dirnames.remove(TMP_DIR)
            for name in filenames:
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        stat = path.stat()
                    except FileNotFoundError:  # deleted by another process since the folder was read
                        continue
                    except OSError as exc:
                        raise StorageError(f"cannot list {self.uri(prefix)}: {exc}") from exc
                    found.append(ObjectInfo(key, stat.st_size, None, stat.st_mtime))
        return sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        if path.is_dir():  # a key that is only a prefix of other objects: no object, as on S3
            return
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot delete {self.uri(key)}: {exc}") from exc
        self._prune(path.parent)

    def move(self, src_key: str, dst_key: str) -> None:
        src = self._existing(src_key)
        try:
            self._place(src, self._path(dst_key))
        except OSError as exc:
            raise StorageError(f"cannot move {self.uri(src_key)} to {self.uri(dst_key)}: {exc}") from exc
        self._prune(src.parent)

    def purge_staging(self, older_than_s: float = 3600.0) -> int:
        """Also deletes partial writes older than older_than_s from .tmp/: a writer killed mid-copy
        (a multi-GB shard) leaves its temporary file there, where nothing else ever removes it."""
        deleted = super().purge_staging(older_than_s)
        cutoff = time.time() - older_than_s
        try:
            partials = list(self._tmp.iterdir())
        except FileNotFoundError:
            return deleted
        for path in partials:
            try:
                if path.is_file() and path.stat().st_mtime <= cutoff:
                    path.unlink()
                    deleted += 1
            except FileNotFoundError:  # renamed into place or removed meanwhile
                continue
            except OSError as exc:
                raise StorageError(f"cannot delete the partial write {path}: {exc}") from exc
        return deleted

    def _path(self, key: str) -> Path:
        check_key(key)
        if key.split("/", 1)[0] == TMP_DIR:
            raise InvalidKey(f"object key {key!r} is not accepted: {TMP_DIR}/ is reserved for partial writes")
        path = self.root / key
        # '..' is already refused; this catches a symlink inside root that points outside it.
        if not path.resolve().is_relative_to(self.root):
            raise InvalidKey(f"object key {key!r} resolves outside the store folder {self.root}")
        return path

    def _existing(self, key: str) -> Path:
        path = self._path(key)
        if not self._is_file(path, key):
            raise ObjectNotFound(f"no object {self.uri(key)}")
        return path

    def _is_file(self, path: Path, key: str) -> bool:
        try:
            return path.is_file()  # False where nothing is; OSError where a folder cannot be read, a name too long
        except OSError as exc:
            raise StorageError(f"cannot read {self.uri(key)}: {exc}") from exc

    def _place(self, src: Path, dest: Path, put: Callable[[Path, Path], None] = os.replace) -> None:
        # A concurrent delete may prune dest's (empty) parent between mkdir and rename: retry.
        for attempt in range(3):
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                put(src, dest)
                return
            except FileNotFoundError:
                if attempt == 2 or not src.exists():
                    raise

    def _prune(self, folder: Path) -> None:
        """Remove folder and its parents while they are empty, stopping at root."""
        while folder != self.root and folder.is_relative_to(self.root):
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

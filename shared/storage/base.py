"""The object store interface: eight primitives per backend; publish and download written once here.

Publishing is the only way an artifact reaches its final prefix: the prefix is claimed (claims.py: one
publisher at a time), every file is uploaded under `_staging/<millis>-<id>/`, each staged object's size
and sha256 are checked against the local file, and only then are the objects moved to the final prefix.
The caller marks the artifact READY after `publish_folder` returns; if it raises, everything the attempt
wrote is deleted (best effort: when the store itself is unreachable the error says what may be left, and
`purge_staging` removes stale staging objects later).
"""

from __future__ import annotations

import abc
import errno
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.disk_space import RoomCheck, shortage
from shared.file_modes import FOLDER_MODE

from . import claims
from .errors import InsufficientSpace, InvalidKey, LocalDiskError, ObjectNotFound, StorageError, VerificationFailed
from .hashing import sha256_file
from .keys import CLAIMS_ROOT, STAGING_ROOT, check_key, check_prefix, folder_prefix

MANIFEST_NAME = "manifest.json"  # shared.formats.manifest.MANIFEST_NAME (storage does not import formats)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the store (its local root or its S3 bucket/prefix)
    size: int  # bytes
    sha256: str | None  # hex; None where the store keeps no record of it (e.g. in listings)
    # When it was last written (epoch seconds), in listings; not part of its identity (compare=False).
    modified: float | None = field(default=None, compare=False)


Progress = Callable[[ObjectInfo], None]


class ObjectStore(abc.ABC):
    """Keys are '/'-separated relative paths (see keys.py); every error is a StorageError."""

    # ---- primitives: one implementation per backend ----

    @abc.abstractmethod
    def uri(self, key: str = "") -> str:
        """Where key lives, for messages and records: 's3://bucket/prefix/key' or 'file:///root/key'."""

    @abc.abstractmethod
    def put_file(self, local_path: str | os.PathLike[str], key: str) -> ObjectInfo:
        """Upload a local file to key (replacing it); returns its size and sha256."""

    @abc.abstractmethod
    def get_file(self, key: str, local_path: str | os.PathLike[str]) -> ObjectInfo:
        """Download key to local_path (readers never see a partial file); returns the sha256 of the bytes written."""

    @abc.abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and recorded sha256 of key; raises ObjectNotFound."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with prefix (a plain string prefix), sorted by key; sha256 is None."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Delete key; deleting a missing key is not an error."""

    @abc.abstractmethod
    def move(self, src_key: str, dst_key: str) -> None:
        """Move an object, keeping its recorded sha256 (S3: server-side copy then delete)."""

    @abc.abstractmethod
    def create_bytes(self, data: bytes, key: str) -> bool:
        """Write a small object only where none is (atomically: of two writers one wins); False if one was."""

    # ---- built on the primitives ----

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under prefix; returns how many were deleted."""
        if not prefix:
            raise InvalidKey("delete_prefix needs a non-empty prefix; emptying a whole store is not offered")
        check_prefix(prefix)
        objects = self.list(prefix)
        for info in objects:
            self.delete(info.key)
        return len(objects)

    def put_bytes(self, data: bytes, key: str) -> ObjectInfo:
        """Small objects (manifests): written through a temporary file."""
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "object"
            path.write_bytes(data)
            return self.put_file(path, key)

    def clear_prefix(self, prefix: str, only_if: Callable[[], bool] | None = None) -> int:
        """delete_prefix under the prefix's claim (claims.py): refused with PublishInProgress while a publish
        writes there, which would otherwise go on moving objects into the prefix just cleared. only_if, if
        given, is asked once the claim is held: False deletes nothing (returns 0)."""
        claim = claims.claim_prefix(self, prefix, f"clear-{uuid.uuid4().hex[:16]}")
        try:
            if only_if is not None and not only_if():
                return 0
            return self.delete_prefix(folder_prefix(prefix))
        finally:
            claims.release(self, claim)

    def get_bytes(self, key: str) -> bytes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "object"
            self.get_file(key, path)
            return path.read_bytes()

    def publish_folder(
        self, local_dir: str | os.PathLike[str], final_prefix: str, *, progress: Progress | None = None
    ) -> list[ObjectInfo]:
        """Upload every file under local_dir to final_prefix, all or nothing (see the module doc).

        progress, if given, is called with each staged object's info after its upload.
        Returns the published objects (final keys, sizes, sha256s) in key order.
        """
        local_dir = Path(local_dir)
        final = folder_prefix(final_prefix)
        if not final or final.startswith((STAGING_ROOT, CLAIMS_ROOT)):
            raise InvalidKey(
                f"publish_folder needs a final prefix outside {STAGING_ROOT!r} and {CLAIMS_ROOT!r} and not the "
                f"store root, got {final_prefix!r}"
            )
        if not local_dir.is_dir():
            raise StorageError(f"cannot publish {local_dir}: it is not a folder")
        files = _files_under(local_dir)
        if not files:
            raise StorageError(f"cannot publish {local_dir}: the folder has no files")
        self._refuse_if_written(final)
        attempt = f"{int(time.time() * 1000)}-{uuid.uuid4().hex[:16]}"
        claim = claims.claim_prefix(self, final, attempt)
        try:
            self._refuse_if_written(final)  # again, now alone: a publish may have finished since the first look
            return self._publish_claimed(local_dir, files, claim, f"{STAGING_ROOT}{attempt}/", progress)
        finally:
            claims.release(self, claim)

    def _refuse_if_written(self, final: str) -> None:
        if self.list(final):
            raise StorageError(
                f"cannot publish to {self.uri(final)}: objects already exist there; an artifact "
                "prefix is written once (use a new artifact id, or delete the old objects first)"
            )

    def _publish_claimed(self, local_dir: Path, files: list[tuple[str, Path]], claim: claims.PrefixClaim,
                         staging: str, progress: Progress | None) -> list[ObjectInfo]:
        final = claim.prefix
        written: list[str] = []  # every key this attempt may have created, in order
        try:
            staged = []
            for rel, path in files:
                written.append(staging + rel)
                info = self.put_file(path, staging + rel)
                staged.append(info)
                if progress is not None:
                    progress(info)
            for info in staged:
                self._verify(info)
            published = []
            # The manifest goes last: its presence marks the prefix as an artifact (a worker finds
            # an artifact id by it), so it must not appear before every file it lists is in place.
            order = sorted(zip(files, staged), key=lambda pair: pair[0][0] == MANIFEST_NAME)
            for (rel, _path), info in order:
                if claim.lost or not claims.holds(self, claim):
                    raise ClaimLost(f"its claim {claim.key} was taken over (or purged) as stale: another publish "
                                    "may write the prefix now")
                written.append(final + rel)
                self.move(info.key, final + rel)
                published.append(ObjectInfo(final + rel, info.size, info.sha256))
            published.sort(key=lambda info: info.key)
        except BaseException as exc:
            if isinstance(exc, ClaimLost):  # what it moved there is the new holder's to replace, not ours to delete
                written = [key for key in written if not key.startswith(final)]
            leftover = self._discard(written, staging, final)
            if not isinstance(exc, Exception):
                raise
            note = (
                f"; cleanup also failed, so objects may remain under {' and '.join(leftover)} "
                "(purge_staging() removes stale staging objects)"
                if leftover
                else ""
            )
            raise StorageError(
                f"publish of {local_dir} to {self.uri(final)} failed: {_describe(exc)}{note}"
            ) from exc
        return published

    def download_folder(
        self, prefix: str, local_dir: str | os.PathLike[str], *, progress: Progress | None = None,
        room: RoomCheck = shortage,
    ) -> list[ObjectInfo]:
        """Download every object under prefix into local_dir, checking sizes and recorded sha256s; `room` checks
        the disk first (InsufficientSpace before the first byte).

        local_dir must not exist or be empty. Files land in a hidden sibling folder that is renamed
        to local_dir only when all of them are verified, so local_dir is either complete or absent.
        Returns the downloaded objects (store keys, sizes, sha256 of the bytes on disk).
        """
        src = folder_prefix(prefix)
        local_dir = Path(local_dir)
        if local_dir.exists() and (not local_dir.is_dir() or any(local_dir.iterdir())):
            raise StorageError(
                f"cannot download {self.uri(src)} into {local_dir}: it exists and is not an empty folder"
            )
        objects = [info for info in self.list(src) if not info.key.endswith("/")]
        if not objects:
            raise ObjectNotFound(f"no objects under {self.uri(src)}")
        try:
            local_dir.parent.mkdir(parents=True, exist_ok=True)
            remove_stale_partial_downloads(local_dir.parent)  # before the space check: it frees some
        except OSError as exc:
            raise LocalDiskError(f"cannot create {local_dir}: {exc}") from exc
        needed = sum(info.size for info in objects)
        short = room(local_dir, needed, f"the download of {self.uri(src)}")
        if short is not None:
            raise InsufficientSpace(short, needed)
        try:
            tmp_dir = Path(tempfile.mkdtemp(prefix=f".{local_dir.name}{DOWNLOAD_SUFFIX}", dir=local_dir.parent))
            # mkdtemp's 0700 became the cached artifact's mode: a worker of another account sharing the cache
            # could neither read it nor, finding it there, download its own copy (shared/file_modes.py).
            tmp_dir.chmod(FOLDER_MODE)
        except OSError as exc:
            raise LocalDiskError(f"cannot create {local_dir}: {exc}") from exc
        try:
            downloaded = []
            for obj in objects:
                rel = check_key(obj.key[len(src) :])
                expected = self.head(obj.key)
                dest = tmp_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                got = _onto_local_disk(lambda: self.get_file(obj.key, dest), local_dir)
                _check_same(
                    self.uri(obj.key), expected, got, what="downloaded file", check_sha=expected.sha256 is not None
                )
                downloaded.append(got)
                if progress is not None:
                    progress(got)
            try:
                if local_dir.exists():
                    local_dir.rmdir()
                os.replace(tmp_dir, local_dir)
            except OSError:
                # Another download of the same objects (a second worker sharing this cache) may have
                # put its complete, verified copy there first: that copy is as good as this one.
                if not _holds(local_dir, downloaded, src):
                    raise
                log.info("%s was downloaded into %s meanwhile by another process; using that copy",
                         self.uri(src), local_dir)
                shutil.rmtree(tmp_dir, ignore_errors=True)
        except OSError as exc:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise LocalDiskError(f"download of {self.uri(src)} into {local_dir} failed: {exc}") from exc
        except BaseException:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        return downloaded

    def purge_staging(self, older_than_s: float = 3600.0) -> int:
        """Delete staging objects of publishes that started more than older_than_s ago and have written
        nothing for as long (crashed or cut off from the store), what a store keeps of their unfinished
        writes, and claims not written for as long (claims.delete_stale); returns how many objects (and
        unfinished writes) were deleted. A publish still uploading (a large model on a slow link can take
        longer than older_than_s) keeps writing, so it is left alone."""
        stale = self._stale_staging_attempts(older_than_s)
        deleted = sum(self.delete_prefix(f"{STAGING_ROOT}{attempt}/") for attempt in sorted(stale))
        deleted += self._discard_unfinished_writes(stale)
        return deleted + claims.delete_stale(self, older_than_s)

    def _discard_unfinished_writes(self, attempts: set[str]) -> int:
        """Deletes what the store keeps of these stale attempts' unfinished writes; returns how many. None here."""
        return 0

    def _stale_staging_attempts(self, older_than_s: float) -> set[str]:
        """The publish attempts under STAGING_ROOT that started, and last wrote, over older_than_s ago."""
        cutoff = time.time() - older_than_s
        return {attempt for attempt, last in self._staging_writes().items()
                if last <= cutoff and staging_attempt_is_stale(attempt, older_than_s)}

    def _staging_writes(self) -> dict[str, float]:
        """Each publish attempt under STAGING_ROOT and the time of its latest write seen (0 where unknown).
        A store that keeps unfinished writes apart from its objects adds them (S3's multipart uploads)."""
        latest: dict[str, float] = {}
        for info in self.list(STAGING_ROOT):
            attempt = staging_attempt(info.key)
            latest[attempt] = max(latest.get(attempt, 0.0), info.modified or 0.0)
        return latest

    # ---- helpers ----

    def _verify(self, expected: ObjectInfo) -> None:
        _check_same(self.uri(expected.key), self.head(expected.key), expected, what="local file", check_sha=True)

    def _discard(self, written: list[str], staging: str, final: str) -> list[str]:
        """Delete what a failed publish wrote; returns the locations that may still hold objects."""
        try:
            for key in reversed(written):
                self.delete(key)
            self.delete_prefix(staging)
        except Exception as exc:  # the store is failing; report what may be left, keep the first error
            log.warning("cleanup after a failed publish to %s failed: %s", self.uri(final), exc)
            leftover = [self.uri(staging)]
            if any(key.startswith(final) for key in written):
                leftover.append(self.uri(final))
            return leftover
        return []


class ClaimLost(StorageError):
    """A publish whose claim was taken over as stale (claims.py) while it was still moving objects."""


def staging_attempt(key: str) -> str:
    """The publish attempt a key under STAGING_ROOT belongs to: '<millis>-<id>'."""
    return key[len(STAGING_ROOT) :].split("/", 1)[0]


def staging_attempt_is_stale(attempt: str, older_than_s: float) -> bool:
    """Whether a publish attempt started more than older_than_s ago (its name starts with its start time)."""
    started_ms = attempt.split("-", 1)[0]
    if not started_ms.isdigit():
        log.warning("leaving %s alone: not a staging folder written by publish_folder", attempt)
        return False
    return int(started_ms) <= (time.time() - older_than_s) * 1000


def _check_same(where: str, stored: ObjectInfo, reference: ObjectInfo, *, what: str, check_sha: bool) -> None:
    if stored.size != reference.size:
        raise VerificationFailed(
            f"verification of {where} failed: the object has {stored.size} bytes, "
            f"the {what} {reference.size}"
        )
    if check_sha and stored.sha256 != reference.sha256:
        raise VerificationFailed(
            f"verification of {where} failed: the object's sha256 is {stored.sha256}, "
            f"the {what}'s {reference.sha256}"
        )


PARTIAL_DOWNLOAD_MAX_AGE_S = 3600.0
# The hidden folder a download fills before it is renamed into place: named apart from the artifact
# writer's `.partial-` staging, which may share the parent and must never be swept from here.
DOWNLOAD_SUFFIX = ".download-"


def remove_stale_partial_downloads(parent: Path, older_than_s: float = PARTIAL_DOWNLOAD_MAX_AGE_S) -> int:
    """Removes the hidden folders download_folder fills (DOWNLOAD_SUFFIX) in parent that nothing has
    written to for older_than_s: a process killed mid-download (a worker's multi-GB artifact) leaves one
    behind, and nothing else would ever remove it. A download in progress keeps writing, so its newest
    file stays recent (another worker sharing the cache may be downloading right now). Returns how many
    were removed."""
    cutoff = time.time() - older_than_s
    removed = 0
    for folder in parent.glob(f".*{DOWNLOAD_SUFFIX}*"):
        try:
            newest = max((p.stat().st_mtime for p in [folder, *folder.rglob("*")]))
            if folder.is_dir() and newest <= cutoff:
                shutil.rmtree(folder)
                removed += 1
                log.info("removed %s: a download abandoned over %.0f s ago", folder, older_than_s)
        except OSError:  # renamed into place, or removed by another process, meanwhile
            continue
    return removed


def _holds(folder: Path, objects: list[ObjectInfo], src: str) -> bool:
    """Whether folder holds exactly these downloaded objects (keys under src), byte for byte."""
    try:
        if not folder.is_dir():
            return False
        expected = {info.key[len(src) :]: info for info in objects}
        if {rel for rel, _path in _files_under(folder)} != set(expected):
            return False
        return all(sha256_file(folder / rel) == (info.size, info.sha256) for rel, info in expected.items())
    except (OSError, StorageError):
        return False


def walk_error(what: str):
    """os.walk's onerror: a folder it cannot read is an error, not a folder with nothing in it (a listing that
    skipped it would publish or download an artifact without its files); one removed meanwhile is nothing."""

    def raise_it(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):
            raise StorageError(f"{what}: {exc}") from exc

    return raise_it


# What a write to the local disk fails with that reading from a store does not: the disk full, over its quota,
# read-only. Reported as the store being unavailable, a full cache disk was neither named nor made room on.
_LOCAL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def _onto_local_disk(fetch: Callable[[], ObjectInfo], local_dir: Path) -> ObjectInfo:
    """fetch(), its local disk's failures raised as LocalDiskError (a backend wraps them as StorageError)."""
    try:
        return fetch()
    except StorageError as exc:
        cause = exc.__cause__
        if isinstance(cause, OSError) and cause.errno in _LOCAL_DISK_ERRNOS:
            raise LocalDiskError(f"the disk of {local_dir} cannot take the download: {exc}") from exc
        raise


def _files_under(folder: Path) -> list[tuple[str, Path]]:
    """Every regular file under folder (file symlinks followed) as sorted (posix key, path)."""
    found = []
    for dirpath, _dirnames, filenames in os.walk(folder, onerror=walk_error(f"cannot read the folder {folder}")):
        for name in filenames:
            path = Path(dirpath) / name
            if path.is_file():
                found.append((check_key(path.relative_to(folder).as_posix()), path))
    return sorted(found)


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, StorageError) else f"{type(exc).__name__}: {exc}"

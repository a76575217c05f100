"""The worker's artifact cache (--cache-dir: one folder per artifact id, possibly shared by the workers of a
host): which cached artifacts are in use, and making room for a download by deleting those no worker uses.

Every rollout leaves the previous artifact in the cache; without eviction a host's disk fills after a few model
versions and the next worker refuses to start. A worker holds a shared lock (flock) on `<cache>/.locks/<id>`
from before it reads its artifact's folder until it exits (the kernel drops the lock with the process, however
it ends). Making room takes an exclusive lock, without waiting, on each other cached artifact, least recently
held first (the lock file's modification time, touched at each hold): one it gets is used by no worker and is
deleted (renamed aside first, so that no reader finds it half gone); one it does not get is in use and stays.
A worker that asks for an artifact while another deletes it waits for the deletion, then downloads it again.

The workers of a host usually start together (one per GPU): they download into the cache one at a time
(download_turn). Those asking for the same artifact as the one downloading then find its copy, rather than each
fetching their own (eight times the object store's traffic and, until seven copies are discarded, eight times
the disk: a 70B artifact's would not fit); one asking for another artifact checks the disk (and makes room) only
once the download before it has ended, so two downloads never count the same free bytes. The total time is about
the same: concurrent downloads share the host's bandwidth."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared import disk_space
from shared.formats.manifest import ARTIFACT_ID_RE
from shared.storage import InsufficientSpace, ObjectStore, TransferProgress
from shared.storage.base import remove_stale_partial_downloads

log = logging.getLogger(__name__)

LOCKS_DIR = ".locks"
DOWNLOAD_LOCK = "download"  # <cache>/.locks/download: held by the worker downloading into the cache
# A cached copy being deleted is first renamed aside to `.<id>.<why>-<hex>` (aside()): evicted by make_room, or
# found damaged (loading._discard_damaged).
EVICTED, DAMAGED = "evicted", "damaged"
ASIDE_RE = re.compile(rf"^\.([0-9a-f]{{32}})\.({EVICTED}|{DAMAGED})-[0-9a-f]{{32}}$")
# A damaged copy's aside name holds, for a few system calls, a fresh copy that is being put back: far longer.
ASIDE_GRACE_S = 60.0


def hold(cache_dir: Path, artifact_id: str) -> int | None:
    """Marks the artifact as in use by this process (until the returned descriptor is closed, or the process
    ends); waits while another worker is deleting its cached copy. None when the cache folder cannot take the
    lock file (a read-only cache, filled beforehand: nothing is deleted from it either)."""
    try:
        fd = _open_lock(cache_dir, artifact_id)
    except OSError as exc:
        log.warning("cannot mark artifact %s as in use in %s (%s): a worker making room there could delete it",
                    artifact_id, cache_dir, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.utime(fd)  # its last use: what eviction goes by
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def download_turn(cache_dir: Path, artifact_id: str) -> Iterator[None]:
    """This worker's turn to download `artifact_id` into the cache: waits while another worker downloads into it
    (the caller then looks again for its artifact's folder). A cache that cannot take the lock file (read-only)
    gives every worker its turn at once. Yields whether the turn is this worker's alone: then a partial download
    in the cache is one a killed worker left (download_into_cache removes it)."""
    try:
        fd = _open_lock(cache_dir, DOWNLOAD_LOCK)
    except OSError as exc:
        log.warning("cannot take the download lock of %s (%s): workers sharing it may download at once", cache_dir,
                    exc)
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an artifact"
            log.info("artifact %s: another worker is downloading %s into %s; waiting for its turn", artifact_id,
                     other, cache_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"artifact {artifact_id} (pid {os.getpid()})".encode(), 0)  # what the waiting ones log
        yield True
    finally:
        os.close(fd)  # drops the lock


def make_room(cache_dir: Path, needed: int, keep: str) -> list[str]:
    """Deletes cached artifacts no worker holds, least recently held first, until `needed` bytes are free; never
    `keep`. Deletes none when even all of them would not free enough: the refusal comes all the same, and those
    copies are what a rollback, or a restart while the store is down, would serve. Returns the ids deleted."""
    remove_leftovers(cache_dir)  # garbage first: it may be all the room needed
    # Locked (exclusively) from the count to the deletion: a worker starting to hold one meanwhile waits for the
    # outcome, rather than taking away bytes that were counted.
    unused = {}
    try:
        for artifact_id in _least_recently_held(cache_dir, keep):
            fd = _lock_if_unused(cache_dir, artifact_id)
            if fd is not None:
                unused[artifact_id] = fd
        free = disk_space.free_bytes(cache_dir)
        sizes = {artifact_id: disk_space.tree_bytes(cache_dir / artifact_id) for artifact_id in unused}
        reclaimable = sum(sizes.values())
        if free + reclaimable < needed:
            log.warning("no cached artifact deleted in %s: %s free and the %s of the %d no worker uses are less than "
                        "the %s needed", cache_dir, disk_space.gib(free), disk_space.gib(reclaimable), len(unused),
                        disk_space.gib(needed))
            return []
        evicted = []
        for artifact_id in unused:
            if disk_space.free_bytes(cache_dir) >= needed:
                break
            if _delete_locked(cache_dir, artifact_id, sizes[artifact_id]):
                evicted.append(artifact_id)
        return evicted
    finally:
        for fd in unused.values():
            os.close(fd)  # drops the lock


def _least_recently_held(cache_dir: Path, keep: str) -> list[str]:
    def last_held(artifact_id: str) -> float:
        try:
            return _lock_path(cache_dir, artifact_id).stat().st_mtime
        except FileNotFoundError:  # never held since locks exist: the oldest
            return 0.0

    ids = [p.name for p in cache_dir.iterdir() if ARTIFACT_ID_RE.match(p.name) and p.name != keep and p.is_dir()]
    return sorted(ids, key=last_held)


def _lock_if_unused(cache_dir: Path, artifact_id: str) -> int | None:
    """A descriptor holding the artifact's exclusive lock, None when a worker holds it (it serves it)."""
    try:
        fd = _open_lock(cache_dir, artifact_id)
    except OSError as exc:  # a read-only cache: nothing can be deleted from it anyway
        log.warning("cannot lock cached artifact %s to delete it: %s", artifact_id, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _delete_locked(cache_dir: Path, artifact_id: str, size: int) -> bool:
    """Deletes the cached copy (of `size` bytes, as counted), its lock held (_lock_if_unused). The lock file stays
    after the deletion (a few bytes): removing it could let a worker holding the old file and one creating a new
    one both believe they hold the only lock."""
    folder = cache_dir / artifact_id
    aside = aside_path(folder, EVICTED)
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return False  # another worker evicted it first
    # Removed under the lock: a worker waiting to hold this id downloads it again only once the space is free.
    shutil.rmtree(aside, ignore_errors=True)
    log.warning("deleted cached artifact %s (%s, used by no worker here) to make room in %s", artifact_id,
                disk_space.gib(size), cache_dir)
    return True


def aside_path(folder: Path, why: str) -> Path:
    """A name of this process's own to rename a cached copy to before deleting it (`why`: EVICTED or DAMAGED):
    no reader looks there, and remove_leftovers knows it for garbage."""
    return folder.with_name(f".{folder.name}.{why}-{uuid.uuid4().hex}")


def remove_leftovers(cache_dir: Path) -> int:
    """Removes the aside folders (aside_path) that a worker killed while deleting a cached copy left behind:
    nothing else would (eviction lists only artifact folders, the stale-download sweep only partial downloads),
    and the room they take would refuse later downloads. Returns how many were removed."""
    try:
        paths = list(cache_dir.iterdir())
    except FileNotFoundError:
        return 0
    removed = 0
    for path in paths:
        match = ASIDE_RE.match(path.name)
        if match is None or not _is_garbage(cache_dir, match[1], match[2], path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left behind by a worker that died while deleting that cached copy", path)
        removed += 1
    return removed


def _is_garbage(cache_dir: Path, artifact_id: str, why: str, path: Path) -> bool:
    """An evicted copy always is: no reader looks there, and removing it beside a live evictor only shares its
    work. A damaged one may, for a few system calls, be another worker's fresh copy that the discarding worker
    (which holds the artifact meanwhile) puts back: it is garbage once no worker holds the artifact, or long
    after it was moved there (a rename sets the folder's ctime)."""
    if why == EVICTED:
        return True
    try:
        if time.time() - path.stat().st_ctime > ASIDE_GRACE_S:
            return True
        fd = _open_lock(cache_dir, artifact_id)
    except OSError:  # gone meanwhile, or a read-only cache
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False  # a worker holds it: maybe in the middle of putting it back
    finally:
        os.close(fd)


def _lock_path(cache_dir: Path, artifact_id: str) -> Path:
    return cache_dir / LOCKS_DIR / artifact_id


def _open_lock(cache_dir: Path, artifact_id: str) -> int:
    """A descriptor of the artifact's lock file, created (with its folder) when missing; OSError when it cannot."""
    lock = _lock_path(cache_dir, artifact_id)
    lock.parent.mkdir(parents=True, exist_ok=True)
    return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)


def download_into_cache(object_store: ObjectStore, prefix: str, folder: Path, ref: str, alone: bool = False) -> None:
    """Downloads into the cache, first deleting cached artifacts no worker uses when the disk lacks the room;
    logs the progress every 10 s (a 70B artifact takes minutes) and the end with the rate. `alone`: in this
    worker's own download_turn, where every partial download in the cache is a killed worker's."""
    remove_leftovers(folder.parent)  # before download_folder's space check: they hold room for nothing
    if alone:
        # Else swept only after an hour without writes: a worker restarted right after a kill counted the dead
        # copy as used and refused its artifact for want of room (or deleted cached ones a rollback needs).
        remove_stale_partial_downloads(folder.parent, older_than_s=0.0)
    progress = TransferProgress(lambda done: log.info("artifact %s: %s downloaded", ref, done),
                                total_bytes=sum(info.size for info in object_store.list(prefix)))
    try:
        object_store.download_folder(prefix, folder, progress=progress)
    except InsufficientSpace as exc:
        if not make_room(folder.parent, exc.needed, keep=ref):
            raise
        object_store.download_folder(prefix, folder, progress=progress)
    log.info("artifact %s downloaded: %s", ref, progress.summary())

"""Free-space checks before long writes: a download or an artifact that cannot fit fails at once, naming what
it needs and what is free, instead of on ENOSPC after minutes (for a 70B model, hours) of work.

Each caller raises its own error type with the message: storage errors for downloads, artifact errors for
quantizer output."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

# shortage's signature: a check of room that a writer sharing its disk with others can replace (SharedSpace)
RoomCheck = Callable[[str | os.PathLike[str], int, str], str | None]


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the filesystem that holds path, or would hold it (its nearest existing ancestor)."""
    here = Path(path).absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return shutil.disk_usage(here).free


def shortage(path: str | os.PathLike[str], needed: int, what: str) -> str | None:
    """A one-line explanation when `needed` bytes do not fit where path is (None when they fit)."""
    free = free_bytes(path)
    if needed <= free:
        return None
    return (f"not enough disk space for {what}: it needs about {gib(needed)} and the filesystem of {path} has "
            f"{gib(free)} free; free some space or choose another folder")


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def tree_bytes(folder: str | os.PathLike[str]) -> int:
    """Bytes of the files under folder (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


class SharedSpace:
    """One writer's claims on a disk it shares with other writers (quantizer jobs sharing a work folder, in one
    process or several): each check counts, besides the free space, what the others have claimed and not yet
    written, so two jobs that each fit alone but not together do not both start and then both fail on ENOSPC.

    A claim is a file in claims_dir holding the bytes this writer expects under `target` in all; what it still
    has to write is that less what `target` holds now, so a claim shrinks as its writer writes. The writer holds
    a shared flock on its file until release() (the kernel drops it however the process ends): a claim file
    whose lock can be taken is a dead writer's and is deleted. Checks and new claims run under an exclusive
    flock on claims_dir/.lock, so two checks never both count the same free bytes."""

    def __init__(self, claims_dir: str | os.PathLike[str], target: str | os.PathLike[str]):
        self._dir = Path(claims_dir)
        self._target = Path(target)
        self._claimed = 0
        self._fd: int | None = None
        self._path = self._dir / f"{uuid.uuid4().hex}.claim"

    def shortage(self, path: str | os.PathLike[str], needed: int, what: str) -> str | None:
        """As shortage() with the other writers' unwritten claims counted as used; when `needed` fits, it is
        added to this writer's claim (None is returned)."""
        self._dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(self._dir / ".lock"):
            others, writers = self._unwritten_by_others()
            mine = max(0, self._claimed - tree_bytes(self._target))  # earlier claims of this writer
            free = free_bytes(path)
            if needed > free - others - mine:
                claimed = f", of which {gib(others)} is claimed by {writers} other job(s) still writing" if others else ""
                return (f"not enough disk space for {what}: it needs about {gib(needed)} and the filesystem of {path} "
                        f"has {gib(free)} free{claimed}; free some space or choose another folder")
            self._claim(self._claimed + needed)
        return None

    def release(self) -> None:
        """Ends this writer's claim (its files are written or deleted)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self._path.unlink()
        os.close(self._fd)  # drops the shared lock
        self._fd, self._claimed = None, 0

    def _claim(self, total: int) -> None:
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        body = json.dumps({"bytes": total, "target": str(self._target.absolute())}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, body, 0)
        self._claimed = total

    def _unwritten_by_others(self) -> tuple[int, int]:
        """Bytes the other live claims have still to write, and how many such claims there are."""
        unwritten, writers = 0, 0
        for path in self._dir.glob("*.claim"):
            if path == self._path:
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # released meanwhile
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its writer lives
                    claim = json.loads(os.read(fd, 1 << 16) or b"{}")
                    left = max(0, int(claim.get("bytes", 0)) - tree_bytes(claim.get("target", "")))
                    unwritten += left
                    writers += left > 0
                else:  # its writer ended without releasing it
                    with contextlib.suppress(OSError):
                        path.unlink()
            except (ValueError, OSError):  # unreadable: a claim being rewritten cannot be, under the lock; skip it
                pass
            finally:
                os.close(fd)
        return unwritten, writers


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


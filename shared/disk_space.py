"""Free-space checks before long writes: a download or an artifact that cannot fit fails at once, naming what
it needs and what is free, instead of on ENOSPC after minutes (for a 70B model, hours) of work.

Each caller raises its own error type with the message: storage errors for downloads, artifact errors for
quantizer output."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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

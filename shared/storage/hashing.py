"""Streaming sha256: artifacts are multi-GB, so nothing here reads a whole file into memory."""

from __future__ import annotations

import hashlib
import os

CHUNK_BYTES = 8 * 1024 * 1024


def sha256_file(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size in bytes, hex sha256) of a file, read in CHUNK_BYTES pieces."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def copy_hashing(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> tuple[int, str]:
    """Copy src to dst (created or truncated), fsync it, and return (size, sha256) of the bytes written."""
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(CHUNK_BYTES):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


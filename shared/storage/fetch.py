"""A source folder named by a path or a URL: how the quantizer reads an s3:// checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

from shared.disk_space import RoomCheck, shortage

from .base import Progress
from .config import StorageConfig, open_store
from .errors import ObjectNotFound


def fetch_folder(uri: str | os.PathLike[str], dest: str | os.PathLike[str], *, base: StorageConfig | None = None,
                 progress: Progress | None = None, room: RoomCheck = shortage) -> Path:
    """A local folder with the files at uri.

    A path or file:///path is returned as it is (nothing copied, dest unused). For
    s3://bucket/prefix[?endpoint=...&region=...] every object under the prefix is downloaded into
    dest (which must not exist or be empty) with sizes and sha256s checked, and dest is returned;
    the endpoint, region and credentials not in the URL come from base.
    """
    text = os.fspath(uri)
    if not text.startswith("s3://"):
        root = StorageConfig.from_url(text).root
        if not root.is_dir():
            raise ObjectNotFound(f"source folder {root} does not exist")
        return root
    store = open_store(StorageConfig.from_url(text, base=base))
    store.download_folder("", dest, progress=progress, room=room)
    return Path(dest)

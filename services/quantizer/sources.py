"""Inputs named by a local path or an s3:// URI: checkpoint folders and text files, made local."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote

from services.quantizer.errors import MissingInput
from services.quantizer.publish_spec import is_s3
from shared.disk_space import RoomCheck, shortage
from shared.storage import ObjectNotFound, Progress, StorageConfig, fetch_folder, open_store
from shared.storage.config import refuse_fragment


def local_folder(uri: str, dest: Path, base: StorageConfig, progress: Progress | None = None,
                 room: RoomCheck = shortage) -> Path:
    """The checkpoint folder at uri; an s3:// prefix is downloaded (verified) into dest first, `progress`
    told of each file, once `room` has found the disk can hold it."""
    try:
        return fetch_folder(uri, dest, base=_s3_base(base), progress=progress, room=room)
    except ObjectNotFound as exc:
        raise MissingInput(f"source {uri!r} holds no checkpoint: {exc}") from exc


def local_file(uri: str, dest_dir: Path, base: StorageConfig) -> Path:
    """The text file at uri; an s3://bucket/path/file object is downloaded into dest_dir first."""
    if not is_s3(uri):
        path = Path(uri).expanduser()
        if not path.is_file():
            raise MissingInput(f"file {uri!r} does not exist")
        return path
    location, _, query = uri.partition("?")
    parent, _, name = location.rpartition("/")
    refuse_fragment(uri)  # as from_url does for the folder part
    store = open_store(StorageConfig.from_url(parent + (f"?{query}" if query else ""), base=_s3_base(base)))
    name = unquote(name)  # percent-decoded as from_url decodes the folder part
    dest = dest_dir / name
    try:
        store.get_file(name, dest)
    except ObjectNotFound as exc:
        raise MissingInput(f"file {uri!r} does not exist: {exc}") from exc
    return dest


def _s3_base(base: StorageConfig) -> StorageConfig | None:
    """The artifact store's endpoint and credentials, when it is an S3 store, for sources in other buckets."""
    return base if base.kind == "s3" else None

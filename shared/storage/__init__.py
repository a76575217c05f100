"""Object store: one small interface (ObjectStore), a local-folder store and an S3 store.

    config = StorageConfig.from_url("s3://artifacts/qserve?endpoint=http://127.0.0.1:9000", access_key=..., secret_key=...)
    store = open_store(config)
    objects = store.publish_folder(artifact_dir, "<model>/<version>/<format>/<gpu>/<artifact_id>")
    # only now mark the artifact READY in the registry
"""

from .base import ObjectInfo, ObjectStore, Progress
from .config import StorageConfig, open_store
from .errors import (InsufficientSpace, InvalidConfig, InvalidKey, LocalDiskError, ObjectNotFound, PublishInProgress,
                     StorageError, VerificationFailed)
from .fetch import fetch_folder
from .keys import STAGING_ROOT
from .local import LocalStore
from .progress import TransferProgress

__all__ = [
    "STAGING_ROOT",
    "InsufficientSpace",
    "LocalDiskError",
    "InvalidConfig",
    "InvalidKey",
    "LocalStore",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "Progress",
    "PublishInProgress",
    "StorageConfig",
    "StorageError",
    "TransferProgress",
    "VerificationFailed",
    "fetch_folder",
    "open_store",
]

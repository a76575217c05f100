"""Errors raised by every object store; callers catch these, never boto3's or OSError."""


class StorageError(Exception):
    """An object store operation failed; the message names the store, the key and the cause."""


class ObjectNotFound(StorageError):
    """The key (or prefix) has no object in the store."""


class InvalidKey(StorageError, ValueError):
    """A key or prefix that no store accepts: empty, absolute, or with '.'/'..' segments."""


class InvalidConfig(StorageError, ValueError):
    """A storage setting or URL that cannot work; the message says what is accepted."""


class InsufficientSpace(StorageError):
    """A download that the local disk cannot hold, refused before its first byte; the message gives both sizes."""

    def __init__(self, message: str, needed: int):
        super().__init__(message)
        self.needed = needed  # bytes the download needs free


class LocalDiskError(StorageError):
    """A download the local disk could not take (its folder cannot be created, the disk filled or is read-only):
    the store is fine, the cache's disk is not."""


class VerificationFailed(StorageError):
    """An object's bytes do not match their recorded size or sha256 (altered in transit or in the store):
    unlike an unreachable store, something is damaged."""


class PublishInProgress(StorageError):
    """Another publish holds the prefix (its claim, claims.py) and is still writing: two publishers of one artifact
    (an orphaned job and its retry) would mix their objects there."""

"""Storage settings, parsed once (CLI flags, a URL, or an explicit from_env call) and passed down."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from .base import ObjectStore
from .errors import InvalidConfig, InvalidKey
from .keys import folder_prefix

KINDS = ("local", "s3")
MIB = 1024 * 1024
MIN_PART_BYTES = 5 * MIB  # S3's smallest part (every part of a multipart upload but the last)
MAX_PART_BYTES = 5 * 1024 * MIB
URL_PARAMS = {"endpoint": "endpoint_url", "region": "region"}
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(slots=True)
class StorageConfig:
    kind: str = "local"  # 'local' or 's3'
    root: Path | None = None  # local: the store folder
    bucket: str | None = None  # s3
    prefix: str = ""  # s3: every key lives under this folder of the bucket
    endpoint_url: str | None = None  # s3: e.g. http://127.0.0.1:9000 for MinIO; None means AWS
    region: str = "us-east-1"
    access_key: str | None = None  # s3: None falls back to boto3's own chain (profile, instance role)
    secret_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    multipart_threshold: int = 64 * MIB  # files at least this large go up in parts
    multipart_chunk_size: int = 64 * MIB
    max_concurrency: int = 8  # parts in flight per file
    max_attempts: int = 4  # per request, first try included (botocore "standard" retries)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidConfig(f"storage kind {self.kind!r} is not supported; accepted: {', '.join(KINDS)}")
        if self.kind == "local":
            if self.root is None or str(self.root) == "":
                raise InvalidConfig("a local store needs root, the folder that holds the objects")
            self.root = Path(self.root)
        else:
            if not self.bucket or not _BUCKET_RE.match(self.bucket):
                raise InvalidConfig(
                    f"S3 bucket name {self.bucket!r} is not valid: 3-63 characters of lowercase "
                    "letters, digits, '.' and '-', starting and ending with a letter or digit"
                )
            try:
                self.prefix = folder_prefix(self.prefix)
            except InvalidKey as exc:
                raise InvalidConfig(f"S3 prefix {self.prefix!r} is not valid: {exc}") from exc
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise InvalidConfig(f"endpoint_url {self.endpoint_url!r} must start with http:// or https://")
        if self.endpoint_url is not None:
            try:
                netloc = urlsplit(self.endpoint_url).netloc
            except ValueError as exc:  # "Invalid IPv6 URL": an unclosed '['
                raise InvalidConfig(f"endpoint_url {self.endpoint_url!r} is not a URL: {exc}") from None
            _refuse_credentials("endpoint_url http(s)", netloc)  # in every error message
        if (self.access_key is None) != (self.secret_key is None):
            raise InvalidConfig("give both access_key and secret_key, or neither (to use boto3's credential chain)")
        for name in ("multipart_threshold", "multipart_chunk_size"):
            value = getattr(self, name)
            if not MIN_PART_BYTES <= value <= MAX_PART_BYTES:
                raise InvalidConfig(
                    f"{name}={value} is out of range: S3 parts are {MIN_PART_BYTES} (5 MiB) to {MAX_PART_BYTES} bytes"
                )
        for name in ("max_concurrency", "max_attempts"):
            if getattr(self, name) < 1:
                raise InvalidConfig(f"{name}={getattr(self, name)} must be at least 1")
        for name in ("connect_timeout_s", "read_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidConfig(f"{name}={getattr(self, name)} must be a positive number of seconds")

    @classmethod
    def from_url(cls, url: str, base: StorageConfig | None = None, **overrides: Any) -> StorageConfig:
        """Settings for `s3://bucket/prefix?endpoint=http://host:9000&region=r`, `file:///path` or a path.

        Fields not named by the URL come from base, then overrides. Credentials never go in the URL.
        """
        values = {f.name: getattr(base, f.name) for f in fields(cls)} if base is not None else {}
        values.update(overrides)
        parts = urlsplit(url)
        if parts.scheme in ("file", "s3"):
            refuse_fragment(url)
        if parts.scheme in ("", "file"):
            if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
                raise InvalidConfig(f"{url!r}: a file URL names a local path, as file:///path")
            if parts.scheme == "file" and parts.query:
                raise InvalidConfig(f"storage URL {url!r}: a file URL takes no parameters (a '?' in the path is %3F)")
            path = unquote(parts.path) if parts.scheme == "file" else url
            return cls(**{**values, "kind": "local", "root": Path(path)})
        if parts.scheme != "s3":
            raise InvalidConfig(
                f"storage URL {url!r} has scheme {parts.scheme!r}; accepted: "
                "s3://bucket/prefix?endpoint=...&region=..., file:///path, or a plain path"
            )
        _refuse_credentials("storage URL s3", parts.netloc)
        for name, given in parse_qs(parts.query, keep_blank_values=True).items():
            if name not in URL_PARAMS:
                raise InvalidConfig(
                    f"unknown parameter {name!r} in storage URL; accepted: {', '.join(URL_PARAMS)}"
                )
            values[URL_PARAMS[name]] = given[-1]
        prefix = unquote(parts.path).lstrip("/")
        return cls(**{**values, "kind": "s3", "bucket": parts.netloc, "prefix": prefix, "root": None})

    @classmethod
    def from_command_line(cls, url: str, endpoint_url: str | None, region: str,
                          environ: Mapping[str, str]) -> StorageConfig:
        """A service's --store, --store-endpoint and --store-region, with the credentials from
        AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN (never on a command line)."""
        return cls.from_url(
            url,
            endpoint_url=endpoint_url,
            region=region,
            access_key=environ.get("AWS_ACCESS_KEY_ID"),
            secret_key=environ.get("AWS_SECRET_ACCESS_KEY"),
            session_token=environ.get("AWS_SESSION_TOKEN"),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> StorageConfig:
        """QSERVE_STORE_URL plus the usual AWS_* variables; call it explicitly (e.g. from a CLI)."""
        env = os.environ if environ is None else environ
        url = env.get("QSERVE_STORE_URL")
        if not url:
            raise InvalidConfig(
                "QSERVE_STORE_URL is not set; set it to s3://bucket/prefix?endpoint=... or file:///path"
            )
        overrides = {
            "endpoint_url": env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"),
            "region": env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            "access_key": env.get("AWS_ACCESS_KEY_ID"),
            "secret_key": env.get("AWS_SECRET_ACCESS_KEY"),
            "session_token": env.get("AWS_SESSION_TOKEN"),
        }
        return cls.from_url(url, **overrides)


def refuse_fragment(url: str) -> None:
    """A '#' in an s3:// or file:// URL: urlsplit drops '#...' as a fragment, and s3://b/models/llama#ft would
    name models/llama, another model."""
    if "#" in url:
        # Not echoed when it holds user:password@ (refused as such once the '#' is gone): that part is a secret.
        shown = "" if "@" in urlsplit(url).netloc else f" {url!r}"
        raise InvalidConfig(f"storage URL{shown} holds '#': write it as %23 (a URL's '#' starts a fragment)")


def _refuse_credentials(what: str, netloc: str) -> None:
    """A URL's user:password@ (what: the URL's name and scheme, as in the message). The URL is not echoed: what
    precedes the '@' is a secret."""
    if "@" in netloc:
        raise InvalidConfig(f"{what}://...@{netloc.rpartition('@')[2]}: credentials do not belong in the URL; set "
                            f"access_key and secret_key (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")


def open_store(config: StorageConfig, *, create: bool = False) -> ObjectStore:
    """The store config describes. Checks that the folder / bucket exists (create=True makes it)."""
    if config.kind == "local":
        from .local import LocalStore

        return LocalStore(config.root, create=create)
    from .s3 import S3Store  # boto3 is only imported by processes that use S3

    return S3Store(config, create_bucket=create)

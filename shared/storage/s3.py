"""S3 (AWS, MinIO, any S3-compatible server) through boto3.

Uploads record the file's sha256 as object metadata (x-amz-meta-sha256), computed by streaming
the file before the upload; files at or above multipart_threshold go up in parts. Transport
integrity on each request is botocore's job (its default CRC32 request checksums).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
import botocore.config
import botocore.exceptions
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig

from .base import ObjectInfo, ObjectStore, staging_attempt
from .config import StorageConfig
from .errors import InvalidConfig, InvalidKey, ObjectNotFound, StorageError
from .hashing import sha256_file
from .keys import STAGING_ROOT, check_key, check_prefix

SHA256_META = "sha256"  # stored as the x-amz-meta-sha256 header
DELETE_BATCH = 1000  # DeleteObjects takes at most 1000 keys
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken"}
_UNREACHABLE = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError)


class S3Store(ObjectStore):
    def __init__(self, config: StorageConfig, *, create_bucket: bool = False):
        if config.kind != "s3":
            raise StorageError(f"S3Store needs a config of kind 's3', got {config.kind!r}")
        self.bucket = config.bucket
        self.prefix = config.prefix  # '' or ends with '/'
        try:
            self._client = self._make_client(config)
        # BotoCoreError: an unknown AWS_PROFILE, a malformed region; ValueError: an endpoint URL botocore cannot
        # use (http://my_host:9000: an underscore, common in compose service names), a traceback before.
        except (botocore.exceptions.BotoCoreError, ValueError) as exc:
            raise InvalidConfig(f"cannot set up the S3 client for s3://{config.bucket}/ (endpoint "
                                f"{config.endpoint_url or 'AWS'}): {exc}") from exc
        self.endpoint = self._client.meta.endpoint_url
        self._transfer = TransferConfig(
            multipart_threshold=config.multipart_threshold,
            multipart_chunksize=config.multipart_chunk_size,
            max_concurrency=config.max_concurrency,
            num_download_attempts=config.max_attempts,
            preferred_transfer_client="classic",
        )
        self._open_bucket(config.region, create_bucket)

    @staticmethod
    def _make_client(config: StorageConfig):
        session = boto3.session.Session(
            aws_access_key_id=config.access_key,
            aws_secret_access_key=config.secret_key,
            # A token belongs to the keys it came with; a stray AWS_SESSION_TOKEN beside a profile's credentials
            # is ignored, as boto3 itself does (passed alone, every request failed with a TypeError).
            aws_session_token=config.session_token if config.access_key else None,
            region_name=config.region,
        )
        return session.client(
            "s3",
            endpoint_url=config.endpoint_url,
            config=botocore.config.Config(
                retries={"max_attempts": config.max_attempts, "mode": "standard"},
                connect_timeout=config.connect_timeout_s,
                read_timeout=config.read_timeout_s,
                max_pool_connections=max(10, config.max_concurrency),
                # Self-hosted endpoints (MinIO, moto) rarely resolve bucket subdomains.
                s3={"addressing_style": "path" if config.endpoint_url else "auto"},
            ),
        )

    def __repr__(self) -> str:
        return f"S3Store({self.uri()!r} at {self.endpoint})"

    def uri(self, key: str = "") -> str:
        return f"s3://{self.bucket}/{self.prefix}{key}"

    def put_file(self, local_path: str | os.PathLike[str], key: str) -> ObjectInfo:
        full = self._full(key)
        try:
            size, sha = sha256_file(local_path)
        except OSError as exc:
            raise StorageError(f"cannot upload {local_path} to {self.uri(key)}: {exc}") from exc
        with self._errors(f"upload of {local_path} to", key):
            self._client.upload_file(
                os.fspath(local_path), self.bucket, full, ExtraArgs={"Metadata": {SHA256_META: sha}}, Config=self._transfer
            )
        return ObjectInfo(key, size, sha)

    def get_file(self, key: str, local_path: str | os.PathLike[str]) -> ObjectInfo:
        full = self._full(key)
        # s3transfer writes to a temporary name and renames it when the download is complete.
        with self._errors(f"download to {local_path} of", key):
            Path(local_path).parent.mkdir(parents=True, exist_ok=True)
            self._client.download_file(self.bucket, full, os.fspath(local_path), Config=self._transfer)
        try:
            size, sha = sha256_file(local_path)
        except OSError as exc:
            raise StorageError(f"cannot read back {local_path} after downloading {self.uri(key)}: {exc}") from exc
        return ObjectInfo(key, size, sha)

    def head(self, key: str) -> ObjectInfo:
        with self._errors("head of", key):
            resp = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        return ObjectInfo(key, resp["ContentLength"], resp.get("Metadata", {}).get(SHA256_META))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        check_prefix(prefix)
        found = [ObjectInfo(obj["Key"][len(self.prefix) :], obj["Size"], None, obj["LastModified"].timestamp())
                 for obj in self._listed("list_objects_v2", "Contents", prefix, "listing of")]
        return sorted(found, key=lambda info: info.key)

    def _listed(self, operation: str, field: str, prefix: str, what: str) -> list[dict]:
        """The `field` entries of every page of a paginated listing under prefix."""
        with self._errors(what, prefix):
            pages = self._client.get_paginator(operation).paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
            return [entry for page in pages for entry in page.get(field, [])]

    def delete(self, key: str) -> None:
        with self._errors("delete of", key):
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))

    def delete_prefix(self, prefix: str) -> int:
        if not prefix:
            raise InvalidKey("delete_prefix needs a non-empty prefix; emptying a whole store is not offered")
        keys = [self.prefix + info.key for info in self.list(prefix)]
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start : start + DELETE_BATCH]]
            with self._errors("delete of objects under", prefix):
                resp = self._client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if resp.get("Errors"):
                first = resp["Errors"][0]
                raise StorageError(
                    f"delete of {len(resp['Errors'])} objects under {self.uri(prefix)} failed at {self.endpoint}, "
                    f"first {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
        return len(keys)

    def move(self, src_key: str, dst_key: str) -> None:
        source = {"Bucket": self.bucket, "Key": self._full(src_key)}
        # Server-side copy (in parts above the threshold); s3transfer keeps the metadata either way.
        with self._errors(f"copy to {self.uri(dst_key)} of", src_key):
            self._client.copy(source, self.bucket, self._full(dst_key), Config=self._transfer)
        self.delete(src_key)

    def create_bytes(self, data: bytes, key: str) -> bool:
        # If-None-Match: * makes the server refuse the write where an object is (412), or while another
        # conditional write of that key is under way (409): either way another writer got there first.
        with self._errors("conditional write of", key):
            try:
                self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, IfNoneMatch="*",
                                        Metadata={SHA256_META: hashlib.sha256(data).hexdigest()})
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise
        return True

    def _discard_unfinished_writes(self, attempts: set[str]) -> int:
        """Aborts the unfinished multipart uploads of stale publish attempts: a publisher killed mid-upload
        leaves its parts stored (and billed) but listed nowhere, not even as an object."""
        aborted = 0
        for key, upload_id, _ in self._multipart_uploads(STAGING_ROOT):
            if staging_attempt(key) in attempts and self._abort_upload(key, upload_id):
                aborted += 1
        return aborted

    def _staging_writes(self) -> dict[str, float]:
        """Objects' times, and the multipart uploads': an attempt uploading one large file has only that
        upload to show (its start, and its latest part's time: one more request per unfinished upload)."""
        latest = super()._staging_writes()
        for key, upload_id, initiated in self._multipart_uploads(STAGING_ROOT):
            attempt = staging_attempt(key)
            latest[attempt] = max(latest.get(attempt, 0.0), initiated, self._latest_part(key, upload_id))
        return latest

    def _latest_part(self, key: str, upload_id: str) -> float:
        """The time of the upload's latest part (0 when it has none, or is gone: completed or aborted)."""
        with self._errors("listing of the parts of the multipart upload of", key):
            try:
                pages = self._client.get_paginator("list_parts").paginate(
                    Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id)
                times = [part["LastModified"].timestamp() for page in pages for part in page.get("Parts", [])]
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                    return 0.0
                raise
        return max(times, default=0.0)

    def _abort_upload(self, key: str, upload_id: str) -> bool:
        """-> False when the upload is gone already (another quantizer purging at the same time)."""
        with self._errors("abort of the unfinished multipart upload of", key):
            try:
                self._client.abort_multipart_upload(Bucket=self.bucket, Key=self.prefix + key, UploadId=upload_id)
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                    return False
                raise
        return True

    def _multipart_uploads(self, prefix: str) -> list[tuple[str, str, float]]:
        """(key, upload id, start time) of every multipart upload started under prefix and neither
        completed nor aborted."""
        uploads = self._listed("list_multipart_uploads", "Uploads", prefix, "listing of the multipart uploads under")
        return [(upload["Key"][len(self.prefix) :], upload["UploadId"], upload["Initiated"].timestamp())
                for upload in uploads]

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _open_bucket(self, region: str, create: bool) -> None:
        try:
            with self._errors("opening of", ""):
                self._client.head_bucket(Bucket=self.bucket)
            return
        except ObjectNotFound:
            if not create:
                raise StorageError(self._no_bucket()) from None
        extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        with self._errors("creation of bucket", ""):
            try:
                self._client.create_bucket(Bucket=self.bucket, **extra)
            except botocore.exceptions.ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "BucketAlreadyOwnedByYou":  # made meanwhile
                    raise

    def _no_bucket(self) -> str:
        return (
            f"bucket {self.bucket!r} does not exist at endpoint {self.endpoint}: create it "
            f"(e.g. `aws s3 mb s3://{self.bucket} --endpoint-url {self.endpoint}`) or fix the configured bucket"
        )

    @contextmanager
    def _errors(self, action: str, key: str) -> Iterator[None]:
        """Turn boto3/botocore failures into StorageError naming the action, the object and the endpoint."""
        where = self.uri(key)
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code == "NoSuchBucket":
                raise StorageError(self._no_bucket()) from exc
            if code in _NOT_FOUND:
                raise ObjectNotFound(f"no object {where} (endpoint {self.endpoint})") from exc
            if code in _DENIED:
                raise StorageError(
                    f"{action} {where} was refused by {self.endpoint} ({code}): check the access key, "
                    "secret key and the bucket policy"
                ) from exc
            raise StorageError(
                f"{action} {where} failed at endpoint {self.endpoint}: {code} {error.get('Message', '')}".rstrip()
            ) from exc
        except botocore.exceptions.NoCredentialsError as exc:
            raise StorageError(
                f"no S3 credentials for {self.endpoint}: set access_key and secret_key in the storage config"
            ) from exc
        except _UNREACHABLE as exc:
            raise StorageError(f"cannot reach S3 endpoint {self.endpoint} ({action} {where}): {exc}") from exc
        except (Boto3Error, botocore.exceptions.BotoCoreError) as exc:
            # S3UploadFailedError carries the cause in its message; RetriesExceededError says "Max Retries
            # Exceeded" alone, its cause (a connection reset each time) in last_exception.
            cause = getattr(exc, "last_exception", None)
            why = f"{exc} (last: {cause})" if cause is not None else str(exc)
            raise StorageError(f"{action} {where} failed at endpoint {self.endpoint}: {why}") from exc
        except OSError as exc:  # the local side: a file that cannot be read or written
            raise StorageError(f"{action} {where} failed: {exc}") from exc

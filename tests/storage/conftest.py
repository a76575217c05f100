"""Fixtures: an S3-compatible server (moto) on loopback, started by the tests, and both stores.

moto keeps its state in this process, shared by every server it runs here: each test uses its own
bucket, and a server started again on the same port sees what the stopped one held.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from shared.storage import ObjectStore, StorageConfig, open_store
from shared.storage.config import MIN_PART_BYTES

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log


class MotoOnLoopback:
    """moto's S3 on 127.0.0.1; port 0 picks a free port. stop() may be called more than once."""

    def __init__(self, port: int = 0):
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self._running = True
        host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self._running:
            self._running = False
            self._server.stop()


def _s3_config(endpoint: str, bucket: str, **overrides) -> StorageConfig:
    values = dict(
        kind="s3",
        bucket=bucket,
        endpoint_url=endpoint,
        access_key="testing",
        secret_key="testing",
        multipart_threshold=MIN_PART_BYTES,
        multipart_chunk_size=MIN_PART_BYTES,
        max_attempts=2,
        connect_timeout_s=2.0,
        read_timeout_s=20.0,
    )
    values.update(overrides)
    return StorageConfig(**values)


def _new_bucket_name() -> str:
    return f"test-{uuid.uuid4().hex[:16]}"


@pytest.fixture(scope="session")
def moto_endpoint():
    server = MotoOnLoopback()
    yield server.endpoint
    server.stop()


@pytest.fixture
def moto_server():
    """start(port=0) -> MotoOnLoopback: a dedicated server the test may stop; stopped at teardown."""
    started: list[MotoOnLoopback] = []

    def start(port: int = 0) -> MotoOnLoopback:
        started.append(MotoOnLoopback(port))
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def s3_config():
    """s3_config(endpoint, bucket=None, **overrides): test settings (5 MiB parts, 2 attempts)."""

    def make(endpoint: str, bucket: str | None = None, **overrides) -> StorageConfig:
        return _s3_config(endpoint, bucket or _new_bucket_name(), **overrides)

    return make


@pytest.fixture
def s3_client():
    """s3_client(endpoint): a plain boto3 client, to look at (or tamper with) what a store wrote."""

    def make(endpoint: str):
        return boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )

    return make


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> ObjectStore:
    if request.param == "local":
        return open_store(StorageConfig(kind="local", root=tmp_path / "store"), create=True)
    endpoint = request.getfixturevalue("moto_endpoint")
    return open_store(_s3_config(endpoint, _new_bucket_name()), create=True)


@pytest.fixture
def artifact_dir(tmp_path) -> Path:
    """A small artifact folder: a manifest, nested weight shards, a tokenizer."""
    root = tmp_path / "artifact"
    (root / "weights").mkdir(parents=True)
    (root / "manifest.json").write_text('{"schema": 1, "format": "w4a8kv4-g128"}')
    (root / "weights" / "layer0.bin").write_bytes(os.urandom(70_000))
    (root / "weights" / "layer1.bin").write_bytes(os.urandom(50_000))
    (root / "tokenizer.json").write_text('{"vocab": {}}')
    return root

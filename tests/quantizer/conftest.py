"""Fixtures: a real quantizer (grpc.aio on loopback), a moto S3 server, SQLite or PostgreSQL registries,
small random Llama checkpoints and short calibration / eval texts."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import grpc
import pytest
from moto.server import ThreadedMotoServer

from services.quantizer.config import QuantizerConfig
from services.quantizer.server import BackgroundQuantizer
from shared.registry import Registry, create_registry, sqlite_url
from shared.rpc.qserve.v1 import quantizer_pb2, quantizer_pb2_grpc
from shared.storage import StorageConfig, open_store
from shared.storage.config import MIN_PART_BYTES
from tests.conftest import REPO, fresh_postgres_schema, write_random_llama

logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log



class Moto:
    """moto's S3 on 127.0.0.1. moto keeps state per process: a server restarted on the same port
    sees what the stopped one held."""

    def __init__(self, port: int = 0):
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.running = True
        host, self.port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{self.port}"

    def stop(self) -> None:
        if self.running:
            self.running = False
            self._server.stop()

    def client(self):
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


@pytest.fixture(scope="session")
def moto() -> Iterator[Moto]:
    server = Moto()
    yield server
    server.stop()


@pytest.fixture
def own_moto() -> Iterator[Callable[[int], Moto]]:
    """own_moto(port=0): a server this test may stop and restart; stopped at teardown."""
    started: list[Moto] = []

    def start(port: int = 0) -> Moto:
        started.append(Moto(port))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def s3_config(endpoint: str, bucket: str | None = None, **overrides) -> StorageConfig:
    values = dict(
        kind="s3", bucket=bucket or f"test-{uuid.uuid4().hex[:16]}", endpoint_url=endpoint,
        access_key="testing", secret_key="testing", multipart_threshold=MIN_PART_BYTES,
        multipart_chunk_size=MIN_PART_BYTES, max_attempts=2, connect_timeout_s=2.0, read_timeout_s=20.0,
    )
    values.update(overrides)
    return StorageConfig(**values)


@pytest.fixture
def bucket_store(moto: Moto) -> StorageConfig:
    """A fresh bucket on the shared moto server."""
    config = s3_config(moto.endpoint)
    open_store(config, create=True)
    return config


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_registry_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """For the tests where the database matters (races, orphans): SQLite and PostgreSQL."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "registry.db")
        return
    with fresh_postgres_schema("test_quantizer") as url:
        yield url


@pytest.fixture
def registry_url(tmp_path: Path) -> str:
    return sqlite_url(tmp_path / "registry.db")


@pytest.fixture
def open_registry() -> Iterator[Callable[[str], Registry]]:
    """open_registry(url): the test's own connection to the registry the quantizer uses."""
    opened: list[Registry] = []

    def open_(url: str) -> Registry:
        opened.append(create_registry(url))
        return opened[-1]

    yield open_
    for registry in opened:
        registry.close()


class Quantizer:
    """A running quantizer and a client of it."""

    def __init__(self, config: QuantizerConfig):
        self.config = config
        self.server = BackgroundQuantizer(config)
        self.address = self.server.address
        self.channel = grpc.insecure_channel(self.address)
        self.stub = quantizer_pb2_grpc.QuantizerStub(self.channel)
        self.stopped = False

    def follow(self, job_id: str, timeout_s: float = 240.0) -> list[quantizer_pb2.JobProgress]:
        """Every WatchJob message until the job ends."""
        return list(self.stub.WatchJob(quantizer_pb2.WatchJobRequest(job_id=job_id), timeout=timeout_s))

    def publish(self, request: quantizer_pb2.PublishRequest) -> tuple[quantizer_pb2.Job, list[quantizer_pb2.JobProgress]]:
        """Publishes and follows the job; -> (its final snapshot, every progress message)."""
        job = self.stub.Publish(request)
        updates = self.follow(job.job_id)
        return updates[-1].job, updates

    def stop(self, grace_s: float | None = None) -> None:
        if not self.stopped:
            self.stopped = True
            self.channel.close()
            self.server.stop(grace_s)


@pytest.fixture
def start_quantizer(tmp_path: Path) -> Iterator[Callable[..., Quantizer]]:
    """start_quantizer(store_config, registry_url, **config_overrides) -> Quantizer, stopped at teardown."""
    started: list[Quantizer] = []

    def start(store: StorageConfig, registry_url: str, **overrides) -> Quantizer:
        values = dict(registry_url=registry_url, store=store, work_dir=tmp_path / f"work{len(started)}",
                      listen="127.0.0.1:0", grace_s=2.0)
        values.update(overrides)
        started.append(Quantizer(QuantizerConfig(**values)))
        return started[-1]

    yield start
    for quantizer in started:
        quantizer.stop()


@pytest.fixture(scope="session")
def small_texts(tmp_path_factory, eval_text: Path, calib_text: Path) -> tuple[Path, Path]:
    """(calibration, eval) text files short enough for fast tests."""
    folder = tmp_path_factory.mktemp("texts")
    calib, evaluation = folder / "calib.txt", folder / "eval-small.txt"
    calib.write_text(calib_text.read_text()[:20_000])
    evaluation.write_text(eval_text.read_text()[:20_000])
    return calib, evaluation


@pytest.fixture
def small_model(tmp_path: Path, tiny_llama: Path) -> Path:
    return write_random_llama(tmp_path / "random-llama")


@pytest.fixture
def request_for(small_texts) -> Callable[..., quantizer_pb2.PublishRequest]:
    """request_for(source, model_name="rand", **fields): a fast publish request (2 calibration windows
    of 64 tokens, 2 eval windows of 64 tokens) with any field replaced."""
    calib, evaluation = small_texts

    def make(source, model_name: str = "rand", **fields) -> quantizer_pb2.PublishRequest:
        values = dict(
            source=str(source), model_name=model_name, format="w4a8kv4-g128", gpu_target="cpu",
            calibration=quantizer_pb2.Calibration(data=str(calib), num_samples=2, seq_len=64),
            eval=quantizer_pb2.EvalData(data=str(evaluation), seq_len=64, max_windows=2),
        )
        values.update(fields)
        return quantizer_pb2.PublishRequest(**values)

    return make


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def quantizer_process(*args: object) -> subprocess.Popen:
    """`python -m services.quantizer.server ARGS` in a process of its own (moto's test credentials)."""
    return subprocess.Popen([sys.executable, "-m", "services.quantizer.server", *map(str, args)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})

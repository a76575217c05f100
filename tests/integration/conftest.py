"""The whole stack on loopback: a real quantizer (in-process), real CPU workers (subprocesses, so a
test can kill one) that announce themselves to a real gateway (in-process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from qctl.main import app
from services.gateway.config import AdminToken, FallbackBudget, GatewayConfig
from services.gateway.server import BackgroundGateway
from services.quantizer.config import QuantizerConfig
from services.quantizer.server import BackgroundQuantizer
from shared.registry import sqlite_url
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc
from shared.storage import StorageConfig
from tests.conftest import REPO

ADMIN_TOKEN, WORKER_TOKEN = "it-admin", "it-worker"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
runner = CliRunner()


@dataclass
class WorkerProcess:
    artifact_id: str
    process: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL: the process dies at once, as on a crash; no drain, no deregistration."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Stack:
    root: Path
    registry_url: str
    store_root: Path
    quantizer: BackgroundQuantizer
    gateway: BackgroundGateway
    workers: dict[str, WorkerProcess] = field(default_factory=dict)  # by artifact id
    artifacts: dict[str, str] = field(default_factory=dict)  # format -> artifact id

    def qctl(self, *args: str):
        env = {"QCTL_GATEWAY": self.gateway.address, "QCTL_TOKEN": ADMIN_TOKEN, "QCTL_QUANTIZER":
               self.quantizer.address, "COLUMNS": "250"}
        return runner.invoke(app, list(args), env=env)

    def admin(self) -> tuple[grpc.Channel, gateway_pb2_grpc.AdminStub]:
        channel = grpc.insecure_channel(self.gateway.address)
        return channel, gateway_pb2_grpc.AdminStub(channel)

    def start_worker(self, artifact_id: str) -> WorkerProcess:
        log = self.root / f"worker-{artifact_id[:8]}.log"
        command = [sys.executable, "-m", "services.worker.server", "--artifact", artifact_id,
                   "--store", str(self.store_root), "--registry-url", self.registry_url, "--device", "cpu",
                   "--port", "0", "--metrics-port", "-1", "--cache-dir", str(self.root / "worker-cache"),
                   "--gateway-address", self.gateway.address, "--torch-threads", "1",
                   "--max-running-sequences", "64", "--drain-grace-seconds", "1"]
        env = {**os.environ, "QSERVE_GATEWAY_TOKEN": WORKER_TOKEN}
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.workers[artifact_id] = WorkerProcess(artifact_id, process, log)
        return self.workers[artifact_id]

    def wait_for_workers(self, timeout_s: float = 180.0) -> list[gateway_pb2.WorkerStatus]:
        """Until every started worker is registered and healthy."""
        channel, admin = self.admin()
        deadline = time.monotonic() + timeout_s
        with channel:
            while True:
                listed = admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN).workers
                healthy = {w.artifact.artifact_id for w in listed if w.health == gateway_pb2.WORKER_HEALTH_HEALTHY}
                if healthy >= set(self.workers):
                    return list(listed)
                for worker in self.workers.values():
                    if worker.process.poll() is not None:
                        pytest.fail(f"worker for {worker.artifact_id} exited: {worker.log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    pytest.fail(f"workers not healthy after {timeout_s:.0f} s: {listed}")
                time.sleep(0.2)


def publish(stack: Stack, source: Path, fmt: str, calib: Path, eval_text: Path) -> str:
    args = ["publish", "--source", str(source), "--model-name", "tiny-llama", "--format", fmt, "--gpu-target", "cpu",
            "--quantizer", stack.quantizer.address, "--calib", str(calib), "--calib-samples", "4",
            "--calib-seq-len", "128", "--eval-data", str(eval_text), "--eval-seq-len", "128",
            "--eval-max-windows", "4", "--budget", "1.0"]
    if fmt != "fp16":
        args.append("--rtn")  # plain round-to-nearest: seconds instead of minutes on 2 cores
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_llama: Path, calib_text: Path, eval_text: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    calib, evals = root / "calib.txt", root / "eval.txt"
    calib.write_text(calib_text.read_text()[:40_000])
    evals.write_text(eval_text.read_text()[:20_000])
    registry_url = sqlite_url(root / "registry.db")
    store_root = root / "objects"
    quantizer = BackgroundQuantizer(QuantizerConfig(
        registry_url=registry_url, store=StorageConfig(kind="local", root=store_root), create_bucket=True,
        work_dir=root / "quantizer", listen="127.0.0.1:0", torch_threads=2, grace_s=2.0))
    gateway = BackgroundGateway(GatewayConfig(
        registry_url=registry_url, listen="127.0.0.1:0", grace_s=1.0,
        admin_tokens={"ops": AdminToken(ADMIN_TOKEN, "admin"), "workers": AdminToken(WORKER_TOKEN, "worker")},
        # a worker killed while idle must still look healthy to the gateway for the retry test
        heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0, budget=FallbackBudget(enabled=False)))
    stack = Stack(root, registry_url, store_root, quantizer, gateway)
    try:
        for fmt in ("w4a8kv4-g128", "fp16"):
            stack.artifacts[fmt] = publish(stack, tiny_llama, fmt, calib, evals)
        for artifact_id in stack.artifacts.values():
            stack.start_worker(artifact_id)
        stack.wait_for_workers()
        yield stack
    finally:
        for worker in stack.workers.values():
            worker.stop()
        gateway.stop(0)
        quantizer.stop(0)

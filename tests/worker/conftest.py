"""Worker test fixtures: fp16 and w4a8kv4-g128 artifacts of the tiny trained Llama (made once per
session: RTN weights for speed, with the searched KV4 range ratio of V, so the engine's cache
writes narrow V as a QoQ artifact's do), the reference greedy continuation, and workers on loopback."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.server import BackgroundWorker
from shared import registry as reg
from shared.formats.artifact import ArtifactReader
from shared.model.load import artifact_model
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from shared.registry import create_registry
from shared.rpc.qserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

FORMATS = ("fp16", "w4a8kv4-g128")


class EagerPiece:
    """A step graph piece on the CPU (StepGraphs' capture_piece): each "replay" runs the captured
    function again."""

    def __init__(self, fn, pool):
        self.fn, self.pool = fn, pool

    def replay(self) -> None:
        self.fn()


@pytest.fixture(scope="session")
def artifacts(tiny_llama: Path, calib_text: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-artifacts")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        options = QoQOptions.rtn() if fmt == "fp16" else dataclasses.replace(QoQOptions.rtn(), kv_range_search=True)
        quantize_checkpoint(QuantizeSettings(tiny_llama, out[fmt], fmt, options=options, calib_path=calib_text,
                                             calib_samples=8, calib_seq_len=256))
    ranges = [ArtifactReader(out["w4a8kv4-g128"]).block_kv_range(i) for i in range(2)]
    assert all(v < 1.0 for _, v in ranges), ranges  # the fixture's V narrows: the path is exercised
    return out


def deploy_artifact(url: str, artifact_dir: Path, monkeypatch) -> str:
    """A registry at url where the artifact at artifact_dir is READY under its own id, deployed as "chat"
    (for a real worker behind real gateways)."""
    reader = ArtifactReader(artifact_dir)
    manifest = reader.manifest
    monkeypatch.setattr("shared.registry.artifacts.new_id", lambda: manifest.artifact_id)
    registry = create_registry(url)
    with registry.transaction() as session:
        version = reg.register_model_version(session, manifest.model_name, manifest.model_version)
        artifact = reg.reserve_artifact(session, version.id, manifest.format, manifest.gpu_target).artifact
        reg.mark_artifact_ready(session, artifact.id, manifest_sha256=reader.manifest_sha256, content_digest="d" * 32,
                                actor="test")
        reg.create_deployment(session, "chat", stable_artifact_id=artifact.id, baseline_artifact_id=artifact.id,
                              actor="test")
    registry.close()
    return manifest.artifact_id


@pytest.fixture(scope="session")
def reference_models(artifacts) -> dict[str, object]:
    # float64 attention, as the worker's CPU backend: see services/worker/engine/reference_runner.py.
    return {fmt: artifact_model(ArtifactReader(path), attention_dtype=torch.float64) for fmt, path in artifacts.items()}


def check_greedy(model, prompt: list[int], got: list[int]) -> None:
    """Asserts that got is exactly the reference's greedy continuation of prompt.

    One LlamaModel.forward over prompt + got, teacher-forced: row len(prompt) - 1 + i holds the
    reference's logits for token i given the worker's tokens before it. If every worker token is
    that row's argmax, got is the reference's greedy continuation (each step of the reference,
    re-run on the growing sequence, sees the same prefix and picks the same token; causal
    attention makes the row of a longer forward the last row of the shorter one). On a mismatch
    the message gives the first differing step and by how many logits the reference preferred its
    own token: a wrong position, block or mask shows as whole logits, a numerics drift as a near tie.
    """
    rows = model.forward(torch.tensor([prompt + got]))[0, len(prompt) - 1 : -1]  # (len(got), V)
    best = rows.argmax(dim=-1).tolist()
    if best == got:
        return
    step = next(i for i, (a, b) in enumerate(zip(got, best)) if a != b)
    margin = float(rows[step].max() - rows[step, got[step]])
    raise AssertionError(f"token {step}: worker chose {got[step]}, the reference's best is {best[step]} by "
                         f"{margin:.6f} logits; worker {got}, reference argmax {best}")


@pytest.fixture
def start_worker(artifacts) -> Iterator[Callable[..., BackgroundWorker]]:
    started: list[BackgroundWorker] = []

    def start(fmt: str = "w4a8kv4-g128", **overrides) -> BackgroundWorker:
        settings = dict(artifact=str(artifacts[fmt]), port=0, metrics_port=None, kv_blocks=256, block_size=4,
                        max_batch_tokens=32, drain_grace_s=5.0)
        settings.update(overrides)
        worker = BackgroundWorker(WorkerConfig(**settings))
        started.append(worker)
        return worker

    yield start
    for worker in started:
        if worker.server._server is not None and not worker.server._stopped:
            worker.stop(grace_s=0)


def stub(worker: BackgroundWorker) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]:
    channel = grpc.insecure_channel(worker.address)
    return channel, worker_pb2_grpc.WorkerStub(channel)


def generate(worker_stub, prompt_ids: list[int], **sampling) -> list[worker_pb2.GenerateResponse]:
    request = worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt_ids))
    for key, value in sampling.items():
        if key == "request_id":
            request.request_id = value
        elif isinstance(value, list):
            getattr(request.sampling, key).extend(value)
        else:
            setattr(request.sampling, key, value)
    return list(worker_stub.Generate(request, timeout=120))

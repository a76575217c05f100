"""Worker test fixtures: fp16 and w4a8kv4-g128 artifacts of the tiny trained Llama (made once per
session, RTN for speed), the reference greedy continuation, and workers on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.server import BackgroundWorker
from shared.formats.artifact import ArtifactReader
from shared.model.load import artifact_model
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, quantize_checkpoint
from shared.rpc.qserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

FORMATS = ("fp16", "w4a8kv4-g128")


@pytest.fixture(scope="session")
def artifacts(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-artifacts")
    out = {}
    for fmt in FORMATS:
        out[fmt] = root / fmt
        quantize_checkpoint(QuantizeSettings(tiny_llama, out[fmt], fmt, options=QoQOptions.rtn()))
    return out


@pytest.fixture(scope="session")
def reference_models(artifacts) -> dict[str, object]:
    return {fmt: artifact_model(ArtifactReader(path)) for fmt, path in artifacts.items()}


# How far (in logits) the reference may rate a worker's token below its own best before the token
# counts as wrong. The worker computes each token's logits from a paged cache, chunk by chunk, so
# its fp32 sums run in another order than one forward over the whole sequence (~1e-7 relative).
# Quantized formats turn that into whole-code flips: a per-token int8 activation or a 4-bit K/V code
# that sat on a rounding boundary lands on the neighbouring code, which moves later logits by up to
# ~0.15 on this model (measured: the first decode step of a 3-token prompt, 0.14). The 16-bit
# formats also round K/V to fp16 in the cache (~2e-3). A wrong position, block or mask moves logits
# by whole units and fails this by far.
NEAR_TIE_LOGITS = 0.25


def check_greedy(model, prompt: list[int], got: list[int]) -> bool:
    """True when got is exactly the reference's greedy continuation of prompt.

    One LlamaModel.forward over prompt + got, teacher-forced: row len(prompt) - 1 + i holds the
    reference's logits for token i given the worker's tokens before it. If every worker token is
    that row's argmax, got is the reference's greedy continuation (each step of the reference,
    re-run on the growing sequence, sees the same prefix and picks the same token; causal
    attention makes the row of a longer forward the last row of the shorter one). Otherwise every
    worker token must be a near tie (within NEAR_TIE_LOGITS of the reference's best) and False is
    returned so callers can bound how often that happens.
    """
    rows = model.forward(torch.tensor([prompt + got]))[0, len(prompt) - 1 : -1]  # (len(got), V)
    best = rows.argmax(dim=-1).tolist()
    if best == got:
        return True
    for step, token in enumerate(got):
        margin = float(rows[step].max() - rows[step, token])
        assert margin <= NEAR_TIE_LOGITS, (
            f"token {step}: worker chose {token}, reference's best is {best[step]} by a margin of "
            f"{margin:.4f} logits (more than a near tie); worker {got}, reference argmax {best}"
        )
    return False


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

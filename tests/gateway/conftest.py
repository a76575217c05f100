"""A gateway on loopback over a SQLite registry with real artifact rows, and fake workers.

Tests are plain functions that run one coroutine (`run(scenario())`): the gateway, the workers and
the client share that event loop."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from services.gateway.config import AdminToken, FallbackBudget, GatewayConfig
from services.gateway.server import GatewayServer
from shared.registry import create_registry, mark_artifact_ready, register_model_version, reserve_artifact, sqlite_url
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import fresh_postgres_schema
from tests.gateway.fake_worker import FakeWorker, FakeWorkerServer

ADMIN = (("authorization", "Bearer admin-secret"),)
WORKER = (("authorization", "Bearer worker-secret"),)
TOKENS = {"ops": AdminToken("admin-secret", "admin"), "workers": AdminToken("worker-secret", "worker")}
DEPLOYMENT = "chat"


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


@dataclass(frozen=True)
class Artifacts:
    url: str  # the registry
    stable: str  # w4a8kv4-g128 of tiny v1
    canary: str  # w4a8kv4-g128 of tiny v2
    baseline: str  # fp16 of tiny v1
    other_model: str  # w4a8kv4-g128 of another model
    pending: str  # a PENDING artifact of tiny v1


def _ready(session, version, fmt: str) -> str:
    artifact = reserve_artifact(session, version.id, fmt, "cpu").artifact
    return mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest=uuid.uuid4().hex,
                               actor="test").id


@pytest.fixture
def artifacts(tmp_path: Path) -> Artifacts:
    return seed_artifacts(sqlite_url(tmp_path / "registry.db"))


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def artifacts_on_each_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Artifacts]:
    """The artifact rows in a SQLite registry, then in PostgreSQL (a fresh schema)."""
    if request.param == "sqlite":
        yield seed_artifacts(sqlite_url(tmp_path / "registry.db"))
        return
    with fresh_postgres_schema("test_gateway") as url:
        yield seed_artifacts(url)


def seed_artifacts(url: str) -> Artifacts:
    """The artifact rows every gateway test uses, in the registry at url."""
    registry = create_registry(url)
    with registry.transaction() as session:
        v1 = register_model_version(session, "tiny", "a" * 64, label="v1")
        v2 = register_model_version(session, "tiny", "c" * 64, label="v2")
        other = register_model_version(session, "other", "d" * 64, label="v1")
        ids = Artifacts(url=url, stable=_ready(session, v1, "w4a8kv4-g128"), canary=_ready(session, v2, "w4a8kv4-g128"),
                        baseline=_ready(session, v1, "fp16"), other_model=_ready(session, other, "w4a8kv4-g128"),
                        pending=reserve_artifact(session, v1.id, "w4a8kv4-chn", "cpu").artifact.id)
    registry.close()
    return ids


@dataclass
class Stack:
    artifacts: Artifacts
    gateway: GatewayServer
    channel: grpc.aio.Channel
    gw: gateway_pb2_grpc.GatewayStub
    admin: gateway_pb2_grpc.AdminStub
    workers: list[FakeWorkerServer] = field(default_factory=list)

    async def add_worker(self, artifact_id: str, capacity: int = 0, **fake) -> FakeWorkerServer:
        server = await FakeWorkerServer(FakeWorker(artifact_id, **fake)).start()
        self.workers.append(server)
        reply = await self.admin.RegisterWorker(
            gateway_pb2.RegisterWorkerRequest(address=server.address, artifact_id=artifact_id, capacity=capacity),
            metadata=WORKER)
        server.worker_id = reply.worker_id
        return server

    async def generate(self, prompt: str = "hello", *, session_key: str = "", max_new_tokens: int = 0,
                       deployment: str = DEPLOYMENT, metadata=None) -> list[gateway_pb2.GatewayGenerateResponse]:
        request = gateway_pb2.GatewayGenerateRequest(
            deployment=deployment, text=prompt, session_key=session_key,
            sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))
        return [reply async for reply in self.gw.Generate(request, metadata=metadata)]

    async def deployment(self) -> gateway_pb2.Deployment:
        return await self.admin.GetDeployment(gateway_pb2.GetDeploymentRequest(deployment=DEPLOYMENT), metadata=ADMIN)


@asynccontextmanager
async def gateway_stack(artifacts: Artifacts, *, create_deployment: bool = True, **overrides) -> AsyncIterator[Stack]:
    budget = overrides.pop("budget", FallbackBudget(enabled=False))
    config = GatewayConfig(registry_url=artifacts.url, listen="127.0.0.1:0", admin_tokens=TOKENS, budget=budget,
                           grace_s=0.5, **overrides)
    gateway = GatewayServer(config)
    await gateway.start()
    channel = grpc.aio.insecure_channel(gateway.address)
    stack = Stack(artifacts, gateway, channel, gateway_pb2_grpc.GatewayStub(channel),
                  gateway_pb2_grpc.AdminStub(channel))
    try:
        if create_deployment:
            await stack.admin.CreateDeployment(gateway_pb2.CreateDeploymentRequest(
                name=DEPLOYMENT, stable_artifact_id=artifacts.stable, baseline_artifact_id=artifacts.baseline),
                metadata=ADMIN)
        yield stack
    finally:
        await channel.close()
        await gateway.stop(0)
        for worker in stack.workers:
            await worker.stop(0)


def arm_of(replies: list[gateway_pb2.GatewayGenerateResponse]) -> int:
    arms = {r.arm for r in replies}
    assert len(arms) == 1, f"one request was served by several arms: {arms}"
    return arms.pop()


def tokens_of(replies: list[gateway_pb2.GatewayGenerateResponse]) -> list[int]:
    return [t for r in replies for t in r.token_ids]


"""A real worker draining behind a real gateway (stop / SIGTERM): its in-flight stream finishes, the
gateway stops sending it work, requests that keep arriving go to the other worker without a single
error (none for the client, none counted against the artifact, which could trip the automatic
guard), and it ends deregistered."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.gateway.config import AdminToken, FallbackBudget, GatewayConfig
from services.gateway.pool import WorkerPool
from services.gateway.server import GatewayServer
from services.worker.config import WorkerConfig
from services.worker.server import WorkerServer
from shared.registry import sqlite_url
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.fake_worker import FakeWorker, FakeWorkerServer
from tests.worker.conftest import deploy_artifact

TOKENS = {"ops": AdminToken("admin-secret", "admin"), "workers": AdminToken("worker-secret", "worker")}
ADMIN = (("authorization", "Bearer admin-secret"),)
DEREGISTER_LATENCY_S = 0.3  # the DeregisterWorker call takes this long to reach the gateway's pool


def _slow_deregistration(monkeypatch) -> None:
    remove = WorkerPool.remove

    async def slow_remove(self, worker_id):
        await asyncio.sleep(DEREGISTER_LATENCY_S)
        return await remove(self, worker_id)

    monkeypatch.setattr(WorkerPool, "remove", slow_remove)


def _request(prompt: str, tokens: int) -> gateway_pb2.GatewayGenerateRequest:
    return gateway_pb2.GatewayGenerateRequest(
        deployment="chat", text=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True))


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_draining_worker_finishes_its_streams_and_no_request_fails(artifacts, tmp_path, monkeypatch):
    artifact_id = deploy_artifact(sqlite_url(tmp_path / "registry.db"), artifacts["fp16"], monkeypatch)
    _slow_deregistration(monkeypatch)

    async def scenario():
        gateway = GatewayServer(GatewayConfig(
            registry_url=sqlite_url(tmp_path / "registry.db"), listen="127.0.0.1:0", admin_tokens=TOKENS,
            heartbeat_interval_s=0.1, heartbeat_timeout_s=30.0, budget=FallbackBudget(enabled=False), grace_s=0.5))
        await gateway.start()
        worker = WorkerServer(WorkerConfig(artifact=str(artifacts["fp16"]), port=0, metrics_port=None, kv_blocks=64,
                                           gateway_addresses=(gateway.address,), gateway_token="worker-secret",
                                           drain_grace_s=30.0))
        await worker.start()
        channel = grpc.aio.insecure_channel(gateway.address)
        client, admin = gateway_pb2_grpc.GatewayStub(channel), gateway_pb2_grpc.AdminStub(channel)

        async def listed():
            return (await admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers

        other = await FakeWorkerServer(FakeWorker(artifact_id, delay_s=0.01)).start()
        try:
            await _until(lambda: _registered(listed, worker.address))
            stream = client.Generate(_request("def main():", 24))
            first = await stream.read()  # the only worker so far: the draining one serves this stream
            await admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(address=other.address,
                                                                         artifact_id=artifact_id), metadata=ADMIN)
            # a long stream on the other worker too: the draining one is now the less loaded (1 of 160
            # slots against 1 of 16), so that the gateway keeps picking it until it is deregistered
            busy = client.Generate(_request("import os", 200))
            await busy.read()
            drained = asyncio.create_task(worker.drain())
            replies = []
            while not drained.done():  # traffic keeps coming while the worker drains
                replies.append([r async for r in client.Generate(_request("x = 1", 2))])
            await drained
            rest = []
            while (reply := await stream.read()) is not grpc.aio.EOF:
                rest.append(reply)
            assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 24
            assert rest[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH
            assert replies and all(r[-1].HasField("finish") for r in replies)
            assert [w.address for w in await listed()] == [other.address]  # deregistered
            busy.cancel()
            stats = gateway.metrics.stats("chat", artifact_id, since=0)
            assert stats.errors == 0, f"{stats.errors} requests counted as failed during a routine drain"
        finally:
            await channel.close()
            await worker.stop(0)
            await gateway.stop(0)
            await other.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _registered(listed, address: str) -> bool:
    return any(w.address == address and w.health == gateway_pb2.WORKER_HEALTH_HEALTHY for w in await listed())

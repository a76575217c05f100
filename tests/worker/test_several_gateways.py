"""A real worker announcing itself to two real gateway replicas over one registry (each replica keeps
its own in-memory worker pool): both route to it, one replica going away costs the other nothing
(heartbeats keep coming, requests keep being served), and a drain deregisters from every replica, all
at once, before the worker refuses a request."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from services.gateway.config import AdminToken, FallbackBudget, GatewayConfig
from services.gateway.pool import WorkerPool
from services.gateway.server import GatewayServer
from services.worker.config import WorkerConfig
from services.worker.server import WorkerServer
from shared.registry import sqlite_url
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.worker.conftest import deploy_artifact

TOKENS = {"ops": AdminToken("admin-secret", "admin"), "workers": AdminToken("worker-secret", "worker")}
ADMIN = (("authorization", "Bearer admin-secret"),)
DEREGISTER_LATENCY_S = 1.0  # each replica takes this long to remove the worker from its pool


class Replica:
    """A gateway replica and a client of both its services."""

    def __init__(self, url: str):
        self.server = GatewayServer(GatewayConfig(
            registry_url=url, listen="127.0.0.1:0", admin_tokens=TOKENS, heartbeat_interval_s=0.1,
            heartbeat_timeout_s=1.0, budget=FallbackBudget(enabled=False), grace_s=0.5))

    async def start(self) -> Replica:
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.client = gateway_pb2_grpc.GatewayStub(self.channel)
        self.admin = gateway_pb2_grpc.AdminStub(self.channel)
        return self

    async def close(self) -> None:
        await self.channel.close()
        await self.server.stop(0)

    async def workers(self) -> list[gateway_pb2.WorkerStatus]:
        return list((await self.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers)

    async def healthy(self, address: str) -> gateway_pb2.WorkerStatus | None:
        return next((w for w in await self.workers()
                     if w.address == address and w.health == gateway_pb2.WORKER_HEALTH_HEALTHY), None)

    async def generate(self, prompt: str) -> list[gateway_pb2.GatewayGenerateResponse]:
        request = gateway_pb2.GatewayGenerateRequest(
            deployment="chat", text=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=4, ignore_eos=True))
        return [reply async for reply in self.client.Generate(request, timeout=30)]


@asynccontextmanager
async def worker_behind_two_replicas(artifacts, tmp_path, monkeypatch):
    url = sqlite_url(tmp_path / "registry.db")
    deploy_artifact(url, artifacts["fp16"], monkeypatch)
    a, b = await Replica(url).start(), await Replica(url).start()
    worker = WorkerServer(WorkerConfig(
        artifact=str(artifacts["fp16"]), port=0, metrics_port=None, kv_blocks=64, drain_grace_s=5.0,
        gateway_addresses=(a.server.address, b.server.address), gateway_token="worker-secret"))
    await worker.start()
    try:
        await _until(lambda: _healthy_on_both(a, b, worker.address))
        yield worker, a, b
    finally:
        await worker.stop(0)
        await a.close()
        await b.close()


async def _healthy_on_both(a: Replica, b: Replica, address: str) -> bool:
    return await a.healthy(address) is not None and await b.healthy(address) is not None


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _served(replies: list[gateway_pb2.GatewayGenerateResponse]) -> bool:
    return sum(len(r.token_ids) for r in replies) == 4 and replies[-1].finish.reason == common_pb2.FINISH_REASON_LENGTH


def test_both_replicas_route_to_the_worker_and_one_going_away_costs_the_other_nothing(artifacts, tmp_path,
                                                                                        monkeypatch):
    async def scenario():
        async with worker_behind_two_replicas(artifacts, tmp_path, monkeypatch) as (worker, a, b):
            assert _served(await a.generate("def main():")) and _served(await b.generate("import os"))
            await b.server.stop(0)
            seen = Timestamp()
            status = await a.healthy(worker.address)
            seen.CopyFrom(status.last_heartbeat)
            # Its start-up probe's error, told at registration (the fp16 artifact on the CPU reference).
            assert status.HasField("probe_error") and status.probe_error == worker.served.probe_error
            # Heartbeats keep reaching the replica that is up (its timeout is 1 s: it would also turn
            # the worker unhealthy if they stopped), and the worker keeps serving through it.
            await _until(lambda: _heartbeat_after(a, worker.address, seen))
            await asyncio.sleep(1.5)
            assert await a.healthy(worker.address) is not None
            assert _served(await a.generate("x = 1")) and not worker.servicer.draining
            started = time.monotonic()
            await worker.drain(grace_s=0)
            # The replica that is gone refuses at once; the one that is up has removed the worker.
            assert time.monotonic() - started < 3.0
            assert [w.address for w in await a.workers()] == []

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _heartbeat_after(replica: Replica, address: str, seen: Timestamp) -> bool:
    status = await replica.healthy(address)
    return status is not None and status.last_heartbeat.ToNanoseconds() > seen.ToNanoseconds()


def test_a_drain_deregisters_from_every_replica_at_once_before_refusing_requests(artifacts, tmp_path,
                                                                                 monkeypatch):
    removals: list[bool] = []  # was the worker refusing requests when a replica removed it?

    async def scenario():
        async with worker_behind_two_replicas(artifacts, tmp_path, monkeypatch) as (worker, a, b):
            _slow_deregistration(monkeypatch, lambda: removals.append(worker.servicer.draining))
            started = time.monotonic()
            await worker.drain(grace_s=0)
            elapsed = time.monotonic() - started
            assert removals == [False, False]
            assert await a.workers() == [] and await b.workers() == []
            # One after the other would take 2 x DEREGISTER_LATENCY_S.
            assert elapsed < 1.8 * DEREGISTER_LATENCY_S, f"drain took {elapsed:.2f} s"
            assert worker.servicer.draining

    asyncio.run(asyncio.wait_for(scenario(), 60))


def _slow_deregistration(monkeypatch, on_remove) -> None:
    remove = WorkerPool.remove

    async def slow_remove(self, worker_id):
        on_remove()
        await asyncio.sleep(DEREGISTER_LATENCY_S)
        return await remove(self, worker_id)

    monkeypatch.setattr(WorkerPool, "remove", slow_remove)

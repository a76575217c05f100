"""The gateway's heartbeat check (mark overdue workers unhealthy, forget long-silent ones) must keep
running whatever one pass meets: if it stopped, a worker that hangs with its connection up would keep
getting requests for good."""

from __future__ import annotations

import asyncio

from services.gateway.deployments import ArtifactRefView
from services.gateway.errors import UnknownName
from services.gateway.pool import Health, WorkerPool
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, gateway_stack, run
from tests.gateway.fake_worker import FakeWorker, FakeWorkerServer

ARTIFACT = ArtifactRefView("a1", "tiny", "a" * 64, "w4a8kv4-g128", "cpu")


def test_forget_skips_a_silent_worker_that_deregistered_while_another_was_being_removed():
    """forget() waits on each removal (the worker's connection watcher stops); a DeregisterWorker that
    lands meanwhile must not make it fail on the worker it already found silent."""
    async def scenario():
        servers = [await FakeWorkerServer(FakeWorker(ARTIFACT.artifact_id)).start() for _ in range(2)]
        pool = WorkerPool(heartbeat_timeout_s=6.0, forget_after_s=300.0)
        try:
            for server in servers:
                worker = await pool.add(server.address, ARTIFACT, capacity=4)
                worker.last_heartbeat_mono -= 1000.0  # silent past forget_after_s
            forgetting = asyncio.ensure_future(pool.forget())
            await asyncio.sleep(0)  # forget() is now waiting on the removal of the first silent worker
            assert len(pool.workers) == 1, "forget() was expected to be part-way through"
            deregistering = next(iter(pool.workers))
            await pool.remove(deregistering)  # what DeregisterWorker does
            forgotten = await forgetting
            assert len(forgotten) == 1 and forgotten[0].worker_id != deregistering
            assert not pool.workers
        finally:
            await pool.close()
            for server in servers:
                await server.stop(0)

    run(scenario())


def test_a_failed_pass_does_not_stop_the_heartbeat_check(artifacts, monkeypatch):
    forget, failed = WorkerPool.forget, []

    async def forget_failing_once(pool: WorkerPool) -> list:
        if not failed:
            failed.append(True)
            raise UnknownName("worker 'w' is not registered")
        return await forget(pool)

    monkeypatch.setattr(WorkerPool, "forget", forget_failing_once)

    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=0.05, heartbeat_timeout_s=0.15,
                                 worker_forget_s=30.0) as stack:
            pool = stack.gateway.pool
            silent = await stack.add_worker(artifacts.stable)  # never heartbeats
            for _ in range(200):
                listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
                if failed and listed.workers[0].health == Health.UNHEALTHY.value:
                    break
                await asyncio.sleep(0.025)
            assert failed, "the heartbeat check never ran"
            assert pool.get(silent.worker_id).health is Health.UNHEALTHY, \
                "a worker silent past heartbeat_timeout_s is still healthy: the check stopped"

    run(scenario())

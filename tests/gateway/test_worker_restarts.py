"""A worker process that goes away without deregistering (a crash, a kill) and another one that starts
at the same address with another artifact: the gateway must not send the old artifact's requests to
the new process, whether the new one registers, has not registered yet, or is refused."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, WORKER, FakeWorker, FakeWorkerServer, arm_of, gateway_stack, run

RESTART_S = 0.2  # how long the address is dark between the old process and the new one


async def restart_as(stack, old: FakeWorkerServer, artifact_id: str) -> FakeWorkerServer:
    """The process at old's address dies without a word to the gateway; another starts there."""
    port = old.port
    await old.stop(0)
    await asyncio.sleep(RESTART_S)
    new = await FakeWorkerServer(FakeWorker(artifact_id, tokens=1)).start(port)
    stack.workers.append(new)
    return new


async def workers(stack) -> list[tuple[str, str, int]]:
    listed = await stack.admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
    return sorted((w.address, w.artifact.artifact_id, w.health) for w in listed.workers)


def test_a_worker_restarted_with_another_artifact_gets_none_of_the_old_artifacts_requests(artifacts):
    async def scenario():
        # a long heartbeat timeout: the old entry still looks alive when the new process comes up
        async with gateway_stack(artifacts, heartbeat_interval_s=5.0, heartbeat_timeout_s=30.0) as stack:
            old = await stack.add_worker(artifacts.stable, tokens=1)
            await stack.add_worker(artifacts.baseline, tokens=1)
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_STABLE
            new = await restart_as(stack, old, artifacts.canary)
            for i in range(4):  # before the new process registered
                assert arm_of(await stack.generate(f"p{i}")) == gateway_pb2.ARM_BASELINE
            assert new.worker.started == []
            await stack.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                address=new.address, artifact_id=artifacts.canary), metadata=WORKER)
            assert [(a, artifact) for a, artifact, _ in await workers(stack) if a == new.address] == \
                [(new.address, artifacts.canary)]
            assert arm_of(await stack.generate("after")) == gateway_pb2.ARM_BASELINE
            assert new.worker.started == []

    run(scenario())


def test_a_refused_registration_at_an_address_drops_the_stale_worker_there(artifacts):
    """The new process serves an artifact that is not READY: it is refused, and the old entry at its
    address (which never carried a request, so no broken connection told the gateway) goes too."""
    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=5.0, heartbeat_timeout_s=30.0) as stack:
            old = await stack.add_worker(artifacts.stable, tokens=1)
            await stack.add_worker(artifacts.baseline, tokens=1)
            new = await restart_as(stack, old, artifacts.pending)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stack.admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    address=new.address, artifact_id=artifacts.pending), metadata=WORKER)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert new.address not in [address for address, _, _ in await workers(stack)]
            for i in range(4):
                assert arm_of(await stack.generate(f"p{i}")) == gateway_pb2.ARM_BASELINE
            assert new.worker.started == []

    run(scenario())


def test_a_worker_whose_connection_drops_but_which_keeps_beating_serves_again(artifacts):
    """A broken connection alone is no proof the worker is gone: its next heartbeat (the same
    process, still alive) puts it back in rotation."""
    async def scenario():
        async with gateway_stack(artifacts, heartbeat_interval_s=5.0, heartbeat_timeout_s=30.0) as stack:
            worker = await stack.add_worker(artifacts.stable, tokens=1)
            await stack.add_worker(artifacts.baseline, tokens=1)
            assert arm_of(await stack.generate()) == gateway_pb2.ARM_STABLE
            port = worker.port
            await worker.stop(0)
            await asyncio.sleep(RESTART_S)
            await worker.start(port)  # the same process (same artifact, its announcer still running)
            await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=worker.worker_id), metadata=WORKER)
            assert arm_of(await stack.generate("again")) == gateway_pb2.ARM_STABLE

    run(scenario())

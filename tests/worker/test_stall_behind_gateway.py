"""A real worker whose engine hangs mid-stream (a hung device: the process and its heartbeats carry on)
behind a real gateway: its heartbeats say stalled, and the gateway ends the client's stream at once,
UNAVAILABLE with the tokens delivered, instead of leaving it to the client's deadline. Once the engine
moves again the worker takes requests again."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from services.gateway.config import FallbackBudget, GatewayConfig
from services.gateway.server import GatewayServer
from services.worker.config import WorkerConfig
from services.worker.server import WorkerServer
from shared.registry import sqlite_url
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.worker.conftest import deploy_artifact
from tests.worker.hanging import hang_steps
from tests.worker.test_drain_behind_gateway import ADMIN, TOKENS, _registered, _request, _until

STALL_TIMEOUT_S = 0.5


def test_a_stream_on_a_worker_whose_engine_hangs_ends_promptly(artifacts, tmp_path, monkeypatch):
    url = sqlite_url(tmp_path / "registry.db")
    deploy_artifact(url, artifacts["fp16"], monkeypatch)

    async def scenario():
        gateway = GatewayServer(GatewayConfig(
            registry_url=url, listen="127.0.0.1:0", admin_tokens=TOKENS, heartbeat_interval_s=0.1,
            heartbeat_timeout_s=30.0, budget=FallbackBudget(enabled=False), grace_s=0.5))
        await gateway.start()
        worker = WorkerServer(WorkerConfig(artifact=str(artifacts["fp16"]), port=0, metrics_port=None, kv_blocks=64,
                                           gateway_addresses=(gateway.address,), gateway_token="worker-secret",
                                           stall_timeout_s=STALL_TIMEOUT_S))
        await worker.start()
        runner = worker.served.engine.runner
        hang, release = hang_steps(runner)
        channel = grpc.aio.insecure_channel(gateway.address)
        client, admin = gateway_pb2_grpc.GatewayStub(channel), gateway_pb2_grpc.AdminStub(channel)

        async def listed():
            return (await admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)).workers

        try:
            await _until(lambda: _registered(listed, worker.address))
            stream = client.Generate(_request("def main():", 200))
            await stream.read()
            hang.set()  # the next step blocks, as a step on a hung device would
            hung_at = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                # without the gateway ending it, the stream would wait here for good
                while await asyncio.wait_for(stream.read(), 10) is not grpc.aio.EOF:
                    pass
            assert time.monotonic() - hung_at < 5.0
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            details = raised.value.details()
            assert re.search(r"after \d+ tokens were delivered", details) and "stalled" in details, details

            hang.clear()
            release.set()  # the device answers again
            await _until(lambda: _registered(listed, worker.address))
            replies = [r async for r in client.Generate(_request("x = 1", 2))]
            assert replies[-1].finish.generated_tokens == 2
        finally:
            release.set()
            await channel.close()
            await worker.stop(0)
            await gateway.stop(0)

    asyncio.run(asyncio.wait_for(scenario(), 60))

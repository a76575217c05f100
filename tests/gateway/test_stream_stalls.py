"""Streams that stop moving once the worker has replied (--stream-stall-timeout-s): nothing timed them out.

* A worker that hangs one stream while its engine moves (heartbeats healthy) kept its client waiting for ever.
* A client that reads nothing and does not cancel held its worker's slot for good once the buffers on the way
  (~4 MB per hop) were full: a worker of capacity 2 refused every other client as "at capacity"."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from shared.rpc.qserve.v1 import common_pb2, gateway_pb2
from tests.gateway.conftest import DEPLOYMENT, gateway_stack, run

STALL_S = 0.5


async def settles(condition, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.02)


def test_a_worker_silent_mid_stream_fails_the_stream_after_the_stall_timeout(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, stream_stall_timeout_s=STALL_S) as stack:
            hanging = await stack.add_worker(artifacts.stable, tokens=8)
            hanging.worker.hang_after = 3
            started = time.monotonic()
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                async for reply in stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT,
                                                                                        text="hi")):
                    received += reply.token_ids
            assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "failed after 3 tokens" in failed.value.details()
            assert "stream-stall timeout of 0.5 s" in failed.value.details()
            assert len(received) == 3 and time.monotonic() - started < STALL_S + 3
            worker = stack.gateway.pool.get(hanging.worker_id)
            await settles(lambda: worker.in_flight == 0 and hanging.worker.cancelled)
            assert worker.failure_streak == 1

    run(scenario())


def test_a_client_that_reads_nothing_gives_its_workers_slot_back(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, stream_stall_timeout_s=STALL_S) as stack:
            server = await stack.add_worker(artifacts.stable, capacity=1)
            server.worker.context_tokens = 10**6
            server.worker.text_padding = "x" * 4096  # ~4 KB a reply: the buffers fill within a few thousand
            request = gateway_pb2.GatewayGenerateRequest(
                deployment=DEPLOYMENT, text="hi", sampling=common_pb2.SamplingParams(max_new_tokens=50_000))
            stalled = stack.gw.Generate(request)
            assert (await stalled.read()).token_ids  # it started, then its client reads no more
            worker = stack.gateway.pool.get(server.worker_id)
            # Its stream ended on the worker too (the call cancelled, and a Worker.Abort), its slot free.
            await settles(lambda: worker.in_flight == 0 and server.worker.running == 0 and server.worker.aborts)
            assert not server.worker.finished
            replies = await stack.generate("next")  # the slot serves the next client
            assert replies[-1].HasField("finish")
            stalled.cancel()

    run(scenario(), timeout_s=60)


def test_the_stall_timeout_setting(tmp_path):
    from services.gateway.config import ConfigError, GatewayConfig

    base = ["--registry-url", f"sqlite:///{tmp_path}/registry.db"]
    assert GatewayConfig.from_args(base, environ={}).stream_stall_timeout_s == 300.0
    assert GatewayConfig.from_args([*base, "--stream-stall-timeout-s", "0"], environ={}).stream_stall_timeout_s == 0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="--stream-stall-timeout-s"):
            GatewayConfig.from_args([*base, "--stream-stall-timeout-s", bad], environ={})

"""publish -> deploy -> rollout 20% (sticky over 400 session keys) -> promote -> fallback on/off,
then a cancelled stream, a worker killed before its first token and one killed mid-stream: the real
quantizer, two real CPU workers (W4A8KV4 and the fp16 baseline) and the gateway, on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import ADMIN, Stack

pytestmark = pytest.mark.slow  # quantizes and serves the fixture model: about two minutes on 2 cores

KEYS = [f"session-{i}" for i in range(400)]
PROMPT = "def fibonacci(n):"


async def _arms(address: str, keys: list[str], concurrency: int = 32) -> dict[str, tuple[int, str]]:
    """session key -> (arm, artifact id) of one short generation per key."""
    limit = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def one(key: str) -> tuple[int, str]:
            async with limit:
                request = gateway_pb2.GatewayGenerateRequest(
                    deployment="chat", text=PROMPT, session_key=key,
                    sampling=common_pb2.SamplingParams(max_new_tokens=1))
                replies = [r async for r in stub.Generate(request)]
                assert replies[-1].HasField("finish")
                return replies[-1].arm, replies[-1].artifact_id

        results = await asyncio.gather(*(one(k) for k in keys))
    return dict(zip(keys, results))


def arms(stack: Stack, keys: list[str]) -> dict[str, tuple[int, str]]:
    return asyncio.run(_arms(stack.gateway.address, keys))


def test_publish_rollout_promote_fallback(stack: Stack):
    quantized, baseline = stack.artifacts["w4a8kv4-g128"], stack.artifacts["fp16"]
    # the fp16 artifact serves first; the W4A8KV4 artifact is rolled out as its canary
    created = stack.qctl("deploy", "create", "chat", "--stable", baseline, "--baseline", baseline)
    assert created.exit_code == 0, created.output
    started = stack.qctl("rollout", "start", "chat", "--canary", quantized, "--percent", "20")
    assert started.exit_code == 0, started.output

    first = arms(stack, KEYS)
    on_canary = [k for k, (arm, _) in first.items() if arm == gateway_pb2.ARM_CANARY]
    assert 0.15 <= len(on_canary) / len(KEYS) <= 0.25, len(on_canary)
    assert {first[k][1] for k in on_canary} == {quantized}
    assert {a for k, (arm, a) in first.items() if arm == gateway_pb2.ARM_STABLE} == {baseline}
    assert arms(stack, KEYS) == first  # each key reached the same version again

    status = stack.qctl("rollout", "status", "chat")
    assert status.exit_code == 0 and "canary" in status.stdout and "tpot p50 / p95" in status.stdout

    promoted = stack.qctl("rollout", "promote", "chat")
    assert promoted.exit_code == 0, promoted.output
    after = arms(stack, KEYS[:64])
    assert set(after.values()) == {(gateway_pb2.ARM_STABLE, quantized)}

    switched = time.monotonic()
    assert stack.qctl("fallback", "on", "chat", "--reason", "integration drill").exit_code == 0
    during = arms(stack, KEYS[:64])
    assert set(during.values()) == {(gateway_pb2.ARM_BASELINE, baseline)}
    assert time.monotonic() - switched < 30  # (the switch itself is checked within a second in tests/gateway)
    assert stack.qctl("fallback", "off", "chat", "--reason", "drill over").exit_code == 0
    assert set(arms(stack, KEYS[:64]).values()) == {(gateway_pb2.ARM_STABLE, quantized)}

    channel, admin = stack.admin()
    with channel:
        events = admin.ListEvents(gateway_pb2.ListEventsRequest(deployment="chat"), metadata=ADMIN).events
    log = [(e.kind, e.actor, json.loads(e.detail).get("reason")) for e in events]
    assert log[:5] == [("fallback_off", "ops", "drill over"), ("fallback_on", "ops", "integration drill"),
                       ("promote", "ops", None), ("rollout_start", "ops", None), ("deployment_create", "ops", None)]


async def _long_stream(stack: Stack, on_tokens, max_new_tokens: int = 400) -> tuple[list[int], grpc.aio.AioRpcError | None]:
    """Streams one long generation, calling on_tokens(received, call) after every message."""
    received: list[int] = []
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GatewayGenerateRequest(
            deployment="chat", text=PROMPT,
            sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)))
        try:
            async for reply in call:
                received.extend(reply.token_ids)
                if await on_tokens(received, call):
                    break
        except grpc.aio.AioRpcError as err:
            return received, err
    return received, None


def _worker_info(address: str) -> worker_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)


def test_cancel_and_killed_workers(stack: Stack):
    quantized, baseline = stack.artifacts["w4a8kv4-g128"], stack.artifacts["fp16"]
    channel, admin = stack.admin()
    with channel:
        listed = admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN).workers
    address = {w.artifact.artifact_id: w.address for w in listed}

    # a client that cancels: the worker aborts and frees the KV blocks
    async def cancel_after_three(received, call):
        if len(received) >= 3:
            call.cancel()
            return True
        return False

    received, error = asyncio.run(_long_stream(stack, cancel_after_three))
    assert error is None and len(received) >= 3
    deadline = time.monotonic() + 10
    while (info := _worker_info(address[quantized])).running_requests or info.kv_blocks_free != info.kv_blocks_total:
        assert time.monotonic() < deadline, f"the worker still holds the cancelled request: {info}"
        time.sleep(0.1)

    # the quantized worker dies while idle; the gateway still counts it healthy (heartbeat not yet
    # overdue), so the next request fails there before its first token and is retried elsewhere
    stack.workers[quantized].kill()
    replies = arms(stack, ["after-kill"])
    assert replies["after-kill"] == (gateway_pb2.ARM_BASELINE, baseline)
    with grpc.insecure_channel(stack.gateway.address) as channel:
        listed = gateway_pb2_grpc.AdminStub(channel).ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
    health = {w.artifact.artifact_id: w.health for w in listed.workers}
    assert health[quantized] == gateway_pb2.WORKER_HEALTH_UNHEALTHY

    # the baseline worker dies mid-stream: UNAVAILABLE naming how many tokens were delivered
    async def kill_after_five(received, call):
        if len(received) >= 5 and stack.workers[baseline].process.poll() is None:
            await asyncio.to_thread(stack.workers[baseline].kill)
        return False

    received, error = asyncio.run(_long_stream(stack, kill_after_five))
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert f"after {len(received)} tokens were delivered" in error.details()
    assert 5 <= len(received) < 400

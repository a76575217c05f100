"""The gateway's /metrics page as Prometheus scrapes it, after real Generate traffic: naming, per-arm
and per-artifact series of a canary rollout (what operators and the automatic guard judge it by),
the open-streams gauge back at idle, and histogram buckets that hold realistic latencies."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from prometheus_client import generate_latest

from services.gateway.metrics import GatewayMetrics, Outcome
from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, WORKER, arm_of, gateway_stack, run
from tests.prometheus_scrape import bucket_bounds, check_conventions, families, scrape_text, series_labels, value

KEYS = [f"user-{i}" for i in range(40)]


async def scrape(stack) -> dict:
    return families(await asyncio.to_thread(scrape_text, stack.gateway.metrics_port))


async def start_rollout(stack, percent: int) -> None:
    await stack.admin.StartRollout(gateway_pb2.StartRolloutRequest(
        deployment=DEPLOYMENT, canary_artifact_id=stack.artifacts.canary, canary_percent=percent), metadata=ADMIN)


def test_each_arm_counts_each_of_its_requests_once_under_conventional_names(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, metrics_port=0, metrics_host="127.0.0.1") as stack:
            await stack.add_worker(artifacts.stable, tokens=3, max_running=64)
            await stack.add_worker(artifacts.canary, tokens=3, max_running=64)
            await start_rollout(stack, 50)
            results = await asyncio.gather(*(stack.generate("q", session_key=k) for k in KEYS))
            served = {"stable": 0, "canary": 0}
            for replies in results:
                served["canary" if arm_of(replies) == gateway_pb2.ARM_CANARY else "stable"] += 1
            assert served["stable"] and served["canary"]
            fams = await scrape(stack)
            check_conventions(fams, "qserve_gateway_")
            for arm, artifact in (("stable", artifacts.stable), ("canary", artifacts.canary)):
                labels = dict(arm=arm, artifact=artifact, deployment=DEPLOYMENT)
                n = served[arm]
                assert value(fams, "qserve_gateway_requests_total", **labels) == n
                assert value(fams, "qserve_gateway_generated_tokens_total", **labels) == 3 * n
                assert value(fams, "qserve_gateway_time_to_first_token_seconds_count", **labels) == n
                assert value(fams, "qserve_gateway_time_per_output_token_seconds_count", **labels) == n
                # Exported at 0 from the arm's first request: an error-rate query of a healthy canary
                # reads 0, not "no data" (which an alert cannot tell from a scrape that failed).
                assert value(fams, "qserve_gateway_errors_total", **labels) == 0
            # Labels hold only deployments, arms and artifacts: never a session key or request id.
            for labels in series_labels(fams, "qserve_gateway_requests_total"):
                assert set(labels) == {"deployment", "arm", "artifact"}
                assert labels["arm"] in ("stable", "canary", "baseline")
            assert value(fams, "qserve_gateway_open_streams") == 0

    run(scenario(), timeout_s=60)


def test_a_server_error_counts_once_and_does_not_skew_the_latency_histograms(artifacts):
    """A stream that broke after two tokens is one error of its arm. Its token gaps run up to the
    failure (a dead worker's can be a keepalive timeout), so, as in RolloutStatus and the automatic
    guard, they are no latency sample: the histograms and the guard judge a canary alike."""
    async def scenario():
        async with gateway_stack(artifacts, metrics_port=0, metrics_host="127.0.0.1") as stack:
            worker = await stack.add_worker(artifacts.stable, tokens=4)
            worker.worker.fail_after = 2
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stack.generate()
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            fams = await scrape(stack)
            labels = dict(arm="stable", artifact=artifacts.stable, deployment=DEPLOYMENT)
            assert value(fams, "qserve_gateway_requests_total", **labels) == 1
            assert value(fams, "qserve_gateway_errors_total", **labels) == 1
            assert value(fams, "qserve_gateway_generated_tokens_total", **labels) == 2  # delivered
            assert not value(fams, "qserve_gateway_time_per_output_token_seconds_count", **labels)
            assert not value(fams, "qserve_gateway_time_to_first_token_seconds_count", **labels)
            stats = stack.gateway.metrics.stats(DEPLOYMENT, artifacts.stable, since=0)
            assert stats.requests == 1 and stats.errors == 1 and stats.ttft_p95_s == 0 and stats.tpot_p95_s == 0

    run(scenario(), timeout_s=60)


def test_open_streams_returns_to_zero_after_a_client_cancels(artifacts):
    async def scenario():
        async with gateway_stack(artifacts, metrics_port=0, metrics_host="127.0.0.1") as stack:
            await stack.add_worker(artifacts.stable, tokens=1000, delay_s=0.01)
            call = stack.gw.Generate(gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hello"))
            await call.read()
            assert value(await scrape(stack), "qserve_gateway_open_streams") == 1
            call.cancel()
            for _ in range(200):
                if value(await scrape(stack), "qserve_gateway_open_streams") == 0:
                    break
                await asyncio.sleep(0.02)
            fams = await scrape(stack)
            assert value(fams, "qserve_gateway_open_streams") == 0
            labels = dict(arm="stable", artifact=artifacts.stable, deployment=DEPLOYMENT)
            assert value(fams, "qserve_gateway_requests_total", **labels) == 1  # counted once, not an error
            assert value(fams, "qserve_gateway_errors_total", **labels) == 0

    run(scenario(), timeout_s=60)


def test_calls_the_gateway_refuses_are_counted_by_status_code(artifacts):
    """Load shed at the gateway, bad keys, bad input and unknown deployments: one count each, by code only."""
    async def scenario():
        async with gateway_stack(artifacts, metrics_port=0, metrics_host="127.0.0.1", api_keys=["k"],
                                 max_concurrent_streams=1) as stack:
            await stack.add_worker(artifacts.stable, tokens=3, delay_s=0.2)
            key = (("authorization", "Bearer k"),)
            held = asyncio.create_task(stack.generate("holds the one stream", metadata=key))
            while stack.gateway.gateway.open_streams < 1:
                await asyncio.sleep(0.01)
            calls = [dict(metadata=key),  # RESOURCE_EXHAUSTED: the one stream is taken
                     dict(metadata=(("authorization", "Bearer wrong"),)),  # UNAUTHENTICATED
                     dict(metadata=key, deployment="no-such-deployment")]  # NOT_FOUND or INVALID_ARGUMENT
            codes = []
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stack.generate("x", **call)
                codes.append(raised.value.code().name)
            await held
            fams = await scrape(stack)
            check_conventions(fams, "qserve_gateway_")
            for code in codes:
                assert value(fams, "qserve_gateway_rejected_requests_total", code=code) == codes.count(code), code
            assert {tuple(sorted(labels)) for labels in series_labels(fams, "qserve_gateway_rejected_requests_total")} \
                == {("code",)}

    run(scenario(), timeout_s=60)


def test_latency_buckets_reach_from_milliseconds_to_a_minute():
    """TPOT is milliseconds; TTFT under load (a long queue, a long prompt) is tens of seconds, and
    the gateway's TTFT holds the worker's (whose buckets reach 60 s) plus routing: past the last
    finite bucket histogram_quantile can only answer that bucket's bound."""
    metrics = GatewayMetrics()
    metrics.record("d", "stable", "a", Outcome(at=0.0, server_error=False, ttft_s=25.0, tpot_s=0.004, tokens=9))
    fams = families(generate_latest(metrics.registry).decode())
    for name in ("qserve_gateway_time_to_first_token_seconds", "qserve_gateway_time_per_output_token_seconds"):
        bounds = bucket_bounds(fams, name)
        assert bounds[0] <= 0.002 and bounds[-1] >= 60, (name, bounds)
    labels = dict(arm="stable", artifact="a", deployment="d")
    # the 25 s TTFT falls in a finite bucket below a minute
    assert value(fams, "qserve_gateway_time_to_first_token_seconds_bucket", le="30.0", **labels) == 1


def test_an_artifact_idle_for_a_day_has_its_series_and_requests_forgotten():
    """Each rollout left the retired artifact's ~44 series and up to 20,000 requests in memory for good."""
    from services.gateway.metrics import FORGET_IDLE_S

    metrics, now = GatewayMetrics(), time.time()
    for arm, artifact, at in (("stable", "old", now - FORGET_IDLE_S - 1), ("canary", "old", now - FORGET_IDLE_S - 5),
                              ("stable", "new", now - 60)):
        metrics.record("d", arm, artifact, Outcome(at=at, server_error=arm == "canary", ttft_s=0.1, tpot_s=0.01,
                                                  tokens=3))
    assert metrics.forget_idle(now) == 1
    exported = generate_latest(metrics.registry).decode()
    assert 'artifact="old"' not in exported and 'artifact="new"' in exported
    assert metrics.window("d", "old", 0, now) == [] and len(metrics.window("d", "new", 0, now)) == 1
    assert metrics.forget_idle(now) == 0


def test_no_log_line_carries_the_prompt_or_the_api_key(artifacts, caplog):
    secret_prompt, api_key = "my card number is 4111-1111", "sk-live-0123456789"

    async def scenario():
        async with gateway_stack(artifacts, api_keys=[api_key]) as stack:
            worker = await stack.add_worker(artifacts.stable, tokens=4)
            worker.worker.fail_after = 2
            with pytest.raises(grpc.aio.AioRpcError):
                await stack.generate(secret_prompt, metadata=(("authorization", f"Bearer {api_key}"),))
            with pytest.raises(grpc.aio.AioRpcError):
                await stack.generate(secret_prompt, metadata=(("authorization", "Bearer wrong-key"),))

    with caplog.at_level(logging.DEBUG):
        run(scenario(), timeout_s=60)
    assert caplog.records  # the failure was logged
    for record in caplog.records:
        message = record.getMessage()
        assert secret_prompt not in message and api_key not in message and "wrong-key" not in message
        assert "\n" not in message, message


def test_a_failed_attempt_is_one_log_line_whatever_the_client_or_worker_sent(artifacts, caplog):
    """A client's request_id and a worker's error details (a CUDA error's text spans four lines) are
    not the gateway's to trust: raw in a log line they split one event into several, or forge one."""
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            worker = await stack.add_worker(artifacts.stable, tokens=4)
            worker.worker.fail_after = 2
            request = gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hello",
                                                         request_id="r1\n2030-01-01 INFO forged: all good")
            with pytest.raises(grpc.aio.AioRpcError):
                [reply async for reply in stack.gw.Generate(request)]

    with caplog.at_level(logging.INFO):
        run(scenario(), timeout_s=60)
    failed = [r.getMessage() for r in caplog.records if "failed after" in r.getMessage()]
    assert failed and all("\n" not in message for message in failed), failed


def test_the_workers_gauge_counts_each_health_at_scrape_time(artifacts):
    """Stalled and quarantined workers were visible only in logs: no alert could fire on them."""
    async def scenario():
        async with gateway_stack(artifacts, metrics_port=0, metrics_host="127.0.0.1") as stack:
            servers = [await stack.add_worker(artifacts.stable) for _ in range(4)]
            beats = [dict(draining=True), dict(stalled=True, draining=True), {}, {}]
            for server, beat in zip(servers, beats):
                await stack.admin.Heartbeat(gateway_pb2.HeartbeatRequest(worker_id=server.worker_id, **beat),
                                            metadata=WORKER)
            pool = stack.gateway.pool
            pool.mark_failed(pool.get(servers[3].worker_id), "boom")
            fams = await scrape(stack)
            check_conventions(fams, "qserve_gateway_")
            counts = {h: value(fams, "qserve_gateway_workers", health=h)
                      for h in ("healthy", "draining", "stalled", "quarantined", "unhealthy")}
            assert counts == {"healthy": 1, "draining": 1, "stalled": 1, "quarantined": 0, "unhealthy": 1}
            bad = pool.get(servers[3].worker_id)
            pool._quarantine(bad, "boom")  # another healthy worker serves its artifact
            assert bad.quarantined_until > time.monotonic()
            assert value(await scrape(stack), "qserve_gateway_workers", health="quarantined") == 1
            # Then it stops heartbeating: lost, not only quarantined (it read "quarantined" until its quarantine
            # ended, and could be forgotten without ever showing as unhealthy).
            bad.last_heartbeat_mono -= pool.heartbeat_timeout_s + 1
            pool.expire()
            fams = await scrape(stack)
            assert value(fams, "qserve_gateway_workers", health="quarantined") == 0
            assert value(fams, "qserve_gateway_workers", health="unhealthy") == 1
            assert bad.health_reason().startswith("no heartbeat for ")

    run(scenario())

"""qctl deploy / rollout / fallback / workers / events / generate against a gateway with fake workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from typer.testing import CliRunner

from qctl.main import app
from services.gateway.config import FallbackBudget, GatewayConfig
from services.gateway.server import BackgroundGateway
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import TOKENS, WORKER, Artifacts
from tests.gateway.fake_worker import FakeWorker, FakeWorkerServer, expected_tokens

runner = CliRunner()


@pytest.fixture
def gateway(artifacts: Artifacts) -> Iterator[BackgroundGateway]:
    background = BackgroundGateway(GatewayConfig(registry_url=artifacts.url, listen="127.0.0.1:0", admin_tokens=TOKENS,
                                                 budget=FallbackBudget(enabled=False), grace_s=0.5))
    workers = []

    async def start_workers():
        import grpc

        async with grpc.aio.insecure_channel(background.address) as channel:
            admin = gateway_pb2_grpc.AdminStub(channel)
            for artifact_id in (artifacts.stable, artifacts.canary, artifacts.baseline):
                server = await FakeWorkerServer(FakeWorker(artifact_id, tokens=3)).start()
                workers.append(server)
                await admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    address=server.address, artifact_id=artifact_id), metadata=WORKER)

    background.call(start_workers())
    yield background

    async def stop_workers():
        for server in workers:
            await server.stop(0)

    background.call(stop_workers())
    background.stop(0)


def qctl(gateway: BackgroundGateway, *args: str, token: str = "admin-secret"):
    env = {"QCTL_GATEWAY": gateway.address, "QCTL_TOKEN": token, "COLUMNS": "250"}
    return runner.invoke(app, list(args), env=env)


def test_deploy_rollout_fallback_and_generate_through_qctl(gateway, artifacts):
    created = qctl(gateway, "deploy", "create", "chat", "--stable", artifacts.stable, "--baseline", artifacts.baseline)
    assert created.exit_code == 0, created.output
    assert "deployment chat" in created.stdout and artifacts.stable[:12] in created.stdout

    started = qctl(gateway, "rollout", "start", "chat", "--canary", artifacts.canary, "--percent", "20")
    assert started.exit_code == 0 and "at 20%" in started.stdout

    for key in ("a", "b", "c"):
        out = qctl(gateway, "generate", "hello", "-d", "chat", "--session-key", key, "--max-new-tokens", "3")
        assert out.exit_code == 0, out.output
        assert out.stdout.startswith("".join(f"<{t}>" for t in expected_tokens(list(b"hello"), 3)))
        assert "[length] 3 tokens from" in out.stderr

    status = qctl(gateway, "rollout", "status", "chat")
    assert status.exit_code == 0, status.output
    for expected in ("stable", "canary", "baseline", "requests", "tpot p50 / p95", "healthy workers",
                     "all replicas: requests / errors", "all replicas: ttft / tpot p95"):
        assert expected in status.stdout

    on = qctl(gateway, "fallback", "on", "chat", "--reason", "drill")
    assert on.exit_code == 0 and "ON" in on.stdout and "drill" in on.stdout
    out = qctl(gateway, "generate", "hello", "-d", "chat")
    assert f"from baseline {artifacts.baseline[:12]}" in out.stderr
    assert qctl(gateway, "fallback", "off", "chat").exit_code == 0

    stale = qctl(gateway, "rollout", "promote", "chat", "--canary", artifacts.baseline)
    assert stale.exit_code != 0 and "FAILED_PRECONDITION" in stale.stderr and artifacts.canary in stale.stderr
    promoted = qctl(gateway, "rollout", "promote", "chat", "--canary", artifacts.canary)
    assert promoted.exit_code == 0 and f"stable    {artifacts.canary[:12]}" in promoted.stdout

    workers = qctl(gateway, "workers")
    assert workers.exit_code == 0 and workers.stdout.count("HEALTHY") == 3
    assert "why unhealthy" in workers.stdout
    assert "context" in workers.stdout and workers.stdout.count("2048") == 3  # each worker's window, from its Info
    assert "probe" in workers.stdout and workers.stdout.count("0.031") == 3  # each worker's start-up probe error
    events = qctl(gateway, "events", "-d", "chat")
    assert events.exit_code == 0
    for kind in ("promote", "fallback_off", "fallback_on", "rollout_start", "deployment_create"):
        assert kind in events.stdout
    listed = qctl(gateway, "deploy", "ls")
    assert listed.exit_code == 0 and "chat" in listed.stdout


def test_qctl_errors_are_one_line_and_exit_nonzero(gateway, artifacts):
    denied = qctl(gateway, "fallback", "on", "chat", token="worker-secret")
    assert denied.exit_code == 2 and denied.stderr.count("\n") == 1
    assert "PERMISSION_DENIED" in denied.stderr
    missing = qctl(gateway, "rollout", "status", "nope")
    assert missing.exit_code == 2 and "NOT_FOUND" in missing.stderr and "'nope'" in missing.stderr
    bad_percent = qctl(gateway, "rollout", "start", "chat", "--canary", artifacts.canary, "--percent", "0")
    assert bad_percent.exit_code == 2 and "percent" in bad_percent.output
    both = qctl(gateway, "generate", "hi", "--token-ids", "1,2", "-d", "chat")
    assert both.exit_code == 2 and "exactly one" in both.output
    unreachable = runner.invoke(app, ["workers", "--gateway", "127.0.0.1:1", "--token", "x"])
    assert unreachable.exit_code == 2 and "127.0.0.1:1" in unreachable.stderr

"""TLS between every client and server of the stack: a real gateway, a fake worker announced by the real
announcer and qctl, over TLS and mutual TLS; and each way it can be set up wrong (another CA, a client
without its certificate, TLS on one side only) failing at once with a line that says which setting to
look at, never hanging. The flags themselves: tests/test_service_config.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from qctl.main import app
from services.gateway.config import FallbackBudget, GatewayConfig
from services.gateway.server import BackgroundGateway
from services.quantizer.config import QuantizerConfig
from services.quantizer.server import BackgroundQuantizer
from services.worker.announce import GatewayAnnouncer
from services.worker.engine.outputs import EngineStats
from shared.registry import sqlite_url
from shared.rpc import probe
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2_grpc
from shared.rpc.serving import BackgroundLoop, listen
from shared.rpc.tls import ClientTls, ReloadingClientTls, ServerTls, TlsError, load_client_tls, load_server_tls
from shared.storage import StorageConfig
from tests.gateway.conftest import ADMIN, TOKENS, WORKER, Artifacts, seed_artifacts
from tests.gateway.fake_worker import FakeWorker, expected_tokens
from tests.tls.certs import Certs, install_file, make_certs

runner = CliRunner()
PROMPT_S = 5.0  # a refused connection must end well within this (grpc's own connect timeout is 20 s)


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def artifacts(tmp_path: Path) -> Artifacts:
    return seed_artifacts(sqlite_url(tmp_path / "registry.db"))


def _server_tls(certs: Certs, mtls: bool = False, cert: Path | None = None, key: Path | None = None) -> ServerTls:
    return load_server_tls(cert or certs.server_cert, key or certs.server_key, certs.ca if mtls else None)


def _client_tls(certs: Certs, mtls: bool = False) -> ClientTls:
    return load_client_tls(certs.ca, certs.client_cert if mtls else None, certs.client_key if mtls else None)


def _load():
    idle = EngineStats(running=0, waiting=0, kv_blocks_total=8, kv_blocks_free=8, kv_blocks_used=0, preemptions=0)
    return idle, False


@dataclass
class Running:
    gateway: BackgroundGateway
    worker_address: str = ""


async def _start_worker(artifact_id: str, tls: ServerTls | None, delay_s: float = 0.0) -> tuple[grpc.aio.Server, str]:
    """A fake worker whose port is opened by the services' own `listen`, over TLS or plaintext."""
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(FakeWorker(artifact_id, tokens=3, delay_s=delay_s), server)
    port = listen(server, "127.0.0.1:0", "test worker", RuntimeError, tls)
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextmanager
def tls_stack(artifacts: Artifacts, certs: Certs, mtls: bool) -> Iterator[Running]:
    """A gateway serving TLS (requiring client certificates with mtls) that dials workers over TLS, and a
    fake worker serving TLS that the real announcer registers with the gateway over TLS."""
    gateway = BackgroundGateway(GatewayConfig(
        registry_url=artifacts.url, listen="127.0.0.1:0", admin_tokens=TOKENS, budget=FallbackBudget(enabled=False),
        grace_s=0.5, tls=_server_tls(certs, mtls), worker_tls=_client_tls(certs, mtls)))
    running = Running(gateway)

    async def start():
        server, running.worker_address = await _start_worker(artifacts.stable, _server_tls(certs, mtls))
        announcer = GatewayAnnouncer(gateway.address, "worker-secret", running.worker_address, artifacts.stable, _load,
                                     min_backoff_s=0.05, tls=_client_tls(certs, mtls))
        announcer.start()
        deadline = time.monotonic() + PROMPT_S
        while announcer.worker_id is None:
            assert time.monotonic() < deadline, "the worker did not register over TLS"
            await asyncio.sleep(0.01)
        return server, announcer

    try:
        worker, announcer = gateway.call(start())
    except BaseException:
        gateway.stop(0)
        raise
    try:
        yield running
    finally:
        gateway.call(announcer.stop())
        gateway.call(worker.stop(0))
        gateway.stop(0)


def qctl(gateway_address: str, *args: str, **tls: Path | str):
    """qctl with its settings from the environment, as an operator's shell would give them."""
    env = {"QCTL_GATEWAY": gateway_address, "QCTL_TOKEN": "admin-secret", "COLUMNS": "250",
           "QCTL_TLS_CA": "", "QCTL_TLS_CLIENT_CERT": "", "QCTL_TLS_CLIENT_KEY": ""}
    env.update({f"QCTL_TLS_{name.upper()}": str(value) for name, value in tls.items()})
    started = time.monotonic()
    result = runner.invoke(app, list(args), env=env)
    assert time.monotonic() - started < PROMPT_S, f"qctl took {time.monotonic() - started:.1f} s: {result.output}"
    return result


def _refused(result) -> str:
    """qctl's refusal: exit code 2 and one line, no traceback."""
    assert result.exit_code == 2, result.output
    message = result.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message and "Traceback" not in message, message
    return message


@pytest.mark.parametrize("mtls", [False, True], ids=["tls", "mtls"])
def test_gateway_worker_and_qctl_over_tls(mtls, artifacts, certs):
    client = {"ca": certs.ca, **({"client_cert": certs.client_cert, "client_key": certs.client_key} if mtls else {})}
    with tls_stack(artifacts, certs, mtls) as stack:
        address = stack.gateway.address
        listed = qctl(address, "workers", **client)
        assert listed.exit_code == 0, listed.output
        assert stack.worker_address in listed.stdout and "HEALTHY" in listed.stdout

        created = qctl(address, "deploy", "create", "chat", "--stable", artifacts.stable, "--baseline",
                       artifacts.baseline, **client)
        assert created.exit_code == 0, created.output
        # The gateway streams from the worker over its own TLS channel (WorkerPool.dial).
        generated = qctl(address, "generate", "hello", "-d", "chat", "--max-new-tokens", "3", **client)
        assert generated.exit_code == 0, generated.output
        assert generated.stdout.startswith("".join(f"<{t}>" for t in expected_tokens(list(b"hello"), 3)))

        if mtls:  # trusting the server is not enough: the gateway wants a certificate its CA signed
            message = _refused(qctl(address, "workers", ca=certs.ca))
            assert f"cannot reach the gateway at {address}" in message and "client certificate" in message
            foreign = _refused(qctl(address, "workers", ca=certs.ca, client_cert=certs.other_client_cert,
                                    client_key=certs.other_client_key))
            assert "client certificate" in foreign


def test_a_server_certificate_from_another_ca_is_refused(artifacts, certs):
    with tls_stack(artifacts, certs, mtls=False) as stack:
        address = stack.gateway.address
        message = _refused(qctl(address, "workers", ca=certs.other_ca))
        assert f"cannot reach the gateway at {address}" in message
        assert "does not verify against --tls-ca / QCTL_TLS_CA" in message


def test_qctl_without_tls_against_a_tls_gateway_is_refused_at_once(artifacts, certs):
    with tls_stack(artifacts, certs, mtls=False) as stack:
        message = _refused(qctl(stack.gateway.address, "workers"))
        assert f"cannot reach the gateway at {stack.gateway.address}" in message
        assert "if it serves TLS, give its CA certificate with --tls-ca / QCTL_TLS_CA" in message
        # The same through --gateway and an empty QCTL_TLS_CA: the flag names the address.
        generate = _refused(qctl("", "generate", "hi", "-d", "chat", "--gateway", stack.gateway.address))
        assert stack.gateway.address in generate and "--tls-ca" in generate


def test_qctl_with_tls_against_a_plaintext_server_is_refused_at_once(certs):
    async def plaintext():
        return await _start_worker("a" * 32, None)

    loop = BackgroundLoop("tls-test")  # the server runs there while qctl blocks this thread
    server, address = loop.call(plaintext(), 30.0)
    try:
        message = _refused(qctl(address, "workers", ca=certs.ca))
        assert f"cannot reach the gateway at {address}" in message
        assert "does not speak TLS" in message and "--tls-ca / QCTL_TLS_CA" in message
    finally:
        loop.call(server.stop(0), 30.0)
        loop.close()


def test_the_gateway_refuses_a_worker_it_cannot_reach_over_its_tls_setting(artifacts, certs):
    """A worker serving plaintext to a gateway that dials TLS, the reverse, and a worker whose certificate
    the gateway's CA did not sign: registration fails like any worker that cannot be reached (UNAVAILABLE,
    not in the pool), saying which setting to look at."""

    async def scenario(gateway: BackgroundGateway, worker_tls: ServerTls | None):
        server, worker_address = await _start_worker(artifacts.stable, worker_tls)
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                admin = gateway_pb2_grpc.AdminStub(channel)
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                        address=worker_address, artifact_id=artifacts.stable), metadata=WORKER)
                assert time.monotonic() - started < PROMPT_S
                listed = await admin.ListWorkers(gateway_pb2.ListWorkersRequest(), metadata=ADMIN)
            assert not listed.workers
            return worker_address, refused.value
        finally:
            await server.stop(0)

    for gateway_ca, worker_tls, says in ((certs.ca, None, "does not speak TLS"),
                                         (None, _server_tls(certs), "if it serves TLS, give its CA certificate"),
                                         (certs.other_ca, _server_tls(certs), "does not verify against")):
        gateway = BackgroundGateway(GatewayConfig(
            registry_url=artifacts.url, listen="127.0.0.1:0", admin_tokens=TOKENS,
            budget=FallbackBudget(enabled=False), grace_s=0.5, worker_tls=load_client_tls(gateway_ca, None, None)))
        try:
            worker_address, refused = gateway.call(scenario(gateway, worker_tls))
        finally:
            gateway.stop(0)
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert f"cannot reach the worker at {worker_address}" in refused.details() and says in refused.details()
        assert "the gateway's --tls-ca" in refused.details()


def test_a_worker_dialling_a_tls_gateway_in_plaintext_keeps_retrying_and_says_why(artifacts, certs, caplog):
    with tls_stack(artifacts, certs, mtls=False) as stack:
        async def announce_in_plaintext():
            announcer = GatewayAnnouncer(stack.gateway.address, "worker-secret", stack.worker_address,
                                         artifacts.stable, _load, min_backoff_s=0.05, max_backoff_s=0.1)
            announcer.start()
            await asyncio.sleep(0.5)
            registered = announcer.worker_id
            await announcer.stop()
            return registered

        with caplog.at_level(logging.WARNING, logger="services.worker.announce"):
            assert stack.gateway.call(announce_in_plaintext()) is None
        warnings = [r.getMessage() for r in caplog.records if r.name == "services.worker.announce"]
        assert warnings and all("if it serves TLS, give its CA certificate with --tls-ca" in w for w in warnings)


def test_qctl_lists_artifacts_from_a_quantizer_over_tls(tmp_path, certs):
    quantizer = BackgroundQuantizer(QuantizerConfig(
        registry_url=sqlite_url(tmp_path / "registry.db"),
        store=StorageConfig.from_command_line(str(tmp_path / "store"), None, "us-east-1", {}),
        create_bucket=True, work_dir=tmp_path / "work", listen="127.0.0.1:0", tls=_server_tls(certs, mtls=True)))
    try:
        listed = qctl("", "ls", "--quantizer", quantizer.address, ca=certs.ca, client_cert=certs.client_cert,
                      client_key=certs.client_key)
        assert listed.exit_code == 0, listed.output
        assert "no models registered" in listed.stdout
        message = _refused(qctl("", "ls", "--quantizer", quantizer.address))
        assert f"cannot reach the quantizer at {quantizer.address}" in message and "QCTL_TLS_CA" in message
    finally:
        quantizer.stop(0)


def test_qctl_names_a_tls_file_it_cannot_use(tmp_path, certs):
    missing = tmp_path / "missing.pem"
    message = _refused(qctl("127.0.0.1:1", "workers", ca=missing))
    assert "--tls-ca / QCTL_TLS_CA" in message and str(missing) in message
    message = _refused(qctl("127.0.0.1:1", "workers", ca=certs.ca, client_cert=certs.client_cert))
    assert "--tls-client-cert / QCTL_TLS_CLIENT_CERT and --tls-client-key / QCTL_TLS_CLIENT_KEY go together" in message


def test_the_health_probe_over_tls_checks_the_certificate_name(certs, capsys):
    """grpc checks the certificate against the host dialled, an IP address too; a container's health check
    dials 127.0.0.1 while the certificate names the service: --tls-server-name."""

    async def serve(cert: Path, key: Path):
        server = grpc.aio.server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = listen(server, "127.0.0.1:0", "test", RuntimeError, _server_tls(certs, cert=cert, key=key))
        await server.start()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        return server, f"127.0.0.1:{port}"

    loop = BackgroundLoop("tls-test")  # the servers run there while probe blocks this thread
    server, address = loop.call(serve(certs.server_cert, certs.server_key), 30.0)
    named, named_address = loop.call(serve(certs.named_cert, certs.named_key), 30.0)
    try:
        assert probe.main([address, "--tls-ca", str(certs.ca)]) == 0
        assert probe.main([address]) == 1
        assert "if it serves TLS, give its CA certificate with --tls-ca" in capsys.readouterr().err
        assert probe.main([named_address, "--tls-ca", str(certs.ca)]) == 1  # issued for gateway.internal only
        assert "not issued for the host dialled" in capsys.readouterr().err
        assert probe.main([named_address, "--tls-ca", str(certs.ca), "--tls-server-name", "gateway.internal"]) == 0
        assert probe.main([address, "--tls-server-name", "gateway.internal"]) == 2
        assert probe.main([address, "--tls-ca", str(certs.server_key)]) == 2
        assert "holds no PEM certificate" in capsys.readouterr().err
    finally:
        loop.call(server.stop(0), 30.0)
        loop.call(named.stop(0), 30.0)
        loop.close()



def test_a_server_picks_up_renewed_certificate_files_and_keeps_serving_through_a_half_written_rotation(
        tmp_path, certs, caplog, capsys):
    """A renewed certificate is served to new connections without a restart; a rotation caught half way
    (the new certificate beside the old key) is logged and the old pair stays in service."""
    cert, key = tmp_path / "server.pem", tmp_path / "server-key.pem"
    install_file(certs.server_cert, cert)
    install_file(certs.server_key, key)
    renewed = make_certs(tmp_path / "renewed")  # another CA: a connection tells which pair was served

    loop = BackgroundLoop("tls-reload-test")
    server, address = loop.call(_serve_health(load_server_tls(cert, key, None)), 30.0)
    try:
        assert probe.main([address, "--tls-ca", str(certs.ca)]) == 0
        with caplog.at_level(logging.INFO, logger="shared.rpc.tls"):
            install_file(renewed.server_cert, cert)  # the key is not there yet
            assert probe.main([address, "--tls-ca", str(certs.ca)]) == 0
            assert probe.main([address, "--tls-ca", str(certs.ca)]) == 0  # refused once, not re-read per connection
            warnings = [r for r in caplog.records if "cannot be served" in r.getMessage()]
            assert len(warnings) == 1 and "is not the private key of the certificate" in warnings[0].getMessage()
            install_file(renewed.server_key, key)
            assert probe.main([address, "--tls-ca", str(renewed.ca)]) == 0
            assert probe.main([address, "--tls-ca", str(certs.ca)]) == 1  # the old CA no longer verifies it
            assert any("TLS certificate reloaded from" in r.getMessage() for r in caplog.records)
        capsys.readouterr()
    finally:
        loop.call(server.stop(0), 30.0)
        loop.close()


async def _serve_health(tls: ServerTls) -> tuple[grpc.aio.Server, str]:
    """A health service over `tls` on a loopback port, SERVING: what the probe checks certificates against."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = listen(server, "127.0.0.1:0", "test", RuntimeError, tls)
    await server.start()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


def test_client_tls_files_are_reloaded_when_they_change_and_kept_through_a_half_written_rotation(
        tmp_path, certs, caplog):
    cert, key = tmp_path / "client.pem", tmp_path / "client-key.pem"
    install_file(certs.client_cert, cert)
    install_file(certs.client_key, key)
    tls = ReloadingClientTls(load_client_tls(certs.ca, cert, key))
    assert tls.current().cert_chain == certs.client_cert.read_bytes() and tls.generation == 0
    with caplog.at_level(logging.INFO, logger="shared.rpc.tls"):
        install_file(certs.other_client_cert, cert)  # its key is not there yet
        assert tls.current().cert_chain == certs.client_cert.read_bytes()
        assert tls.current().cert_chain == certs.client_cert.read_bytes()
        warnings = [r for r in caplog.records if "cannot be used" in r.getMessage()]
        assert len(warnings) == 1 and "is not the private key of the certificate" in warnings[0].getMessage()
        install_file(certs.other_client_key, key)
        renewed = tls.current()
    assert renewed.cert_chain == certs.other_client_cert.read_bytes() and tls.generation == 1
    assert renewed.private_key == certs.other_client_key.read_bytes() and renewed.files() == (
        str(certs.ca), str(cert), str(key))
    assert tls.current() is renewed and tls.generation == 1  # unchanged files: nothing reloaded


def test_a_gateway_dials_workers_with_its_renewed_client_certificate(artifacts, certs, tmp_path):
    """The workers require client certificates; the gateway's is renewed (signed by another CA, which the
    workers now trust instead). A worker registering after the rotation is reached with the renewed
    certificate, and the workers already registered get channels dialled with it (an open channel would
    reconnect with the old one, which the workers no longer accept); a stream open on the old channel
    finishes on it, and the old channel is closed after it."""
    trusted, cert, key = tmp_path / "workers-trust.pem", tmp_path / "gw-client.pem", tmp_path / "gw-client-key.pem"
    for source, target in ((certs.ca, trusted), (certs.client_cert, cert), (certs.client_key, key)):
        install_file(source, target)
    gateway = BackgroundGateway(GatewayConfig(
        registry_url=artifacts.url, listen="127.0.0.1:0", admin_tokens=TOKENS, budget=FallbackBudget(enabled=False),
        grace_s=0.5, heartbeat_interval_s=0.05, worker_tls=load_client_tls(certs.ca, cert, key)))

    async def scenario():
        worker_tls = load_server_tls(certs.server_cert, certs.server_key, trusted)
        first, first_address = await _start_worker(artifacts.stable, worker_tls, delay_s=0.01)
        second = None
        try:
            async with grpc.aio.insecure_channel(gateway.address) as channel:
                admin, client = gateway_pb2_grpc.AdminStub(channel), gateway_pb2_grpc.GatewayStub(channel)
                registered = await admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    address=first_address, artifact_id=artifacts.stable), metadata=WORKER)
                await admin.CreateDeployment(gateway_pb2.CreateDeploymentRequest(
                    name="chat", stable_artifact_id=artifacts.stable, baseline_artifact_id=artifacts.baseline),
                    metadata=ADMIN)
                pooled = gateway.server.pool.get(registered.worker_id)
                old_channel = pooled.channel
                long = client.Generate(gateway_pb2.GatewayGenerateRequest(
                    deployment="chat", text="long", sampling=common_pb2.SamplingParams(max_new_tokens=200)))
                first_reply = await long.read()
                install_file(certs.other_ca, trusted)
                install_file(certs.other_client_cert, cert)
                install_file(certs.other_client_key, key)
                second, second_address = await _start_worker(
                    artifacts.canary, load_server_tls(certs.server_cert, certs.server_key, trusted))
                await admin.RegisterWorker(gateway_pb2.RegisterWorkerRequest(
                    address=second_address, artifact_id=artifacts.canary), metadata=WORKER)
                deadline = time.monotonic() + PROMPT_S
                while pooled.channel is old_channel:  # the next heartbeat-expiry pass re-dials it
                    assert time.monotonic() < deadline, "the registered worker was not dialled again"
                    await asyncio.sleep(0.01)
                assert list(pooled.retired_channels) == [old_channel]  # the long stream is still on it
                # Another stream, on the new channel, outlives it: the old channel is closed all the same (it was
                # closed only once the worker had no stream at all: under steady load, never).
                other = client.Generate(gateway_pb2.GatewayGenerateRequest(
                    deployment="chat", text="other", sampling=common_pb2.SamplingParams(max_new_tokens=400)))
                await other.read()
                rest = []
                while (reply := await long.read()) is not grpc.aio.EOF:
                    rest.append(reply)
                assert len(first_reply.token_ids) + sum(len(r.token_ids) for r in rest) == 200
                assert rest[-1].HasField("finish") and not pooled.retired_channels and pooled.in_flight == 1
                other.cancel()
                replies = [r async for r in client.Generate(gateway_pb2.GatewayGenerateRequest(
                    deployment="chat", text="hi"))]
                assert [t for r in replies for t in r.token_ids] == expected_tokens(list(b"hi"), 3)
        finally:
            await first.stop(0)
            if second is not None:
                await second.stop(0)

    try:
        gateway.call(scenario())
    finally:
        gateway.stop(0)


def test_a_worker_announces_itself_with_its_renewed_client_certificate(artifacts, certs, tmp_path):
    """The gateway requires client certificates; the worker's is renewed (another CA, which the gateway
    now trusts instead) and the gateway restarts at the same address: the worker registers again with the
    renewed certificate (its open channel would have reconnected with the old one, now refused)."""
    trusted, cert, key = tmp_path / "gw-trust.pem", tmp_path / "worker-client.pem", tmp_path / "worker-key.pem"
    for source, target in ((certs.ca, trusted), (certs.client_cert, cert), (certs.client_key, key)):
        install_file(source, target)

    def start_gateway(listen: str) -> BackgroundGateway:
        return BackgroundGateway(GatewayConfig(
            registry_url=artifacts.url, listen=listen, admin_tokens=TOKENS, budget=FallbackBudget(enabled=False),
            grace_s=0.5, heartbeat_interval_s=0.05,
            tls=load_server_tls(certs.server_cert, certs.server_key, trusted)))

    async def registered(announcer: GatewayAnnouncer) -> None:
        deadline = time.monotonic() + PROMPT_S
        while announcer.worker_id is None:
            assert time.monotonic() < deadline, "the worker did not register"
            await asyncio.sleep(0.01)

    gateway = start_gateway("127.0.0.1:0")
    loop = BackgroundLoop("announcer-test")
    worker, worker_address = loop.call(_start_worker(artifacts.stable, None), 30.0)  # plaintext: not the point
    announcer = GatewayAnnouncer(gateway.address, "worker-secret", worker_address, artifacts.stable, _load,
                                 min_backoff_s=0.05, tls=load_client_tls(certs.ca, cert, key))
    try:
        loop.call(_started(announcer), 30.0)
        loop.call(registered(announcer), 30.0)
        install_file(certs.other_ca, trusted)
        install_file(certs.other_client_cert, cert)
        install_file(certs.other_client_key, key)
        address = gateway.address
        gateway.stop(0)
        gateway = start_gateway(address)  # it knows no worker: the worker must register again, on a new connection
        loop.call(registered_again(announcer), 30.0)
        assert [w.address for w in gateway.server.pool.workers.values()] == [worker_address]
    finally:
        loop.call(announcer.stop(), 30.0)
        loop.call(worker.stop(0), 30.0)
        loop.close()
        gateway.stop(0)


async def _started(announcer: GatewayAnnouncer) -> None:
    announcer.start()


async def registered_again(announcer: GatewayAnnouncer) -> None:
    """Until the announcer holds a registration the restarted gateway knows (it forgot the old one)."""
    deadline = time.monotonic() + PROMPT_S
    old = announcer.worker_id
    while announcer.worker_id in (None, old):
        assert time.monotonic() < deadline, "the worker did not register with the restarted gateway"
        await asyncio.sleep(0.01)


def test_files_renewed_between_loading_and_serving_are_served(tmp_path, certs, capsys):
    """The files' signature is taken when they are read, not when the server starts: a renewal in between is
    seen at the first handshake, not missed until the files change once more."""
    cert, key = tmp_path / "server.pem", tmp_path / "server-key.pem"
    install_file(certs.server_cert, cert)
    install_file(certs.server_key, key)
    loaded = load_server_tls(cert, key, None)
    renewed = make_certs(tmp_path / "renewed")
    install_file(renewed.server_cert, cert)
    install_file(renewed.server_key, key)

    loop = BackgroundLoop("tls-signature-test")
    server, address = loop.call(_serve_health(loaded), 30.0)
    try:
        assert probe.main([address, "--tls-ca", str(renewed.ca)]) == 0
        capsys.readouterr()
    finally:
        loop.call(server.stop(0), 30.0)
        loop.close()


def test_a_ca_bundle_with_titles_between_its_certificates_loads(tmp_path):
    """curl's cacert.pem names each CA in a UTF-8 line between the PEM blocks, which gRPC skips: the bundle was
    refused ("ordinal not in range(128)") at start-up."""
    certs = make_certs(tmp_path / "certs")
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes("Autorité de test\n================\n".encode() + certs.ca.read_bytes()
                       + "NetLock Arany (Class Gold) Főtanúsítvány\n".encode() + certs.other_ca.read_bytes())
    assert load_client_tls(bundle, None, None).ca == bundle.read_bytes()  # gRPC gets the file as it is


@pytest.mark.parametrize("cut", ["no_end", "second_half"])
def test_a_ca_file_caught_half_written_is_refused_and_the_current_one_kept(tmp_path, cut):
    """Only the PEM blocks are read since bundles may carry text between them: a file cut inside its last block
    then reached the TLS library as no certificate at all, a ValueError every reload raised again (a worker
    stopped heartbeating, the gateway's expiry pass stopped), where a refusal keeps the current files."""
    certs = make_certs(tmp_path / "certs")
    ca = tmp_path / "ca.pem"
    ca.write_bytes(certs.ca.read_bytes())
    tls = ReloadingClientTls(load_client_tls(ca, None, None))
    whole = certs.ca.read_bytes() + certs.other_ca.read_bytes()
    ca.write_bytes(whole[: whole.index(b"-----END", len(certs.ca.read_bytes()))] if cut == "second_half"
                   else certs.ca.read_bytes().split(b"-----END")[0])
    assert tls.current().ca == certs.ca.read_bytes() and tls.generation == 0
    with pytest.raises(TlsError, match="incomplete"):
        load_client_tls(ca, None, None)

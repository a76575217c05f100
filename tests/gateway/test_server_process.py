"""`python -m services.gateway.server`: serves until SIGTERM, then exits 0; a bad setting exits 2 naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import REPO


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_process_serves_until_sigterm(artifacts):
    port = _free_port()
    env = {**os.environ, "QSERVE_ADMIN_TOKENS": "ops=secret:admin"}
    process = subprocess.Popen([sys.executable, "-m", "services.gateway.server", "--registry-url", artifacts.url,
                                "--listen", f"127.0.0.1:{port}"], cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            while True:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service="qserve.v1.Gateway"), timeout=1)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    break
                except grpc.RpcError:
                    assert process.poll() is None, process.stdout.read()
                    assert time.monotonic() < deadline, "the gateway did not come up in 60 s"
                    time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_bad_setting_exits_2_with_one_line_naming_it(artifacts):
    result = subprocess.run([sys.executable, "-m", "services.gateway.server", "--registry-url", artifacts.url,
                             "--listen", "nowhere"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: listen address 'nowhere' is not host:port "
                                     "(e.g. 127.0.0.1:50051, or port 0)")


def test_a_port_in_use_exits_2_with_one_line_naming_it(artifacts):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag, args in (("--listen", ["--listen", f"127.0.0.1:{port}"]),
                           ("--metrics-port", ["--listen", "127.0.0.1:0", "--metrics-port", str(port)])):
            result = subprocess.run([sys.executable, "-m", "services.gateway.server", "--registry-url", artifacts.url,
                                     *args], cwd=REPO, capture_output=True, text=True, timeout=60)
            assert result.returncode == 2, (flag, result.stderr)
            assert "Traceback" not in result.stderr, result.stderr
            last = result.stderr.strip().splitlines()[-1]
            assert last.startswith("error: ") and str(port) in last and flag in last, last

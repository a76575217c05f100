"""qctl against a service that accepts a call and never answers (a wedged gateway or quantizer, a registry lock
held), and against inputs that never reach one: every command ends, with one line and exit 2."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest
import typer
from typer.testing import CliRunner

from qctl import gateway_client, publish_cmd
from qctl.choices import bearer_token
from qctl.main import app
from qctl.output import enum_label
from shared.rpc.qserve.v1 import gateway_pb2, quantizer_pb2


class _Silent(grpc.GenericRpcHandler):
    """Takes every call; answers none until the test ends."""

    def __init__(self, until: float):
        self.until = until

    def service(self, details):
        def wait(*_):
            time.sleep(max(0.0, self.until - time.monotonic()))

        if details.method.endswith(("/WatchJob", "/Generate")):
            def stream(request, context):
                wait()
                yield from ()

            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(lambda request, context: wait())


@pytest.fixture
def silent_address():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_Silent(time.monotonic() + 20),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def _run(args: list[str], budget_s: float = 15.0):
    started = time.monotonic()
    result = CliRunner().invoke(app, args, env={"QCTL_TOKEN": "t"})
    assert time.monotonic() - started < budget_s, "qctl waited on the silent service"
    return result


def test_generate_gives_up_on_a_silent_gateway(silent_address):
    # No deadline: it waited for ever (the gateway's own first-reply timeout never fires in a hung gateway).
    result = _run(["generate", "-d", "chat", "x", "--gateway", silent_address, "--reply-timeout-s", "1"])
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert f"no reply from the gateway at {silent_address} for 1 s (--reply-timeout-s)" in result.stderr


def test_publish_gives_up_on_a_silent_quantizer(silent_address, monkeypatch, tmp_path):
    monkeypatch.setattr(publish_cmd, "RPC_TIMEOUT_S", 1.0)
    result = _run(["publish", "--source", str(tmp_path), "--model-name", "m", "--format", "fp16", "--gpu-target",
                   "cpu", "--quantizer", silent_address])
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert f"no answer from the quantizer at {silent_address} within its deadline" in result.stderr


def test_a_deadline_on_a_change_says_it_may_still_be_applied(silent_address, monkeypatch):
    # The gateway goes on with the promote after qctl gives up: "cannot reach" sent operators to retry it.
    monkeypatch.setattr(gateway_client, "RPC_TIMEOUT_S", 1.0)
    result = _run(["rollout", "promote", "chat", "--force", "--gateway", silent_address])
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert "cannot reach" not in result.stderr
    assert "a change this command asked for may still be applied; check before retrying" in result.stderr


@pytest.mark.parametrize("address", ["127.0.0.1:100995", "127.0.0.1:0", "127.0.0.1", "http://127.0.0.1:50051"])
def test_an_address_without_a_usable_port_is_refused_before_any_call(address):
    # gRPC dialled 100995 modulo 65536 and sent the admin token to whatever listened there.
    result = _run(["deploy", "ls", "--gateway", address])
    assert result.exit_code == 2 and "host:port with a port from 1 to 65535" in result.stderr, result.stderr


def test_tokens_lose_surrounding_whitespace_and_refuse_control_characters():
    assert bearer_token("s3cret\r\n") == "s3cret"  # QCTL_TOKEN="$(cat token.txt)" of a file with CRLF
    with pytest.raises(typer.BadParameter, match="control or non-ASCII"):
        bearer_token("s3\x01cret")
    result = CliRunner().invoke(app, ["deploy", "ls", "--token", "a\x1bb", "--gateway", "127.0.0.1:1"])
    assert result.exit_code == 2 and "control or non-ASCII" in result.stderr  # was "Invalid metadata", the gateway's


def test_an_argument_that_is_not_utf8_is_one_line():
    result = CliRunner().invoke(app, ["fallback", "on", "chat", "--reason", "caf\udce9", "--gateway", "127.0.0.1:1"],
                                env={"QCTL_TOKEN": "t"})
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert "not valid UTF-8" in result.stderr


def test_enum_values_of_a_newer_service_are_shown_not_raised():
    assert enum_label(gateway_pb2.WorkerHealth, 99, "WORKER_HEALTH_") == "UNKNOWN(99)"
    assert enum_label(quantizer_pb2.JobStage, quantizer_pb2.JOB_STAGE_QUANTIZE, "JOB_STAGE_") == "QUANTIZE"

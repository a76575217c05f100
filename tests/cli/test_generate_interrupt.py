"""Ctrl-C during `qctl generate`: the partial text ends its line, stderr says so, exit 130 (it left the
shell's prompt on the end of the partial text, with no word on why the output stopped)."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from typer.testing import CliRunner

from qctl import generate_cmd
from qctl.main import app
from shared.rpc.qserve.v1 import gateway_pb2


def test_ctrl_c_while_streaming_ends_the_line_and_exits_130(monkeypatch):
    def replies():
        yield gateway_pb2.GatewayGenerateResponse(text="def main(")
        raise KeyboardInterrupt

    @contextmanager
    def gateway_client(address):
        yield SimpleNamespace(Generate=lambda request, metadata=None: replies())

    monkeypatch.setattr(generate_cmd, "gateway_client", gateway_client)
    result = CliRunner().invoke(app, ["generate", "-d", "chat", "x"])
    assert result.exit_code == 130, result.output
    assert result.stdout == "def main(\n"
    assert "interrupted" in result.stderr

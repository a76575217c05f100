"""`qctl generate`'s exit code says whether the text is whole: 1 when the generation was aborted (a worker or the
stack stopped, the drain grace ran out) or the stream ended without a finish; it exited 0 as for a whole text."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from qctl import generate_cmd
from qctl.main import app
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2


def _serve(monkeypatch, *replies):
    @contextmanager
    def gateway_client(address):
        yield SimpleNamespace(Generate=lambda request, metadata=None: iter(replies))

    monkeypatch.setattr(generate_cmd, "gateway_client", gateway_client)


def _finish(reason):
    return gateway_pb2.GatewayGenerateResponse(text="):", arm=gateway_pb2.ARM_STABLE, artifact_id="a1",
                                               finish=common_pb2.Finish(reason=reason, generated_tokens=3))


@pytest.mark.parametrize(("reason", "code"), [(common_pb2.FINISH_REASON_LENGTH, 0), (common_pb2.FINISH_REASON_EOS, 0),
                                              (common_pb2.FINISH_REASON_STOP, 0), (common_pb2.FINISH_REASON_ABORT, 1)])
def test_an_aborted_generation_exits_1(monkeypatch, reason, code):
    _serve(monkeypatch, gateway_pb2.GatewayGenerateResponse(text="def main("), _finish(reason))
    result = CliRunner().invoke(app, ["generate", "-d", "chat", "x"])
    assert result.exit_code == code, (result.exception, result.stderr)
    assert result.stdout == "def main():\n"
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("[") and "3 tokens from stable a1" in lines[0]
    if code:
        assert lines[1:] == ["error: the generation was aborted: the text is cut short"]
    else:
        assert len(lines) == 1


def test_a_stream_that_ends_without_a_finish_exits_1(monkeypatch):
    _serve(monkeypatch, gateway_pb2.GatewayGenerateResponse(text="def main("))
    result = CliRunner().invoke(app, ["generate", "-d", "chat", "x"])
    assert result.exit_code == 1, (result.exception, result.stderr)
    assert result.stdout == "def main(\n"
    assert result.stderr.strip() == "error: the stream ended without a finish: the text may be cut short"

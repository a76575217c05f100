"""qctl's commands that call the quantizer send --quantizer-token / QCTL_QUANTIZER_TOKEN as
`authorization: Bearer <token>` on every call (none when unset), and an UNAUTHENTICATED answer gets a hint
naming the option and the variable. Against a small real gRPC server that records what arrives."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from typer.testing import CliRunner

from qctl.main import app
from shared.rpc.bearer import bearer
from shared.rpc.qserve.v1 import quantizer_pb2, quantizer_pb2_grpc

Q = quantizer_pb2
TOKEN = "tok-123"
runner = CliRunner()
ENV = {"COLUMNS": "400", "QCTL_QUANTIZER_TOKEN": "", "QCTL_QUANTIZER": "", "QCTL_TLS_CA": ""}
DONE = Q.Job(job_id="j" * 32, state=Q.JOB_STATE_CANCELLED, error="cancelled by ci")


class _Recording(quantizer_pb2_grpc.QuantizerServicer):
    """Answers every call it gets with the right token; records (rpc, token) of each."""

    def __init__(self):
        self.calls: list[tuple[str, str | None]] = []

    def _check(self, rpc, context):
        token = bearer(context.invocation_metadata())
        self.calls.append((rpc, token))
        if token != TOKEN:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"Quantizer.{rpc} needs metadata `authorization: "
                                                           f"Bearer <token>`")

    def ListJobs(self, request, context):
        self._check("ListJobs", context)
        return Q.ListJobsResponse()

    def ListModels(self, request, context):
        self._check("ListModels", context)
        return Q.ListModelsResponse()

    def ListArtifacts(self, request, context):
        self._check("ListArtifacts", context)
        return Q.ListArtifactsResponse()

    def CancelJob(self, request, context):
        self._check("CancelJob", context)
        return DONE

    def Publish(self, request, context):
        self._check("Publish", context)
        return Q.Job(job_id=DONE.job_id, state=Q.JOB_STATE_QUEUED)

    def WatchJob(self, request, context):
        self._check("WatchJob", context)
        yield Q.JobProgress(job=Q.Job(job_id=DONE.job_id, state=Q.JOB_STATE_FAILED, error="budget"))


@pytest.fixture
def quantizer():
    servicer = _Recording()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    quantizer_pb2_grpc.add_QuantizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(None)


COMMANDS = {
    "ls": (["ls"], ["ListModels", "ListArtifacts"]),
    "jobs list": (["jobs", "list"], ["ListJobs"]),
    "jobs cancel": (["jobs", "cancel", "j" * 32, "--by", "alice"], ["CancelJob"]),
    "publish": (["publish", "--source", "s3://bucket/m", "--model-name", "m", "--format", "fp16", "--gpu-target",
                 "cpu"], ["Publish", "WatchJob"]),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_option_token_goes_on_every_quantizer_call(quantizer, command):
    argv, rpcs = COMMANDS[command]
    result = runner.invoke(app, [*argv, "--quantizer", quantizer.address, "--quantizer-token", TOKEN], env=ENV)
    assert result.exit_code == (1 if command == "publish" else 0), result.output  # publish: the job failed
    assert quantizer.calls == [(rpc, TOKEN) for rpc in rpcs]


@pytest.mark.parametrize("command", COMMANDS)
def test_the_variable_token_goes_on_every_quantizer_call(quantizer, command):
    argv, rpcs = COMMANDS[command]
    result = runner.invoke(app, [*argv, "--quantizer", quantizer.address],
                           env={**ENV, "QCTL_QUANTIZER_TOKEN": TOKEN})
    assert result.exit_code == (1 if command == "publish" else 0), result.output
    assert quantizer.calls == [(rpc, TOKEN) for rpc in rpcs]


@pytest.mark.parametrize("command", COMMANDS)
def test_without_a_token_none_is_sent_and_unauthenticated_names_the_option(quantizer, command):
    argv, rpcs = COMMANDS[command]
    result = runner.invoke(app, [*argv, "--quantizer", quantizer.address], env=ENV)
    assert result.exit_code == 2
    assert quantizer.calls == [(rpcs[0], None)]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "(UNAUTHENTICATED)" in lines[0]
    assert "--quantizer-token" in lines[0] and "QCTL_QUANTIZER_TOKEN" in lines[0]

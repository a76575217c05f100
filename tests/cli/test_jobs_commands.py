"""`qctl jobs list` and `qctl jobs cancel` against a fake quantizer stub: what they ask for, what they print
(tables with whole ids, server text verbatim, JSON for scripts), and a refused cancel as one line, exit 2."""

from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from typer.testing import CliRunner

from qctl import jobs_cmd
from qctl.main import app
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2

Q = quantizer_pb2
runner = CliRunner()
ENV = {"COLUMNS": "400"}
REASON = "cancelled by alice: [bold]wrong[/] checkpoint"
T0 = Timestamp(seconds=1_767_268_800)  # 2026-01-01T12:00:00Z


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self):
        return "job j1 has already ended: it is SUCCEEDED; only a QUEUED or RUNNING job can be cancelled"


class _Channel:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake(monkeypatch, **replies) -> list:
    """The stub answers each rpc with its reply (raised when an exception); -> the requests it got."""
    requests = []

    def answer(reply):
        def rpc(request, **kwargs):
            requests.append(request)
            if isinstance(reply, Exception):
                raise reply
            return reply
        return rpc

    stub = SimpleNamespace(**{name: answer(reply) for name, reply in replies.items()})
    monkeypatch.setattr(jobs_cmd, "quantizer_stub", lambda address, token="": (_Channel(), stub))
    return requests


def _jobs() -> list[Q.Job]:
    return [
        Q.Job(job_id="c" * 32, state=Q.JOB_STATE_RUNNING, model_name="llama", stage=Q.JOB_STAGE_QUANTIZE,
              block_index=3, block_count=80, error=REASON, created_at=T0, cancel_requested_at=T0,
              artifact=common_pb2.ArtifactInfo(artifact_id="a" * 32)),
        Q.Job(job_id="d" * 32, state=Q.JOB_STATE_FAILED, model_name="mistral", stage=Q.JOB_STAGE_EVAL,
              error="accuracy budget exceeded", created_at=T0),
    ]


def test_list_asks_with_the_filters_and_shows_whole_ids_and_cancelling_jobs(monkeypatch):
    requests = _fake(monkeypatch, ListJobs=Q.ListJobsResponse(jobs=_jobs()))
    result = runner.invoke(app, ["jobs", "list", "--state", "RUNNING", "--state", "failed", "--model", "llama",
                                 "--limit", "5"], env=ENV)
    assert result.exit_code == 0, result.output
    assert requests == [Q.ListJobsRequest(states=[Q.JOB_STATE_RUNNING, Q.JOB_STATE_FAILED], model_name="llama",
                                          limit=5)]
    running = next(line for line in result.stdout.splitlines() if "c" * 32 in line)
    assert "RUNNING (cancelling)" in running and "quantize 3/80" in running and "a" * 32 in running
    assert REASON in running and "2026-01-01 12:00:00" in running  # server text verbatim, not rich markup
    assert "FAILED" in result.stdout and "accuracy budget exceeded" in result.stdout


def test_list_defaults_to_the_20_newest_of_any_state(monkeypatch):
    requests = _fake(monkeypatch, ListJobs=Q.ListJobsResponse())
    result = runner.invoke(app, ["jobs", "list"], env=ENV)
    assert result.exit_code == 0 and result.stdout.strip() == "no jobs"
    assert requests == [Q.ListJobsRequest(limit=20)]


def test_list_json_is_one_object_per_job(monkeypatch):
    _fake(monkeypatch, ListJobs=Q.ListJobsResponse(jobs=_jobs()))
    result = runner.invoke(app, ["jobs", "list", "--json"], env=ENV)
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert [j["job_id"] for j in listed] == ["c" * 32, "d" * 32]
    assert listed[0] == {
        "job_id": "c" * 32, "state": "RUNNING", "model_name": "llama", "stage": "quantize", "block_index": 3,
        "block_count": 80, "created_at": "2026-01-01T12:00:00Z", "elapsed_s": 0.0, "error": REASON,
        "cancel_requested_at": "2026-01-01T12:00:00Z", "artifact_id": "a" * 32,
    }
    assert listed[1]["state"] == "FAILED" and listed[1]["cancel_requested_at"] == ""


def test_list_refuses_an_unknown_state_before_asking(monkeypatch):
    requests = _fake(monkeypatch, ListJobs=Q.ListJobsResponse())
    result = runner.invoke(app, ["jobs", "list", "--state", "stuck"], env=ENV)
    assert result.exit_code == 2 and requests == []


def test_cancel_a_queued_job_says_it_is_cancelled(monkeypatch):
    requests = _fake(monkeypatch, CancelJob=Q.Job(job_id="j1", state=Q.JOB_STATE_CANCELLED, error=REASON))
    result = runner.invoke(app, ["jobs", "cancel", "j1", "--reason", "wrong checkpoint", "--by", "alice"], env=ENV)
    assert result.exit_code == 0, result.output
    assert requests == [Q.CancelJobRequest(job_id="j1", reason="wrong checkpoint", requested_by="alice")]
    assert result.stdout.strip() == f"job j1 cancelled: {REASON}"


def test_cancel_a_running_job_says_it_is_stopping_and_who_asks_defaults_to_user_at_host(monkeypatch):
    requests = _fake(monkeypatch, CancelJob=Q.Job(job_id="j1", state=Q.JOB_STATE_RUNNING, error=REASON,
                                                  cancel_requested_at=T0))
    monkeypatch.setattr(jobs_cmd, "_whoami", lambda: "ops@host-1")
    result = runner.invoke(app, ["jobs", "cancel", "j1"], env=ENV)
    assert result.exit_code == 0, result.output
    assert requests[0].requested_by == "ops@host-1" and requests[0].reason == ""
    assert "job j1 is stopping" in result.stdout and "ends CANCELLED at its next step" in result.stdout


def test_cancel_json_prints_the_job(monkeypatch):
    _fake(monkeypatch, CancelJob=Q.Job(job_id="j1", state=Q.JOB_STATE_CANCELLED, error=REASON, model_name="llama"))
    result = runner.invoke(app, ["jobs", "cancel", "j1", "--json", "--by", "alice"], env=ENV)
    assert result.exit_code == 0, result.output
    job = json.loads(result.stdout)
    assert (job["job_id"], job["state"], job["error"], job["model_name"]) == ("j1", "CANCELLED", REASON, "llama")


def test_cancel_of_an_ended_job_is_one_line_and_exit_2(monkeypatch):
    _fake(monkeypatch, CancelJob=_Refused())
    result = runner.invoke(app, ["jobs", "cancel", "j1", "--quantizer", "q:1"], env=ENV)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == ("error: quantizer q:1: job j1 has already ended: it is SUCCEEDED; only a QUEUED "
                                     "or RUNNING job can be cancelled (FAILED_PRECONDITION)")

"""Ctrl-C during `qctl publish` stops following the job, not the job: the quantizer has no cancel and goes on
to publish the artifact. qctl left without a word (exit 130 from the shell, or click's bare "Aborted!"), as if
the job had been cancelled."""

from __future__ import annotations

from types import SimpleNamespace

from typer.testing import CliRunner

from qctl import publish_cmd
from qctl.main import app
from shared.rpc.qserve.v1 import quantizer_pb2 as Q


class _Channel:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _progress_then_ctrl_c(request, **kwargs):
    yield Q.JobProgress(job=Q.Job(job_id="j1", state=Q.JOB_STATE_RUNNING, stage=Q.JOB_STAGE_QUANTIZE,
                                  block_index=1, block_count=6))
    raise KeyboardInterrupt


def test_ctrl_c_while_following_a_publish_says_the_job_keeps_running(monkeypatch, tmp_path):
    stub = SimpleNamespace(Publish=lambda request, **kw: Q.Job(job_id="j1"), WatchJob=_progress_then_ctrl_c)
    monkeypatch.setattr(publish_cmd, "quantizer_stub", lambda address, token="": (_Channel(), stub))
    result = CliRunner().invoke(app, ["publish", "--source", str(tmp_path), "--model-name", "tiny", "--format",
                                      "w4a8kv4-g128", "--gpu-target", "cpu", "--quantizer", "q.example:50061"])
    assert result.exit_code == 130, result.output
    assert result.stdout == ""  # no id: scripts capturing it see none
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: job j1 keeps running on the quantizer at q.example:50061"), result.stderr
    assert "`qctl jobs cancel j1` stops it" in last

"""qctl prints artifact ids whole: the gateway and the quantizer take nothing else. The gateway commands
printed 12-character prefixes (`qctl rollout start --canary <prefix>` was NOT_FOUND, `qctl workers --artifact
<prefix>` listed nothing), and tables written to a pipe were fitted into 80 columns, ids cut to 'aee7d3cd…'."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from google.protobuf.duration_pb2 import Duration
from typer.testing import CliRunner

from qctl import deploy_cmd, generate_cmd, inspect_cmd, jobs_cmd, ls_cmd, rollout_cmd
from qctl.main import app
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, quantizer_pb2

runner = CliRunner()
STABLE, CANARY, BASELINE = "5bccde726d894cdbba26bb4d85f95941", "a814f3eff78145acaa3ab275d906b136", "67e307c76f92488f9df16a9aa4c16d1e"
PIPED = {"QCTL_TOKEN": "t", "COLUMNS": None}  # stdout is not a terminal under CliRunner, and no width is set


def _ref(artifact_id: str, fmt: str = "w4a8kv4-g128") -> common_pb2.ArtifactRef:
    return common_pb2.ArtifactRef(artifact_id=artifact_id, format=fmt, gpu_target="sm90")


DEPLOYMENT = gateway_pb2.Deployment(name="chat", stable=_ref(STABLE), canary=_ref(CANARY), canary_percent=10,
                                    baseline=_ref(BASELINE, "fp16"))


def _fake_admin(monkeypatch, module, **replies):
    @contextmanager
    def admin_client(address, token):
        yield SimpleNamespace(**{rpc: (lambda request, reply=reply: reply) for rpc, reply in replies.items()})

    monkeypatch.setattr(module, "admin_client", admin_client)


def _deploy_ls(monkeypatch):
    _fake_admin(monkeypatch, deploy_cmd, ListDeployments=gateway_pb2.ListDeploymentsResponse(deployments=[DEPLOYMENT]))
    return ["deploy", "ls"], (STABLE, CANARY, BASELINE)


def _rollout_status(monkeypatch):
    metrics = {arm: gateway_pb2.ArmMetrics(artifact=_ref(artifact_id))
               for arm, artifact_id in (("stable", STABLE), ("canary", CANARY), ("baseline", BASELINE))}
    _fake_admin(monkeypatch, rollout_cmd, RolloutStatus=gateway_pb2.RolloutStatusResponse(deployment=DEPLOYMENT, **metrics))
    return ["rollout", "status", "chat"], (STABLE, CANARY, BASELINE)


def _workers(monkeypatch):
    worker = gateway_pb2.WorkerStatus(worker_id="w1", address="10.0.0.7:50052", artifact=_ref(CANARY),
                                    health=gateway_pb2.WORKER_HEALTH_HEALTHY)
    _fake_admin(monkeypatch, inspect_cmd, ListWorkers=gateway_pb2.ListWorkersResponse(workers=[worker]))
    return ["workers"], (CANARY,)


def _events(monkeypatch):
    event = gateway_pb2.Event(event_id=1, deployment="chat", kind="rollout_start", actor="ops", artifact_id=CANARY)
    _fake_admin(monkeypatch, inspect_cmd, ListEvents=gateway_pb2.ListEventsResponse(events=[event]))
    return ["events"], (CANARY,)


def _ls(monkeypatch):
    Q = quantizer_pb2
    models = Q.ListModelsResponse(models=[Q.ModelInfo(model_name="tiny", versions=[
        Q.ModelVersion(model_version="c" * 64, version_label="v1", artifacts=[_ref(CANARY)])])])
    artifacts = Q.ListArtifactsResponse(artifacts=[common_pb2.ArtifactInfo(
        artifact_id=CANARY, state=common_pb2.ARTIFACT_STATE_READY,
        evaluation=common_pb2.Evaluation(perplexity_fp16=5.0, perplexity_quantized=5.1))])
    stub = SimpleNamespace(ListModels=lambda request, **kw: models, ListArtifacts=lambda request, **kw: artifacts)
    monkeypatch.setattr(ls_cmd, "quantizer_stub", lambda address, token="": (_Channel(), stub))
    return ["ls"], (CANARY,)


def _jobs_list(monkeypatch):
    Q = quantizer_pb2
    job = Q.Job(job_id=STABLE, state=Q.JOB_STATE_RUNNING, model_name="tiny",
                artifact=common_pb2.ArtifactInfo(artifact_id=CANARY))
    stub = SimpleNamespace(ListJobs=lambda request, **kw: Q.ListJobsResponse(jobs=[job]))
    monkeypatch.setattr(jobs_cmd, "quantizer_stub", lambda address, token="": (_Channel(), stub))
    return ["jobs", "list"], (STABLE, CANARY)


class _Channel:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("command", [_deploy_ls, _rollout_status, _workers, _events, _ls, _jobs_list])
def test_tables_written_to_a_pipe_show_whole_artifact_ids(monkeypatch, command):
    argv, ids = command(monkeypatch)
    result = runner.invoke(app, argv, env=PIPED)
    assert result.exit_code == 0, result.output
    assert [i for i in ids if i not in result.stdout] == [], result.stdout
    assert "…" not in result.stdout


def _column_cells(table: str, header: str) -> str:
    """The text of one column of a one-row rich table, its folded lines joined."""
    lines = table.splitlines()
    head = next(line for line in lines if header in line)
    bars = [i for i, ch in enumerate(head) if ch in "┃│"]
    index = next(k for k in range(len(bars) - 1) if header in head[bars[k]:bars[k + 1]])
    start, end = bars[index] + 1, bars[index + 1]
    body = lines[lines.index(head) + 1:]
    return "".join(line[start:end].strip() for line in body if line.startswith("│"))


def test_a_narrow_terminal_folds_ids_instead_of_cutting_them(monkeypatch):
    argv, _ = _deploy_ls(monkeypatch)
    result = runner.invoke(app, argv, env={"QCTL_TOKEN": "t", "COLUMNS": "70"})
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 70  # the width is still respected
    assert _column_cells(result.stdout, "stable") == STABLE
    assert _column_cells(result.stdout, "baseline") == BASELINE


def test_the_generate_finish_line_names_the_whole_artifact_id(monkeypatch):
    finish = common_pb2.Finish(reason=common_pb2.FINISH_REASON_LENGTH, generated_tokens=2, timings=common_pb2.Timings(
        time_to_first_token=Duration(nanos=5_000_000)))
    replies = [gateway_pb2.GatewayGenerateResponse(text="ab", arm=gateway_pb2.ARM_CANARY, artifact_id=CANARY,
                                                   finish=finish)]

    @contextmanager
    def gateway_client(address):
        yield SimpleNamespace(Generate=lambda request, metadata=None: iter(replies))

    monkeypatch.setattr(generate_cmd, "gateway_client", gateway_client)
    result = runner.invoke(app, ["generate", "-d", "chat", "x"])
    assert result.exit_code == 0, result.output
    assert f"from canary {CANARY};" in result.stderr

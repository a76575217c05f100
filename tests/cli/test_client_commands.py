"""qctl's gateway and quantizer client commands against fake stubs: server-supplied text is shown as
text (never parsed as rich markup), and a successful call exits 0 with its output."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

from typer.testing import CliRunner

from qctl import fallback_cmd, inspect_cmd, ls_cmd
from qctl.main import app
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, quantizer_pb2

runner = CliRunner()
REASON = "5xx on [/v1/generate] and [bold]"
ENV = {"QCTL_TOKEN": "t", "COLUMNS": "250"}


def _fake_admin(monkeypatch, module, **replies):
    @contextmanager
    def admin_client(address, token):
        yield SimpleNamespace(**{rpc: (lambda request, reply=reply: reply) for rpc, reply in replies.items()})

    monkeypatch.setattr(module, "admin_client", admin_client)


def test_fallback_reason_with_brackets_is_printed_verbatim(monkeypatch):
    deployment = gateway_pb2.Deployment(name="chat", fallback=True, fallback_reason=REASON)
    _fake_admin(monkeypatch, fallback_cmd, SetFallback=deployment)
    result = runner.invoke(app, ["fallback", "on", "chat", "--reason", REASON], env=ENV)
    assert result.exit_code == 0, result.output
    assert REASON in result.stdout


def test_events_detail_with_brackets_is_printed_verbatim(monkeypatch):
    detail = '{"reason": "' + REASON + '"}'
    listed = gateway_pb2.ListEventsResponse(events=[gateway_pb2.Event(
        event_id=1, deployment="chat", kind="fallback_on", actor="ops", detail=detail)])
    _fake_admin(monkeypatch, inspect_cmd, ListEvents=listed)
    result = runner.invoke(app, ["events"], env=ENV)
    assert result.exit_code == 0, result.output
    assert REASON in result.stdout


def test_ls_failure_reason_with_brackets_is_printed_verbatim(monkeypatch):
    Q = quantizer_pb2
    ref = common_pb2.ArtifactRef(artifact_id="a1", format="w4a8kv4-g128", gpu_target="cpu")
    models = Q.ListModelsResponse(models=[Q.ModelInfo(model_name="tiny", versions=[
        Q.ModelVersion(model_version="m" * 64, version_label="v1", artifacts=[ref])])])
    artifacts = Q.ListArtifactsResponse(artifacts=[common_pb2.ArtifactInfo(
        artifact_id="a1", state=common_pb2.ARTIFACT_STATE_FAILED, failure_reason=REASON)])
    stub = SimpleNamespace(ListModels=lambda request, **kw: models, ListArtifacts=lambda request, **kw: artifacts)

    class Channel:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(ls_cmd, "quantizer_stub", lambda address, token="": (Channel(), stub))
    result = runner.invoke(app, ["ls"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert REASON in result.stdout


def _fake_quantizer(monkeypatch, updates):
    from qctl import publish_cmd

    class Channel:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    stub = SimpleNamespace(Publish=lambda request, **kw: quantizer_pb2.Job(job_id="j1"),
                           WatchJob=lambda request, **kw: iter(updates))
    monkeypatch.setattr(publish_cmd, "quantizer_stub", lambda address, token="": (Channel(), stub))


def _publish_args(tmp_path):
    return ["publish", "--source", str(tmp_path), "--model-name", "tiny", "--format", "w4a8kv4-g128",
            "--gpu-target", "cpu", "--rtn"]


def test_publish_progress_message_with_brackets_and_stdout_is_the_id_alone(monkeypatch, tmp_path):
    Q = quantizer_pb2
    done = Q.Job(job_id="j1", state=Q.JOB_STATE_SUCCEEDED, artifact=common_pb2.ArtifactInfo(
        artifact_id="a" * 32, evaluation=common_pb2.Evaluation(data_name="[/eval]", perplexity_fp16=10.0,
                                                               perplexity_quantized=10.5)))
    _fake_quantizer(monkeypatch, [Q.JobProgress(job=Q.Job(job_id="j1", state=Q.JOB_STATE_RUNNING), message=REASON),
                                  Q.JobProgress(job=done)])
    result = runner.invoke(app, _publish_args(tmp_path))
    assert result.exit_code == 0, result.output
    assert result.stdout == "a" * 32 + "\n"


def test_publish_failed_job_exits_1(monkeypatch, tmp_path):
    Q = quantizer_pb2
    _fake_quantizer(monkeypatch, [Q.JobProgress(job=Q.Job(job_id="j1", state=Q.JOB_STATE_FAILED, error="budget"))])
    result = runner.invoke(app, _publish_args(tmp_path))
    assert result.exit_code == 1 and "budget" in result.stderr and result.stdout == ""


def test_publish_whose_progress_stream_ends_empty_is_one_line(monkeypatch, tmp_path):
    _fake_quantizer(monkeypatch, [])  # was an AttributeError traceback on job.state
    result = runner.invoke(app, _publish_args(tmp_path))
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith("error: the quantizer ended the progress stream")



def test_help_texts_keep_their_square_brackets():
    """Help is plain text: rich markup took "[a-z0-9._-]" and "[default: ...]" in option help for tags and
    dropped them (qctl publish --help read "registry name: , up to 64 characters")."""
    from typer.testing import CliRunner

    from qctl.main import app

    for argv, text in ((["publish", "--help"], "[a-z0-9._-]"), (["up", "--help"], "[default: make a small")):
        result = CliRunner().invoke(app, argv, terminal_width=200)
        assert result.exit_code == 0 and text in result.output, result.output


def test_generate_refuses_values_past_the_protos_integer_fields_in_one_line():
    """A 64-bit seed or a token id past uint32 made protobuf raise while the request was built: a traceback."""
    for args in (["--token-ids", "1,4294967296"], ["--max-new-tokens", "4294967296", "hi"],
                 ["--top-k", "4294967296", "hi"], ["--seed", str(2**64), "hi"]):
        result = runner.invoke(app, ["generate", "-d", "chat", *args])
        assert result.exit_code == 2 and "Traceback" not in result.output, (args, result.output)
        assert "4294967295" in result.output or str(2**64 - 1) in result.output, (args, result.output)


def test_generate_refuses_a_top_p_too_small_to_be_sent():
    """SamplingParams.top_p is a float32 whose 0 means no limit: --top-p 1e-46 arrived as 0 and the worker
    sampled from the whole distribution, the opposite of what was asked."""
    result = runner.invoke(app, ["generate", "-d", "chat", "--top-p", "1e-46", "hi"])
    assert result.exit_code == 2 and "--top-k 1" in result.output, result.output


def test_up_offers_only_quantized_formats_to_roll_out(tmp_path):
    """fp16 is the baseline `up` publishes anyway: its rollout onto itself failed after starting the whole stack."""
    result = runner.invoke(app, ["up", "--format", "fp16", "--once", "--workdir", str(tmp_path / "up")])
    assert result.exit_code == 2 and "Invalid value for '--format'" in result.output, result.output
    assert not (tmp_path / "up").exists()  # refused before anything started

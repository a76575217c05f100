"""`qctl up`'s guards before and around its stack, each on the real code path without a whole run: the demo model
a stopped run left half written, a second run in the same --workdir, --device cuda:N, an empty --prompt."""

from __future__ import annotations

import fcntl
import io
import json
import os
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from qctl import up_cmd
from qctl.main import app


class _Started(Exception):
    """Raised by a stand-in for a step `qctl up` must not reach."""


def _must_not_start(*args, **kwargs):
    raise _Started("qctl up went on to start the demo")


def test_a_demo_model_a_stopped_run_left_half_written_is_written_again(tmp_path):
    """An older qctl up stopped while writing the demo model left config.json and the weights but no tokenizer;
    every later run in that --workdir took the folder for the model and failed to load it."""
    model = tmp_path / "demo-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "embed.safetensors").write_bytes(b"")
    (tmp_path / ".demo-model.tmp-0123abcd").mkdir()  # what a run killed while writing it leaves now

    out = io.StringIO()
    folder, demo = up_cmd._model(None, tmp_path, Console(file=out, width=200))
    assert (folder, demo) == (model, True)
    assert (model / "tokenizer.json").is_file() and (model / "tokenizer_config.json").is_file()
    assert "is incomplete (a run was stopped while writing it): deleting it" in out.getvalue()
    assert [p.name for p in tmp_path.iterdir()] == ["demo-model"]  # no temporary folder left beside it

    # Complete now: used as it is.
    out = io.StringIO()
    assert up_cmd._model(None, tmp_path, Console(file=out, width=200)) == (model, True)
    assert out.getvalue() == ""


def test_a_second_up_in_the_same_workdir_is_refused(tmp_path, monkeypatch):
    """Its quantizer failed the first run's live publish as orphaned (and deleted its objects): refused at once,
    naming the folder and the first run's pid."""
    workdir = tmp_path / "stack"
    workdir.mkdir()
    monkeypatch.setattr(up_cmd, "_model", _must_not_start)
    with open(workdir / ".lock", "w") as first:  # what the first run holds
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        first.write("4242\n")
        first.flush()
        result = CliRunner().invoke(app, ["up", "--workdir", str(workdir), "--once"])
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert result.stderr.strip().splitlines() == [
        f"error: another qctl up (pid 4242) is using {workdir}: stop it, or give this one another --workdir"]

    # The first run ended (its lock went with it): the next run takes the folder, with its own pid.
    with up_cmd._workdir_lock(workdir):
        assert (workdir / ".lock").read_text().strip() == str(os.getpid())


def test_an_empty_prompt_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """It ran the whole demo (publishes, workers, rollout), then the gateway refused the prompt."""
    monkeypatch.setattr(up_cmd, "_model", _must_not_start)
    result = CliRunner().invoke(app, ["up", "--workdir", str(tmp_path / "s"), "--once", "--prompt", ""])
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert "--prompt" in result.stderr and "non-empty prompt" in result.stderr
    assert not (tmp_path / "s").exists()


class _FakeStack:
    def __init__(self, workdir, device):
        self.device, self.admin_token, self.quantizer_token = device, "a", "q"
        self.store = SimpleNamespace(root=workdir / "store")
        self.timeouts: list[float] = []
        _FakeStack.last = self

    def start_quantizer(self, eval_path):
        return "127.0.0.1:1"

    def start_gateway(self):
        return "127.0.0.1:2"

    def start_worker(self, artifact_id, memory_budget=None, timeout_s=300.0):
        self.timeouts.append(timeout_s)
        return "127.0.0.1:3"

    def stop(self):
        pass


class _FakeCheck:
    """Stands in for the accuracy check: prints nothing, hands back the artifact (here its id)."""

    def __init__(self, *args):
        self.request = None

    def show(self, artifact):
        return artifact


def test_up_on_cuda_n_binds_to_that_gpu_and_waits_for_its_workers(tmp_path, monkeypatch):
    """`--device cuda:1` (accepted by resolve_device, the quantizer and the worker) died with a KeyError at the
    first worker start, after both publishes; its artifacts were bound to the current GPU's target, not cuda:1's.
    No GPU here: torch.cuda is stood in for (cuda:1 an sm90, the current GPU an sm80), the services too."""
    import qctl.stack

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text("x = 1\n" * 100)
    targets = []

    def publish(quantizer, token, model, name, fmt, gpu_target, *rest):
        targets.append(gpu_target)
        return f"{fmt}-id"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (9, 0) if str(device) == "cuda:1" else (8, 0))
    monkeypatch.setattr(qctl.stack, "LocalStack", _FakeStack)
    monkeypatch.setattr(up_cmd, "_publish", publish)
    monkeypatch.setattr(up_cmd, "_AccuracyCheck", _FakeCheck, raising=False)
    monkeypatch.setattr(up_cmd, "_worker_budget", lambda device: 1 << 30)
    monkeypatch.setattr(up_cmd, "_wait_for_workers", _must_not_start)
    result = CliRunner().invoke(app, ["up", "--once", "--device", "cuda:1", "--model", str(model),
                                      "--eval-data", str(eval_text), "--workdir", str(tmp_path / "s")])
    assert isinstance(result.exception, _Started), (result.exception, result.stderr)
    assert targets == ["sm90", "sm90"]
    assert _FakeStack.last.timeouts == [up_cmd.WORKER_START_S["cuda"]] * 2


@pytest.mark.parametrize(("device", "expected"), [("cuda:1", "sm90"), ("cuda", "sm80"), (None, "sm80")])
def test_the_gpu_target_is_the_named_devices(monkeypatch, device, expected):
    from qctl.devices import resolve_gpu_target

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: (9, 0) if str(device) == "cuda:1" else (8, 0))
    assert resolve_gpu_target("auto", device) == expected

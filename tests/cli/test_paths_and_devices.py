"""qctl's local commands given a device torch has no backend for, or a path that cannot be written: one
`error:` line and exit code 2, never a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qctl.main import app
from tests.conftest import write_random_llama

runner = CliRunner()


def _invoke(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.stderr


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def small_model(tmp_path, tiny_llama):  # tiny_llama: the fixture's tokenizer, which write_random_llama copies
    model = write_random_llama(tmp_path / "m", layers=1)
    data = tmp_path / "eval.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    return model, data


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x"])
def test_quantize_and_eval_name_a_device_they_cannot_run_on(small_model, tmp_path, device):
    """torch's RuntimeError ("Expected one of cpu, cuda, ... device type at start of device string: tpu") was a
    traceback with exit code 1, after the checkpoint had been loaded."""
    model, data = small_model
    code, err = _invoke("quantize", "--model", model, "--format", "fp16", "--out", tmp_path / "out",
                        "--gpu-target", "cpu", "--device", device)
    assert code == 2 and f"device {device!r} is not supported" in _error_line(err)
    code, err = _invoke("eval", "--model", model, "--data", data, "--seq-len", "64", "--device", device)
    assert code == 2 and f"device {device!r} is not supported" in _error_line(err)


def test_up_refuses_an_unknown_device_before_starting_anything(tmp_path):
    # It wrote the demo model, started the quantizer and the gateway, and only then failed.
    workdir = tmp_path / "stack"
    code, err = _invoke("up", "--workdir", workdir, "--device", "tpu", "--once")
    assert code == 2 and "device 'tpu' is not supported" in _error_line(err)
    assert "starting the stack" not in err and not workdir.exists()


def test_quantize_into_a_folder_that_cannot_be_created_is_one_line(small_model, tmp_path):
    model, _ = small_model
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _invoke("quantize", "--model", model, "--format", "fp16", "--out", blocker / "art",
                        "--gpu-target", "cpu", "--device", "cpu")  # was a NotADirectoryError traceback
    assert code == 2 and "Not a directory" in _error_line(err)


def test_up_with_a_workdir_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _invoke("up", "--workdir", blocker / "stack", "--device", "cpu", "--once")
    assert code == 2 and "Not a directory" in _error_line(err)
    assert "starting the stack" not in err

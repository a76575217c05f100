"""qctl publish / qctl ls against a running quantizer."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from qctl.main import app
from shared.model.tokenizer import Tokenizer
from shared.storage import open_store

runner = CliRunner()


@pytest.fixture
def quantizer(bucket_store, start_quantizer, registry_url):
    return start_quantizer(bucket_store, registry_url)


def _run(*args: object) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})
    return result.exit_code, result.stdout, result.stderr


def _publish(quantizer, source, small_texts, *extra: object) -> tuple[int, str, str]:
    calib, evaluation = small_texts
    return _run("publish", "--source", source, "--model-name", "rand", "--format", "w4a8kv4-g128",
                "--gpu-target", "cpu", "--quantizer", quantizer.address, "--calib", calib, "--calib-samples", 2,
                "--calib-seq-len", 64, "--eval-data", evaluation, "--eval-seq-len", 64, "--eval-max-windows", 2,
                *extra)


def test_publish_prints_the_artifact_id_and_ls_shows_it(quantizer, small_model, small_texts):
    code, out, err = _publish(quantizer, small_model, small_texts, "--version-label", "first")
    assert code == 0, err
    artifact_id = out.strip()
    assert len(artifact_id) == 32
    assert "quantize block 2/2" in err and f"artifact {artifact_id} READY" in err and "vs fp16" in err

    code, out, err = _run("ls", "--quantizer", quantizer.address)
    assert code == 0, err
    row = next(line for line in out.splitlines() if artifact_id in line)
    assert "rand" in row and "first" in row and "READY" in row and "w4a8kv4-g128" in row and "cpu" in row
    assert "->" in row  # the perplexity pair
    assert Tokenizer(small_model).vocabulary_digest()[:12] in row  # which artifacts may share a deployment
    assert re.search(r"\b\d+\.\d MiB\b", row)  # its size: what a worker's cache takes


def test_publish_exits_non_zero_with_the_jobs_error(quantizer, small_model, small_texts):
    (small_model / "model.safetensors").write_bytes(b"garbage" * 100)
    code, out, err = _publish(quantizer, small_model, small_texts)
    assert code == 1 and out == ""
    assert "error: job " in err and "failed: load failed: " in err and "not a readable safetensors file" in err


def test_publish_shows_what_the_quantizer_refused(quantizer, small_texts, tmp_path):
    code, _, err = _publish(quantizer, tmp_path / "nothing-here", small_texts)
    assert code == 2 and "does not exist" in err and "NOT_FOUND" in err


def test_an_unreachable_quantizer_is_named(small_texts, tmp_path):
    code, _, err = _run("ls", "--quantizer", "127.0.0.1:1")
    assert code == 2 and "cannot reach the quantizer at 127.0.0.1:1" in err


def test_ls_with_no_models(quantizer):
    code, out, _ = _run("ls", "--quantizer", quantizer.address)
    assert code == 0 and "no models registered" in out


def test_publish_rtn_switches_every_qoq_step_off(quantizer, bucket_store, small_model, small_texts):
    code, out, err = _publish(quantizer, small_model, small_texts, "--rtn", "--clipping")
    assert code == 0, err
    artifact_id = out.strip()
    store = open_store(bucket_store)
    manifest_key = next(o.key for o in store.list() if o.key.endswith(f"{artifact_id}/manifest.json"))
    options = json.loads(store.get_bytes(manifest_key))["options"]
    # --rtn turns off everything not named; --clipping, named explicitly, stays on.
    assert options["clipping"] is True
    for step in ("smooth_attention", "rotation", "rotate_values", "kv_range_search", "smoothing", "reorder", "gptq",
                 "compensate_inputs", "key_feedback"):
        assert options[step] is False, step


@pytest.mark.parametrize("option", ["--calib-samples", "--calib-seq-len", "--eval-seq-len", "--eval-max-windows"])
def test_publish_refuses_a_negative_count_with_one_line(small_texts, tmp_path, option):
    # These are uint32 fields of the request: a negative value must be a usage error, not a traceback.
    result = runner.invoke(app, ["publish", "--source", str(tmp_path), "--model-name", "rand", "--format", "fp16",
                                 "--gpu-target", "cpu", "--quantizer", "127.0.0.1:1", option, "-1"])
    assert result.exit_code == 2, result.exception
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert option in result.stderr

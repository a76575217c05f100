"""qctl quantize / eval: artifacts on disk, and one clear line for every bad input."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qctl.main import app
from shared.formats.artifact import ArtifactReader
from tests.conftest import write_random_llama

runner = CliRunner()


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _quantize(model, out, fmt="w4a8kv4-g128", *extra):
    return _run("quantize", "--model", model, "--format", fmt, "--out", out, "--device", "cpu", "--gpu-target", "cpu",
                "--calib-samples", "2", "--calib-seq-len", "64", *extra)


@pytest.fixture
def calib(tmp_path, calib_text) -> Path:
    path = tmp_path / "calib.txt"
    path.write_text(calib_text.read_text()[:20000])
    return path


def test_quantize_writes_a_verified_artifact_and_eval_reads_it(random_llama, tmp_path, calib, eval_text):
    out = tmp_path / "art"
    code, output = _quantize(random_llama, out, "w4a8kv4-g128", "--calib", calib)
    assert code == 0, output
    reader = ArtifactReader(out)  # verifies every file's sha256
    m = reader.manifest
    assert (m.format, m.gpu_target) == ("w4a8kv4-g128", "cpu")
    assert m.calibration["samples"] == 2 and m.calibration["seq_len"] == 64 and len(m.calibration["data_sha256"]) == 64
    assert m.options["rotation"] and m.options["smooth_attention"]
    assert {f.path for f in m.files} >= {"weights/embed.safetensors", "weights/block_000.safetensors", "weights/head.safetensors"}
    small_eval = tmp_path / "eval.txt"
    small_eval.write_text(eval_text.read_text()[:6000])
    code, output = _run("eval", "--model", random_llama, "--artifact", out, "--data", small_eval,
                        "--seq-len", "128", "--json", "--device", "cpu")
    assert code == 0, output
    result = json.loads(output.strip().splitlines()[-1])
    assert result["ppl"] > 1 and result["tokens"] % 128 == 0 and result["tokens"] > 0


def test_every_format_quantizes(random_llama, tmp_path, calib):
    for fmt in ("w4a8kv4-chn", "w8a8", "w4a16-g128", "fp16"):
        code, output = _quantize(random_llama, tmp_path / fmt, fmt, "--calib", calib, "--rtn")
        assert code == 0, f"{fmt}: {output}"
        assert ArtifactReader(tmp_path / fmt).manifest.format == fmt


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


def test_missing_checkpoint(tmp_path):
    code, output = _quantize(tmp_path / "nope", tmp_path / "out")
    assert code == 2 and "does not exist" in _error_line(output)


def test_non_llama_checkpoint(random_llama, tmp_path):
    cfg = json.loads((random_llama / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (random_llama / "config.json").write_text(json.dumps(cfg))
    code, output = _quantize(random_llama, tmp_path / "out")
    assert code == 2 and "not a Llama-family checkpoint" in _error_line(output)


def test_sizes_not_divisible_by_the_group(tmp_path, calib):
    model = write_random_llama(tmp_path / "odd", hidden=192, heads=3, kv_heads=1, ffn=320)
    code, output = _quantize(model, tmp_path / "out", "w4a8kv4-g128", "--calib", calib)
    line = _error_line(output)
    assert code == 2 and "hidden_size=192 is not a multiple of the group size 128" in line
    # w8a8 has no groups, so the same model quantizes
    code, output = _quantize(model, tmp_path / "out8", "w8a8", "--calib", calib)
    assert code == 0, output


def test_empty_calibration_file(random_llama, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    code, output = _quantize(random_llama, tmp_path / "out", "w4a8kv4-g128", "--calib", empty)
    assert code == 2 and "is empty" in _error_line(output)


def test_a_checkpoint_without_a_tokenizer_is_refused_for_every_format(tmp_path):
    """fp16 and RTN need no calibration text, so nothing read the tokenizer: the artifact was written, and every
    worker refused it at start-up (its tokenizer/ missing)."""
    model = write_random_llama(tmp_path / "no-tokenizer", tokenizer_from=None)
    code, output = _quantize(model, tmp_path / "out", "fp16")
    assert code == 2 and "has no tokenizer.json or tokenizer.model" in _error_line(output)
    assert not (tmp_path / "out").exists()


def test_unknown_format(random_llama, tmp_path):
    code, output = _quantize(random_llama, tmp_path / "out", "w3a8")
    assert code == 2 and "w3a8" in output and "w4a8kv4-g128" in output


def test_output_folder_with_a_different_artifact_is_kept(random_llama, tmp_path, calib):
    out = tmp_path / "art"
    assert _quantize(random_llama, out, "w8a8", "--calib", calib, "--rtn")[0] == 0
    before = (out / "manifest.json").read_text()
    code, output = _quantize(random_llama, out, "w4a8kv4-g128", "--calib", calib)
    assert code == 2 and "already holds a different artifact" in _error_line(output)
    assert (out / "manifest.json").read_text() == before
    # the same artifact again replaces it
    assert _quantize(random_llama, out, "w8a8", "--calib", calib, "--rtn")[0] == 0


def test_output_folder_quantized_with_other_calibration_data_is_kept(random_llama, tmp_path, calib):
    """Other calibration data gives other weights: a different artifact, not one to replace silently."""
    out = tmp_path / "art"
    assert _quantize(random_llama, out, "w4a8kv4-chn", "--calib", calib)[0] == 0
    before = (out / "manifest.json").read_text()
    other = tmp_path / "other.txt"
    other.write_text(calib.read_text()[::-1])
    code, output = _quantize(random_llama, out, "w4a8kv4-chn", "--calib", other)
    assert code == 2 and "already holds a different artifact" in _error_line(output) and "calibration" in output
    assert (out / "manifest.json").read_text() == before


def test_a_calibration_file_the_format_does_not_use_is_noted_and_a_missing_one_refused(random_llama, tmp_path, calib):
    code, output = _quantize(random_llama, tmp_path / "a", "w8a8", "--calib", calib, "--rtn")
    assert code == 0 and "is not used" in output, output
    code, output = _quantize(random_llama, tmp_path / "b", "fp16", "--calib", tmp_path / "nope.txt")
    assert code == 2 and "nope.txt does not exist" in _error_line(output), output


def test_output_folder_with_other_files_is_refused(random_llama, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    code, output = _quantize(random_llama, out)
    assert code == 2 and "holds no artifact" in _error_line(output)
    assert (out / "todo.txt").read_text() == "mine"


def test_a_failed_quantization_leaves_no_partial_folder(random_llama, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _quantize(random_llama, tmp_path / "out", "w4a8kv4-g128", "--calib", empty)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.partial")]


def test_corrupt_artifact_is_refused_by_eval(random_llama, tmp_path, calib, eval_text):
    out = tmp_path / "art"
    assert _quantize(random_llama, out, "w8a8", "--calib", calib, "--rtn")[0] == 0
    block = out / "weights" / "block_001.safetensors"
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    code, output = _run("eval", "--model", random_llama, "--artifact", out, "--data", eval_text, "--json")
    assert code == 2 and "sha256 of weights/block_001.safetensors does not match" in _error_line(output)

"""qctl quantize / eval: malformed inputs a user can hand them give one clear line, never a traceback."""

import json

from typer.testing import CliRunner

from qctl.main import app
from tests.conftest import write_random_llama

runner = CliRunner()


def _run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def _error_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output
    return lines[0]


def _eval(model, data, *extra):
    return _run("eval", "--model", model, "--data", data, "--seq-len", "64", "--device", "cpu", *extra)


def _small_model(tmp_path):
    model = write_random_llama(tmp_path / "m", layers=1)
    data = tmp_path / "eval.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    return model, data


def test_eval_refuses_a_batch_size_below_one(tmp_path, tiny_llama):
    model, data = _small_model(tmp_path)
    for bad in ("0", "-1"):  # -1 was a ZeroDivisionError traceback, 0 "range() arg 3 must not be zero"
        code, output = _eval(model, data, "--batch-size", bad)
        assert code == 2 and "batch size" in _error_line(output), output


def test_malformed_shard_index_is_a_checkpoint_error(tmp_path, tiny_llama):
    model, data = _small_model(tmp_path)
    index = model / "model.safetensors.index.json"
    index.write_text("{}")  # no weight_map: was a KeyError traceback
    code, output = _eval(model, data)
    assert code == 2 and "model.safetensors.index.json" in _error_line(output), output
    index.write_text("not json")  # was "error: Expecting value: line 1 column 1 (char 0)", naming no file
    code, output = _eval(model, data)
    assert code == 2 and "model.safetensors.index.json" in _error_line(output), output


def test_unreadable_tokenizer_is_a_checkpoint_error(tmp_path, tiny_llama):
    model, data = _small_model(tmp_path)
    (model / "tokenizer.json").write_text("garbage")  # was a traceback from the tokenizers library
    code, output = _eval(model, data)
    assert code == 2 and "tokenizer.json" in _error_line(output), output
    code, output = _run("quantize", "--model", model, "--format", "w4a8kv4-g128", "--out", tmp_path / "out",
                        "--device", "cpu", "--gpu-target", "cpu", "--calib", data)
    assert code == 2 and "tokenizer.json" in _error_line(output), output


def test_config_that_is_not_a_json_object_is_a_checkpoint_error(tmp_path, tiny_llama):
    model, data = _small_model(tmp_path)
    (model / "config.json").write_text(json.dumps([1, 2]))  # was an AttributeError traceback
    code, output = _eval(model, data)
    assert code == 2 and "config.json" in _error_line(output), output


def test_a_tokenizer_beyond_the_models_vocabulary_is_named(tmp_path, tiny_llama):
    """The fixture's tokenizer over a model of 64 tokens: ids past the embedding table were an IndexError."""
    model = write_random_llama(tmp_path / "m", layers=1, vocab=64)
    data = tmp_path / "eval.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 200)
    code, output = _eval(model, data)
    assert code == 2 and "vocabulary of 64" in _error_line(output), output
    code, output = _run("quantize", "--model", model, "--format", "w4a8kv4-g128", "--out", tmp_path / "out",
                        "--calib", data, "--calib-samples", "2", "--calib-seq-len", "64", "--device", "cpu",
                        "--gpu-target", "cpu")
    assert code == 2 and "vocabulary of 64" in _error_line(output), output



def test_eval_refuses_an_artifact_of_another_checkpoint_of_the_same_shape(tmp_path):
    """A fine-tune or another version has the same configuration: scored against the wrong checkpoint (its
    tokenizer, its fp16 perplexity) the number looked like a valid fp16-vs-quantized comparison."""
    model, data = _small_model(tmp_path)
    other = write_random_llama(tmp_path / "other", layers=1, seed=1)
    code, output = _run("quantize", "--model", other, "--format", "w8a8", "--out", tmp_path / "art",
                        "--device", "cpu", "--gpu-target", "cpu", "--calib", data, "--calib-samples", "2",
                        "--calib-seq-len", "64", "--rtn")
    assert code == 0, output
    code, output = _eval(model, data, "--artifact", tmp_path / "art", "--max-windows", "1")
    assert code == 2 and "was not made from" in _error_line(output) and "other weights" in output, output
    code, output = _eval(other, data, "--artifact", tmp_path / "art", "--max-windows", "1")
    assert code == 0, output


def _with_config(model, **changes):
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_a_null_rope_value_in_config_json_is_one_line_naming_the_key(tmp_path, tiny_llama):
    """float(None) / int(None) were a TypeError traceback (exit 1)."""
    model, data = _small_model(tmp_path)
    for changes, named in [({"rope_theta": None}, "rope_theta=None"),
                           ({"rope_scaling": {"rope_type": "linear", "factor": None}}, "rope_scaling.factor=None"),
                           ({"max_position_embeddings": None}, "max_position_embeddings=None"),
                           ({"rope_scaling": ["linear", 2.0]}, "rope_scaling=")]:
        code, output = _eval(_with_config(model, **changes), data)
        assert code == 2 and named in _error_line(output), output
        _with_config(model, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=2048)


def test_windows_beyond_the_models_context_are_refused_naming_both_lengths(tmp_path, tiny_llama):
    """Positions past max_position_embeddings were never trained and are never served: a perplexity or a
    calibration over them was a plausible number about nothing."""
    model, data = _small_model(tmp_path)
    _with_config(model, max_position_embeddings=32)
    code, output = _eval(model, data)  # --seq-len 64
    line = _error_line(output)
    assert code == 2 and "--seq-len 64" in line and "context of 32" in line, output
    code, output = _run("quantize", "--model", model, "--format", "w4a8kv4-g128", "--out", tmp_path / "out",
                        "--calib", data, "--calib-samples", "2", "--calib-seq-len", "64", "--device", "cpu",
                        "--gpu-target", "cpu")
    line = _error_line(output)
    assert code == 2 and "64 tokens" in line and "context of 32" in line, output
    assert not (tmp_path / "out").exists()


def test_eval_without_seq_len_uses_a_short_models_whole_context(tmp_path, tiny_llama):
    """The default window (512) is shortened to the model's context, not refused: the user asked for nothing."""
    model, data = _small_model(tmp_path)
    _with_config(model, max_position_embeddings=32)
    code, output = _run("eval", "--model", model, "--data", data, "--device", "cpu", "--max-windows", "2", "--json")
    assert code == 0, output
    assert json.loads(output.strip().splitlines()[-1])["tokens"] == 2 * 32, output  # was 2 windows of 512


def test_quantize_without_calib_seq_len_uses_a_short_models_whole_context(tmp_path, tiny_llama):
    """As for eval: the default calibration window (512) is shortened to a model's shorter context, not refused."""
    model, data = _small_model(tmp_path)
    _with_config(model, max_position_embeddings=32)
    code, output = _run("quantize", "--model", model, "--format", "w4a8kv4-g128", "--out", tmp_path / "out",
                        "--calib", data, "--calib-samples", "2", "--device", "cpu", "--gpu-target", "cpu")
    assert code == 0, output
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["calibration"]["seq_len"] == 32


def test_eval_refuses_an_artifact_whose_tokenizer_differs_from_the_models(tmp_path):
    """The model version covers config.json and the weights: a --model copy with two token ids swapped in its
    tokenizer was accepted and scored other ids than the artifact's workers read."""
    model, data = _small_model(tmp_path)
    code, output = _run("quantize", "--model", model, "--format", "w8a8", "--out", tmp_path / "art",
                        "--device", "cpu", "--gpu-target", "cpu", "--calib", data, "--calib-samples", "2",
                        "--calib-seq-len", "64", "--rtn")
    assert code == 0, output
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[100:102]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    code, output = _eval(model, data, "--artifact", tmp_path / "art", "--max-windows", "1")
    assert code == 2 and "carries another tokenizer" in _error_line(output), output


def test_eval_reads_the_data_files_bytes_as_the_quantizers_eval_does(tmp_path):
    """qctl eval read with universal newlines (CRLF became LF) while the quantizer's eval kept the bytes whose
    sha256 it records: one file scored 7.16 in one and 93.45 in the other. Text that is not UTF-8 was scored as
    U+FFFD characters, exit 0."""
    model, data = _small_model(tmp_path)
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(data.read_bytes().replace(b"\n", b"\r\n"))
    code, output = _eval(model, crlf, "--json", "--max-windows", "2")
    assert code == 0, output
    code, lf_output = _eval(model, data, "--json", "--max-windows", "2")
    assert json.loads(lf_output)["ppl"] != json.loads(output)["ppl"]  # the \r are scored, as their bytes say

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café = 1\n".encode("latin-1") * 300)
    code, output = _eval(model, latin1)
    assert code == 2 and "is not UTF-8 text: byte 3 is 0xe9" in _error_line(output), output

"""The quantizer's free-space check: the artifact's size is estimated from the checkpoint's shape before any
work (shared/formats/artifact.py estimated_artifact_bytes), and a disk that cannot hold it is refused at once."""

from __future__ import annotations

import dataclasses

import pytest

from shared.formats.artifact import ArtifactError
from shared.formats.spec import FORMATS, format_spec
from shared.model.config import LlamaConfig
from shared.quant.options import QoQOptions
from shared.quant.quantize_model import QuantizeSettings, artifact_bytes, quantize_checkpoint
from tests.conftest import write_random_llama

HEADERS = 1 << 20  # the estimate's allowance per file (headers, manifest)


def _estimate(model, fmt: str, key_feedback: bool = False) -> int:
    options = dataclasses.replace(QoQOptions.rtn(), key_feedback=key_feedback)
    return artifact_bytes(model, LlamaConfig.from_folder(model), format_spec(fmt), options)


@pytest.mark.parametrize("tie", [False, True])
def test_the_estimate_covers_every_format_and_is_close(tmp_path, tie):
    """Over the artifact's size, and within the per-file allowance of it: a disk that holds the artifact is
    not refused for want of a few header bytes' accuracy, nor one far too small accepted."""
    model = write_random_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, ffn=384, layers=2, tie=tie)
    for fmt in FORMATS:
        out = tmp_path / fmt
        quantize_checkpoint(QuantizeSettings(model, out, fmt, options=QoQOptions.rtn()))
        written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        estimate = _estimate(model, fmt)
        assert written <= estimate <= written + 6 * HEADERS, (fmt, written, estimate)


def test_key_feedback_factors_are_counted(tmp_path, calib_text):
    model = write_random_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, ffn=384, layers=2)
    options = dataclasses.replace(QoQOptions.rtn(), key_feedback=True)
    out = tmp_path / "a"
    quantize_checkpoint(QuantizeSettings(model, out, "w4a8kv4-g128", options=options, calib_path=calib_text,
                                         calib_samples=2, calib_seq_len=64))
    written = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    estimate = _estimate(model, "w4a8kv4-g128", key_feedback=True)
    assert written <= estimate <= written + 6 * HEADERS
    assert estimate - _estimate(model, "w4a8kv4-g128") == 2 * 2 * 64 * 64 * 4  # (kv_heads, D, D) fp32 per layer


def test_a_disk_too_small_for_the_artifact_is_refused_before_any_work(tmp_path, monkeypatch):
    model = write_random_llama(tmp_path / "m", hidden=256, heads=4, kv_heads=2, ffn=384, layers=2)
    needed = _estimate(model, "w4a8kv4-g128")
    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: needed - 1)
    out = tmp_path / "out" / "a"
    # The calibration file does not exist: the refusal comes first, before the calibration text is read.
    settings = QuantizeSettings(model, out, "w4a8kv4-g128", calib_path=tmp_path / "missing.txt")
    with pytest.raises(ArtifactError, match=rf"not enough disk space for the w4a8kv4-g128 artifact in {out}: it "
                                            r"needs about .* GiB and the filesystem of .* has .* GiB free"):
        quantize_checkpoint(settings)
    assert not (tmp_path / "out").exists()

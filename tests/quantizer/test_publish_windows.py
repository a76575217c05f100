"""Calibration and eval windows of a Publish, by the rule `qctl quantize` and `qctl eval` follow
(LlamaConfig.window): not asked, 512 or the model's context if that is shorter; asked past the context,
refused. The quantizer filled in 512 before it knew the context, then refused its own default for a model of
fewer positions ("--calib-seq-len 512 ... give at most 256": `qctl up --model` of llama2.c's stories15M)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.quantizer.config import QuantizerConfig
from services.quantizer.errors import InvalidRequest
from services.quantizer.publish_spec import PublishSpec
from shared.formats.manifest import Manifest
from shared.registry import sqlite_url
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import StorageConfig

Q = quantizer_pb2
CONTEXT = 32


@pytest.fixture
def short_model(small_model: Path) -> Path:
    """The small random Llama with a context of CONTEXT positions."""
    config = json.loads((small_model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (small_model / "config.json").write_text(json.dumps(config))
    return small_model


@pytest.fixture
def local_store(tmp_path: Path) -> StorageConfig:
    return StorageConfig.from_url(str(tmp_path / "store"))


def _spec(request: Q.PublishRequest, store: StorageConfig, tmp_path: Path) -> PublishSpec:
    config = QuantizerConfig(registry_url=sqlite_url(tmp_path / "registry.db"), store=store, work_dir=tmp_path / "w")
    return PublishSpec.from_pb(request, config)


def test_windows_not_asked_are_the_models_context_when_shorter(short_model, request_for, local_store, tmp_path):
    request = request_for(short_model, calibration=Q.Calibration(num_samples=2), eval=Q.EvalData(
        data=request_for(short_model).eval.data))
    spec = _spec(request, local_store, tmp_path)
    assert (spec.calib_seq_len, spec.eval_seq_len) == (CONTEXT, CONTEXT)
    # The job's request shows what it runs with.
    assert (spec.to_pb().calibration.seq_len, spec.to_pb().eval.seq_len) == (CONTEXT, CONTEXT)


@pytest.mark.parametrize("field", ["calibration", "eval"])
def test_a_window_asked_past_the_context_is_refused_naming_it(short_model, request_for, local_store, tmp_path, field):
    request = request_for(short_model)
    request.calibration.seq_len = request.eval.seq_len = 0  # request_for's 64: this test asks in `field` only
    getattr(request, field).seq_len = 2 * CONTEXT
    with pytest.raises(InvalidRequest) as refused:
        _spec(request, local_store, tmp_path)
    what = "a calibration" if field == "calibration" else "an eval"
    assert str(refused.value) == (
        f"{field}.seq_len {2 * CONTEXT}: {what} window of {2 * CONTEXT} tokens exceeds the model's context of "
        f"{CONTEXT} tokens (config.json max_position_embeddings); give at most {CONTEXT}")


def test_an_s3_sources_windows_are_left_to_the_job(request_for, local_store, tmp_path):
    """Its context is known once the job has read its config.json: the calibration window is resolved then
    (quantize_checkpoint applies the same rule), and the job's request says 0, the default."""
    request = request_for("s3://checkpoints/llamas/rand", calibration=Q.Calibration(num_samples=2))
    request.eval.seq_len = 0
    spec = _spec(request, local_store, tmp_path)
    assert spec.calib_seq_len is None and spec.to_pb().calibration.seq_len == 0
    # The eval window likewise (the pipeline applies the rule when it cuts the windows): 512 was filled in,
    # then cut from a model of fewer positions unchecked.
    assert spec.eval_seq_len is None and spec.to_pb().eval.seq_len == 0


def test_a_short_context_model_publishes_without_window_settings(short_model, request_for, local_store,
                                                                 start_quantizer, registry_url, tmp_path):
    """The real path: the job calibrated on 512-token windows it then refused, and failed."""
    quantizer = start_quantizer(local_store, registry_url, create_bucket=True)
    evaluation = request_for(short_model).eval.data
    job, _ = quantizer.publish(request_for(short_model, calibration=Q.Calibration(num_samples=2),
                                           eval=Q.EvalData(data=evaluation, max_windows=2)))
    assert Q.JobState.Name(job.state) == "JOB_STATE_SUCCEEDED", job.error
    assert (job.artifact.evaluation.seq_len, job.artifact.evaluation.num_windows) == (CONTEXT, 2)
    manifest = Manifest.read(local_store.root / job.artifact.object_key_prefix)
    assert manifest.calibration["seq_len"] == CONTEXT

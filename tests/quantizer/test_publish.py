"""Publishing through the service: job, registry record, S3 objects, progress, dedupe, the accuracy gate."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from shared.formats.artifact import ArtifactReader
from shared.model.tokenizer import Tokenizer
from shared.registry import ArtifactState, JobState, get_artifact, get_job, list_artifacts
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2
from shared.storage import StorageConfig, open_store

Q = quantizer_pb2
STAGE_ORDER = ["JOB_STAGE_LOAD", "JOB_STAGE_CALIBRATE", "JOB_STAGE_QUANTIZE", "JOB_STAGE_PACK",
               "JOB_STAGE_EVAL", "JOB_STAGE_UPLOAD", "JOB_STAGE_REGISTER"]


def _upload_folder(moto, bucket: str, prefix: str, folder: Path) -> str:
    client = moto.client()
    client.create_bucket(Bucket=bucket)
    for path in sorted(folder.iterdir()):
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}"


def _stages(updates) -> list[str]:
    seen = []
    for update in updates:
        name = Q.JobStage.Name(update.job.stage)
        if update.job.stage and (not seen or seen[-1] != name):
            seen.append(name)
    return seen


def test_publish_from_s3_end_to_end(moto, bucket_store, start_quantizer, registry_url, open_registry,
                                    small_model, request_for, tmp_path):
    source = _upload_folder(moto, "checkpoints", "llamas/rand", small_model)
    quantizer = start_quantizer(bucket_store, registry_url)
    job, updates = quantizer.publish(request_for(source, version_label="v1"))

    assert Q.JobState.Name(job.state) == "JOB_STATE_SUCCEEDED", job.error
    artifact = job.artifact
    assert artifact.state == common_pb2.ARTIFACT_STATE_READY
    evaluation = artifact.evaluation
    assert evaluation.perplexity_fp16 > 1 and evaluation.perplexity_quantized > 1
    assert (evaluation.seq_len, evaluation.num_windows, evaluation.max_relative_increase) == (64, 2, 0.05)
    assert evaluation.data_name == "eval-small"
    assert job.request.source == source and job.request.max_relative_perplexity_increase == 0.05

    # WatchJob: the snapshot first, every stage in order, block i of n while quantizing, the end last.
    assert updates[0].job.job_id == job.job_id
    assert _stages(updates) == STAGE_ORDER
    blocks = [(u.job.block_index, u.job.block_count) for u in updates if u.job.stage == Q.JOB_STAGE_QUANTIZE]
    assert (1, 2) in blocks and (2, 2) in blocks
    assert all(u.job.state != Q.JOB_STATE_SUCCEEDED for u in updates[:-1])
    assert any(u.job.HasField("estimated_remaining") for u in updates if u.job.stage == Q.JOB_STAGE_QUANTIZE)
    downloaded = [u.message for u in updates if u.message.startswith(f"downloaded {source}: ")]  # its size and rate
    assert len(downloaded) == 1 and downloaded[0].endswith(" MB/s)") and " GiB in " in downloaded[0], downloaded

    # The registry: READY with its perplexity pair, the job SUCCEEDED, the version labelled.
    registry = open_registry(registry_url)
    with registry.sessions() as session:
        row = get_artifact(session, artifact.artifact_id)
        assert row.state == ArtifactState.READY
        assert (row.ppl_fp16, row.ppl_quant) == (evaluation.perplexity_fp16, evaluation.perplexity_quantized)
        assert row.model_version.label == "v1" and len(row.content_digest) == 64
        assert row.vocabulary_digest == Tokenizer(small_model).vocabulary_digest()  # checked across arms
        assert get_job(session, job.job_id).state == JobState.SUCCEEDED
    version = row.model_version.content_hash

    # S3: every object under <model>/<model_version>/<format>/<gpu>/<artifact_id>/, nothing staged.
    prefix = f"rand/{version}/w4a8kv4-g128/cpu/{artifact.artifact_id}/"
    assert artifact.object_key_prefix == prefix
    keys = moto.keys(bucket_store.bucket)
    assert keys and all(key.startswith(prefix) for key in keys)
    assert {prefix + "manifest.json", prefix + "weights/block_001.safetensors"} <= set(keys)

    # What a worker downloads verifies, and its manifest names the artifact and its evaluation.
    folder = tmp_path / "downloaded"
    open_store(bucket_store).download_folder(prefix, folder)
    manifest = ArtifactReader(folder).manifest  # checks every file's sha256
    assert (manifest.artifact_id, manifest.model_name, manifest.model_version) == (artifact.artifact_id, "rand", version)
    assert manifest.evaluation.ppl_quantized == evaluation.perplexity_quantized
    assert (manifest.evaluation.seq_len, manifest.evaluation.windows) == (64, 2)
    assert artifact.size_bytes == sum(f.size for f in manifest.files) + (folder / "manifest.json").stat().st_size

    # The read API agrees.
    got = quantizer.stub.GetArtifact(Q.GetArtifactRequest(artifact_id=artifact.artifact_id))
    assert got.state == common_pb2.ARTIFACT_STATE_READY and got.evaluation.num_windows == 2
    listed = quantizer.stub.ListArtifacts(Q.ListArtifactsRequest(model_name="rand", state=common_pb2.ARTIFACT_STATE_READY))
    assert [a.artifact_id for a in listed.artifacts] == [artifact.artifact_id]
    assert not quantizer.stub.ListArtifacts(Q.ListArtifactsRequest(gpu_target="sm90")).artifacts
    models = quantizer.stub.ListModels(Q.ListModelsRequest()).models
    assert [(m.model_name, [(v.model_version, v.version_label) for v in m.versions]) for m in models] == [
        ("rand", [(version, "v1")])
    ]
    assert [a.artifact_id for a in models[0].versions[0].artifacts] == [artifact.artifact_id]
    final = quantizer.stub.GetJob(Q.GetJobRequest(job_id=job.job_id))
    assert final.state == Q.JOB_STATE_SUCCEEDED and final.elapsed.ToTimedelta().total_seconds() > 0
    assert final.request.eval.max_windows == 2 and final.request.calibration.num_samples == 2


def test_identical_content_is_stored_once(moto, bucket_store, start_quantizer, registry_url, small_model, request_for):
    quantizer = start_quantizer(bucket_store, registry_url)
    first, _ = quantizer.publish(request_for(small_model, model_name="rand"))
    keys = moto.keys(bucket_store.bucket)

    again, updates = quantizer.publish(request_for(small_model, model_name="rand"))  # the same binding
    assert again.state == Q.JOB_STATE_SUCCEEDED and again.artifact.artifact_id == first.artifact.artifact_id
    assert "already published" in updates[-2].message
    assert _stages(updates)[-1] == "JOB_STAGE_REGISTER" and "JOB_STAGE_QUANTIZE" not in _stages(updates)

    twin, updates = quantizer.publish(request_for(small_model, model_name="rand-twin"))  # same bytes, another name
    assert twin.state == Q.JOB_STATE_SUCCEEDED, twin.error
    assert twin.artifact.artifact_id != first.artifact.artifact_id
    assert twin.artifact.object_key_prefix == first.artifact.object_key_prefix
    assert any("reusing" in u.message for u in updates)
    assert moto.keys(bucket_store.bucket) == keys


def test_a_published_binding_is_adopted_only_by_a_request_it_answers(bucket_store, start_quantizer, registry_url,
                                                                      small_model, request_for):
    """A binding holds one artifact, and a repeated publish adopts it; one asking for a tighter budget than it
    meets, or for QoQ steps switched otherwise, fails naming the difference: it SUCCEEDED before, handing a CI
    gate an artifact over its limit and an ablation the other recipe."""
    quantizer = start_quantizer(bucket_store, registry_url)
    first, _ = quantizer.publish(request_for(small_model, max_relative_perplexity_increase=10.0))
    assert first.state == Q.JOB_STATE_SUCCEEDED, first.error
    evaluation = first.artifact.evaluation
    assert evaluation.perplexity_quantized > evaluation.perplexity_fp16  # random weights: over a 0% budget
    tight, _ = quantizer.publish(request_for(small_model, max_relative_perplexity_increase=0.0))
    assert tight.state == Q.JOB_STATE_FAILED
    assert "accuracy budget exceeded" in tight.error and first.artifact.artifact_id in tight.error
    other, _ = quantizer.publish(request_for(small_model, max_relative_perplexity_increase=10.0,
                                             qoq=Q.QoQOptions(rotation=False, gptq=True)))
    assert other.state == Q.JOB_STATE_FAILED
    assert "rotation off (the artifact has it on)" in other.error and "gptq" not in other.error
    same, _ = quantizer.publish(request_for(small_model, max_relative_perplexity_increase=10.0))
    assert same.state == Q.JOB_STATE_SUCCEEDED and same.artifact.artifact_id == first.artifact.artifact_id


def test_a_publish_waiting_for_the_same_binding_tries_itself_when_that_job_fails(
        monkeypatch, bucket_store, start_quantizer, registry_url, small_model, request_for):
    """The job it waited for failed its own request's budget (or was cancelled by its owner): the waiting job
    builds the artifact under its own request instead of failing with the other job's reason."""
    from tests.quantizer.pauses import pause_after_progress
    from services.quantizer.views import Stage

    pause = pause_after_progress(monkeypatch, Stage.QUANTIZE, 1)
    quantizer = start_quantizer(bucket_store, registry_url, workers=2)
    strict = quantizer.stub.Publish(request_for(small_model, max_relative_perplexity_increase=0.0))
    pause.wait_reached()  # the strict job holds the binding
    lax = quantizer.stub.Publish(request_for(small_model, max_relative_perplexity_increase=10.0))
    watch = quantizer.stub.WatchJob(Q.WatchJobRequest(job_id=lax.job_id), timeout=120)
    assert any("is publishing the same binding: waiting for it" in update.message for update in watch)
    watch.cancel()
    pause.go.set()
    first = quantizer.follow(strict.job_id)[-1].job
    second = quantizer.follow(lax.job_id)[-1].job
    assert first.state == Q.JOB_STATE_FAILED and "accuracy budget exceeded" in first.error
    assert second.state == Q.JOB_STATE_SUCCEEDED, second.error


def test_two_publishes_of_one_binding_at_once_make_one_artifact(moto, bucket_store, start_quantizer, any_registry_url,
                                                                open_registry, small_model, request_for):
    quantizer = start_quantizer(bucket_store, any_registry_url, workers=2)
    request = request_for(small_model)
    jobs = [quantizer.stub.Publish(request), quantizer.stub.Publish(request)]
    finals: dict[str, Q.Job] = {}
    messages: list[str] = []

    def follow(job_id: str) -> None:
        updates = quantizer.follow(job_id)
        finals[job_id] = updates[-1].job
        messages.extend(u.message for u in updates)

    threads = [threading.Thread(target=follow, args=(job.job_id,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)

    assert [finals[job.job_id].state for job in jobs] == [Q.JOB_STATE_SUCCEEDED] * 2, [f.error for f in finals.values()]
    artifact_ids = {finals[job.job_id].artifact.artifact_id for job in jobs}
    assert len(artifact_ids) == 1
    assert any("is publishing the same binding: waiting for it" in m for m in messages)
    with open_registry(any_registry_url).sessions() as session:
        assert [a.id for a in list_artifacts(session)] == list(artifact_ids)
    prefix = finals[jobs[0].job_id].artifact.object_key_prefix
    assert all(key.startswith(prefix) for key in moto.keys(bucket_store.bucket))


def test_accuracy_gate_fails_the_job_with_both_numbers(moto, bucket_store, start_quantizer, registry_url, open_registry,
                                                       tiny_llama, request_for):
    # A trained model always loses some accuracy to 4-bit weights: no increase at all is allowed here.
    quantizer = start_quantizer(bucket_store, registry_url)
    steps_off = Q.QoQOptions(smooth_attention=False, rotation=False, smoothing=False, reorder=False, clipping=False)
    request = request_for(tiny_llama, model_name="tiny", qoq=steps_off, max_relative_perplexity_increase=0.0,
                          calibration=Q.Calibration(data=request_for("x").calibration.data, num_samples=4, seq_len=128))
    job, updates = quantizer.publish(request)

    assert job.state == Q.JOB_STATE_FAILED
    assert job.error.startswith("accuracy budget exceeded: quantized perplexity ")
    assert "vs fp16 " in job.error and "above the budget of 0.00%" in job.error
    assert job.artifact.state == common_pb2.ARTIFACT_STATE_FAILED and job.artifact.failure_reason == job.error
    evaluation = job.artifact.evaluation
    assert evaluation.perplexity_quantized > evaluation.perplexity_fp16 > 1
    assert f"{evaluation.perplexity_quantized:.4f}" in job.error and f"{evaluation.perplexity_fp16:.4f}" in job.error
    with open_registry(registry_url).sessions() as session:
        assert [a.state for a in list_artifacts(session)] == [ArtifactState.FAILED]
    assert moto.keys(bucket_store.bucket) == []
    assert "JOB_STAGE_UPLOAD" not in _stages(updates)


@pytest.mark.parametrize("fmt", ["fp16", "w8a8"])
def test_other_formats_publish_to_their_own_binding(bucket_store, start_quantizer, registry_url, small_model,
                                                    request_for, fmt):
    quantizer = start_quantizer(bucket_store, registry_url)
    job, _ = quantizer.publish(request_for(small_model, format=fmt, gpu_target="sm90"))
    assert job.state == Q.JOB_STATE_SUCCEEDED, job.error
    assert (job.artifact.format, job.artifact.gpu_target) == (fmt, "sm90")
    assert f"/{fmt}/sm90/" in job.artifact.object_key_prefix
    if fmt == "fp16":
        assert job.artifact.evaluation.perplexity_quantized == job.artifact.evaluation.perplexity_fp16


def test_local_folder_store(tmp_path, start_quantizer, registry_url, small_model, request_for):
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url, create_bucket=True)
    job, _ = quantizer.publish(request_for(small_model))
    assert job.state == Q.JOB_STATE_SUCCEEDED, job.error
    assert (tmp_path / "objects" / job.artifact.object_key_prefix / "manifest.json").is_file()



def test_fp16_perplexity_measured_while_quantizing_then_cached(bucket_store, start_quantizer, registry_url,
                                                               small_model, request_for):
    quantizer = start_quantizer(bucket_store, registry_url, overlap_eval=True)
    first, updates = quantizer.publish(request_for(small_model))
    assert first.state == Q.JOB_STATE_SUCCEEDED, first.error
    assert any("(measured while quantizing)" in u.message for u in updates)

    other, updates = quantizer.publish(request_for(small_model, format="w4a8kv4-chn"))
    assert other.state == Q.JOB_STATE_SUCCEEDED, other.error
    assert any(f"fp16 perplexity {first.artifact.evaluation.perplexity_fp16:.4f} (cached)" in u.message
               for u in updates)
    assert other.artifact.evaluation.perplexity_fp16 == first.artifact.evaluation.perplexity_fp16


def test_a_calibration_text_shorter_than_asked_says_how_many_windows_it_gave(bucket_store, start_quantizer,
                                                                              registry_url, small_model,
                                                                              request_for, tmp_path):
    """--calib-samples 64 on a short text calibrated on the few windows it held, said nowhere but the manifest."""
    short = tmp_path / "short.txt"
    short.write_text("def f(x):\n    return x + 1\n" * 40)
    quantizer = start_quantizer(bucket_store, registry_url)
    job, updates = quantizer.publish(request_for(small_model, calibration=Q.Calibration(
        data=str(short), num_samples=64, seq_len=32)))
    assert job.state == Q.JOB_STATE_SUCCEEDED, job.error
    said = [u.message for u in updates if "asked: the calibration text holds no more" in u.message]
    assert len(said) == 1 and "not the 64 asked" in said[0], [u.message for u in updates]


def test_a_calibration_text_too_short_fails_the_job(bucket_store, start_quantizer, registry_url, small_model,
                                                    request_for, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    quantizer = start_quantizer(bucket_store, registry_url, overlap_eval=True)
    job, _ = quantizer.publish(request_for(small_model, calibration=Q.Calibration(data=str(short), seq_len=64)))
    assert job.state == Q.JOB_STATE_FAILED
    assert job.error.startswith("calibrate failed: calibration text short.txt has ")
    assert "fewer than one window of seq_len=64" in job.error
    assert job.artifact.state == common_pb2.ARTIFACT_STATE_FAILED


def test_a_register_error_after_the_commit_keeps_the_ready_artifacts_objects(tmp_path, start_quantizer, registry_url,
                                                                            open_registry, small_model, request_for,
                                                                            monkeypatch):
    # The database committed the READY record but the client saw an error (the connection dropped after
    # COMMIT was sent): the artifact is READY in the registry, so its objects must not be deleted.
    from contextlib import contextmanager

    from sqlalchemy.exc import OperationalError

    from services.quantizer import pipeline as pipeline_module

    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url, create_bucket=True)
    registry = quantizer.server.running.runner.services.registry
    real_transaction, real_ready = registry.transaction, pipeline_module.mark_artifact_ready
    state = {"armed": False, "fired": False}

    def ready(*args, **kwargs):
        state["armed"] = True
        return real_ready(*args, **kwargs)

    @contextmanager
    def acknowledgement_lost():
        with real_transaction() as session:
            yield session
        if state["armed"] and not state["fired"]:
            state["fired"] = True
            raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(pipeline_module, "mark_artifact_ready", ready)
    monkeypatch.setattr(registry, "transaction", acknowledgement_lost)
    job, _ = quantizer.publish(request_for(small_model))
    monkeypatch.undo()

    assert state["fired"]
    with open_registry(registry_url).sessions() as session:
        artifact = get_artifact(session, job.artifact.artifact_id)
        assert artifact.state == ArtifactState.READY
        assert get_job(session, job.job_id).state == JobState.SUCCEEDED
    ArtifactReader(tmp_path / "objects" / artifact.object_prefix)  # every file there, every sha256 right


def test_a_job_counts_the_disk_that_other_jobs_sharing_the_work_dir_have_claimed(bucket_store, start_quantizer,
                                                                                  registry_url, small_model,
                                                                                  request_for, monkeypatch):
    """Two jobs that each fit the disk alone but not together: the second is refused before any work rather
    than both failing on ENOSPC (another quantizer sharing --work-dir holds a claim here)."""
    from services.quantizer.pipeline import DISK_CLAIMS_DIR
    from shared.disk_space import SharedSpace

    monkeypatch.setattr("shared.disk_space.free_bytes", lambda path: 1 << 30)
    quantizer = start_quantizer(bucket_store, registry_url)
    claims = quantizer.config.work_dir / DISK_CLAIMS_DIR
    other = SharedSpace(claims, quantizer.config.work_dir / "jobs" / "another-quantizers-job")
    assert other.shortage(quantizer.config.work_dir, (1 << 30) - (1 << 20), "a 70B artifact") is None
    job, _ = quantizer.publish(request_for(small_model))
    assert job.state == Q.JOB_STATE_FAILED
    assert "not enough disk space for the w4a8kv4-g128 artifact" in job.error
    assert "is claimed by 1 other job(s) still writing" in job.error
    other.release()
    job, _ = quantizer.publish(request_for(small_model))
    assert job.state == Q.JOB_STATE_SUCCEEDED, job.error
    # Each job's claim ends with it: released by the job's thread just after it marks the job ended (which ends
    # the publish call), so it is waited for.
    deadline = time.monotonic() + 5.0
    while list(claims.glob("*.claim")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(claims.glob("*.claim")) == []


def test_the_time_left_is_estimated_from_the_blocks_alone(tmp_path, start_quantizer, registry_url, small_model,
                                                          request_for, monkeypatch):
    """The clock started before the calibration text and the checkpoint's content hash (minutes for a 70B model):
    counted as block time, the first estimates were far too long. Here loading takes 100 s on a fake clock and a
    block 1 s: with 1 of 2 blocks done, 1 s is left, not 101."""
    from types import SimpleNamespace

    from services.quantizer import pipeline

    clock = [1000.0]
    monkeypatch.setattr(pipeline, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # the pipeline's clock only

    def quantize(settings, progress):
        progress("load", 0, 1)
        clock[0] += 100.0
        progress("load", 1, 1)
        clock[0] += 1.0
        progress("quantize", 1, 2)
        raise ValueError("stopped here by the test")

    monkeypatch.setattr(pipeline, "quantize_checkpoint", quantize)
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True)
    updates = quantizer.follow(quantizer.stub.Publish(request_for(small_model)).job_id)
    estimates = [u.job.estimated_remaining.ToTimedelta().total_seconds() for u in updates
                 if u.job.HasField("estimated_remaining")]
    assert estimates == [1.0], [(u.job.state, u.message) for u in updates]

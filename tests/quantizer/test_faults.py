"""Faults: S3 going away mid-upload, a killed quantizer, broken checkpoints, missing buckets, stopping."""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import timedelta

import pytest

from shared.model.checkpoint import HfCheckpoint
from shared.registry import (
    ArtifactState,
    JobState,
    create_job,
    get_artifact,
    get_job,
    heartbeat,
    list_artifacts,
    mark_artifact_failed,
    register_model_version,
    reserve_artifact,
    retry_artifact,
    start_job,
)
from shared.registry.models import utcnow
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2
from shared.storage import StorageConfig, StorageError, open_store
from shared.storage.s3 import S3Store
from tests.quantizer.conftest import Quantizer, s3_config

Q = quantizer_pb2


def test_s3_stopping_mid_upload_fails_the_job_and_a_retry_succeeds(own_moto, start_quantizer, registry_url,
                                                                   open_registry, small_model, request_for,
                                                                   monkeypatch):
    server = own_moto()
    store = s3_config(server.endpoint)
    open_store(store, create=True)
    quantizer = start_quantizer(store, registry_url)
    uploaded = []
    put_file = S3Store.put_file

    def put_then_stop_the_server(self, local_path, key):
        info = put_file(self, local_path, key)
        uploaded.append(key)
        if len(uploaded) == 2:
            server.stop()
        return info

    monkeypatch.setattr(S3Store, "put_file", put_then_stop_the_server)
    job, _ = quantizer.publish(request_for(small_model))
    monkeypatch.undo()

    assert job.state == Q.JOB_STATE_FAILED
    assert job.error.startswith("upload failed: publish of ")
    assert f"cannot reach S3 endpoint {server.endpoint}" in job.error
    assert job.artifact.state == common_pb2.ARTIFACT_STATE_FAILED
    with open_registry(registry_url).sessions() as session:
        assert [a.state for a in list_artifacts(session)] == [ArtifactState.FAILED]

    restarted = own_moto(server.port)  # moto keeps its state: what the stopped server held
    left = restarted.keys(store.bucket)
    # Nothing under the artifact's prefix: staged objects, and the publish's claim on the prefix (its release
    # failed with the store), which a retry in this process takes over at once, not after CLAIM_STALE_AFTER_S.
    claims = [key for key in left if key.startswith("_claims/")]
    assert len(claims) == 1 and all(key.startswith("_staging/") for key in set(left) - set(claims))

    retry, _ = quantizer.publish(request_for(small_model))
    assert retry.state == Q.JOB_STATE_SUCCEEDED, retry.error
    assert retry.artifact.artifact_id == job.artifact.artifact_id  # the binding's artifact, retried
    assert open_store(store).purge_staging(older_than_s=0) == len(left) - 1
    keys = restarted.keys(store.bucket)
    assert keys and all(key.startswith(retry.artifact.object_key_prefix) for key in keys)


def test_jobs_of_a_killed_quantizer_fail_when_the_service_starts(any_registry_url, open_registry, bucket_store,
                                                                 start_quantizer, small_model, request_for):
    registry = open_registry(any_registry_url)
    dead, alive = "quantizer@gone:4242:deadbeef", "quantizer@other:7:cafe"
    with registry.transaction() as session:
        version = register_model_version(session, "rand", HfCheckpoint(small_model).content_hash())
        artifact = reserve_artifact(session, version.id, "w4a8kv4-g128", "cpu").artifact
        orphan = create_job(session, owner=dead, artifact_id=artifact.id)
        start_job(session, orphan.id, owner=dead)
        live = create_job(session, owner=alive)
        start_job(session, live.id, owner=alive)
        orphan_id, live_id, artifact_id, prefix = orphan.id, live.id, artifact.id, artifact.object_prefix
    with registry.transaction() as session:
        heartbeat(session, dead, now=utcnow() - timedelta(minutes=5))  # it died five minutes ago
    store = open_store(bucket_store)
    # killed while its publish moved objects to the final prefix: two weight files there, no manifest yet
    left = [store.put_bytes(b"w" * 100, f"{prefix}weights/{name}").key for name in ("a.bin", "b.bin")]
    other = store.put_bytes(b"x", "elsewhere/kept.bin").key

    quantizer = start_quantizer(bucket_store, any_registry_url)

    failed = quantizer.stub.GetJob(Q.GetJobRequest(job_id=orphan_id))
    assert failed.state == Q.JOB_STATE_FAILED
    assert "stopped (killed or crashed)" in failed.error and dead in failed.error
    assert failed.artifact.state == common_pb2.ARTIFACT_STATE_FAILED
    with registry.sessions() as session:
        assert get_job(session, live_id).state == JobState.RUNNING  # another quantizer that still heartbeats
        assert get_artifact(session, artifact_id).state == ArtifactState.FAILED
    assert not any(store.exists(key) for key in left)  # deleted with its job failed: no retry may ever come
    assert store.exists(other)

    job, _ = quantizer.publish(request_for(small_model))  # the binding can be published again
    assert job.state == Q.JOB_STATE_SUCCEEDED, job.error
    assert job.artifact.artifact_id == artifact_id


def test_an_orphans_objects_are_kept_once_its_artifact_is_retried(bucket_store, start_quantizer, registry_url,
                                                                   open_registry, small_model):
    """The deletion of what an orphaned job left runs under the artifact's lock and only while it is FAILED:
    a retry that took the artifact first has its job clear the prefix, and may be writing there already."""
    quantizer = start_quantizer(bucket_store, registry_url)
    runner, store = quantizer.server.running.runner, open_store(bucket_store)
    registry = open_registry(registry_url)
    with registry.transaction() as session:
        version = register_model_version(session, "rand", HfCheckpoint(small_model).content_hash())
        artifact = reserve_artifact(session, version.id, "w4a8kv4-g128", "cpu").artifact
        artifact_id, prefix = artifact.id, artifact.object_prefix
    key = store.put_bytes(b"w", f"{prefix}weights/a.bin").key

    runner._delete_orphaned_objects(artifact_id)  # PENDING: a job holds it
    assert store.exists(key)
    with registry.transaction() as session:
        mark_artifact_failed(session, artifact_id, "orphaned")
        retry_artifact(session, artifact_id)
    runner._delete_orphaned_objects(artifact_id)  # retried before the sweep's deletion ran
    assert store.exists(key)
    with registry.transaction() as session:
        mark_artifact_failed(session, artifact_id, "orphaned again")
    runner._delete_orphaned_objects(artifact_id)
    assert not store.exists(key)


def test_a_corrupt_checkpoint_fails_the_job_naming_the_file(bucket_store, start_quantizer, registry_url, small_model,
                                                            request_for):
    (small_model / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 100)
    quantizer = start_quantizer(bucket_store, registry_url)
    job, _ = quantizer.publish(request_for(small_model))
    assert job.state == Q.JOB_STATE_FAILED
    assert job.error.startswith("load failed: ")
    assert "model.safetensors is not a readable safetensors file" in job.error
    assert not job.HasField("artifact")


def test_a_checkpoint_file_whose_name_is_not_utf8_fails_the_job_naming_it(bucket_store, start_quantizer, registry_url,
                                                                           small_model, request_for):
    # Its name reaches the error as a lone surrogate, which no registry can store: the failure was never
    # recorded, and the job stayed RUNNING (retried every heartbeat) with its watchers waiting for ever.
    with open(os.fsencode(small_model) + b"/extra-\xff.safetensors", "wb") as shard:
        shard.write(b"not a safetensors file")
    quantizer = start_quantizer(bucket_store, registry_url)
    job = quantizer.follow(quantizer.stub.Publish(request_for(small_model)).job_id, timeout_s=60)[-1].job
    assert job.state == Q.JOB_STATE_FAILED
    assert "extra-\\udcff.safetensors" in job.error


def test_a_checkpoint_missing_tensors_fails_the_job(bucket_store, start_quantizer, registry_url, small_model,
                                                    request_for):
    config = json.loads((small_model / "config.json").read_text())
    config["num_hidden_layers"] = 3  # the weights hold 2
    (small_model / "config.json").write_text(json.dumps(config))
    quantizer = start_quantizer(bucket_store, registry_url)
    job, _ = quantizer.publish(request_for(small_model))
    assert job.state == Q.JOB_STATE_FAILED
    assert "lacks tensors model.layers.2." in job.error


def test_a_store_bucket_that_does_not_exist_stops_the_start(moto, registry_url, tmp_path):
    from services.quantizer.config import QuantizerConfig

    config = QuantizerConfig(registry_url=registry_url, store=s3_config(moto.endpoint, "no-such-bucket"),
                             work_dir=tmp_path / "work", listen="127.0.0.1:0")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist at endpoint"):
        Quantizer(config)


def test_a_source_or_store_bucket_that_does_not_exist_fails_the_job(moto, bucket_store, start_quantizer, registry_url,
                                                                    small_model, request_for):
    quantizer = start_quantizer(bucket_store, registry_url)
    job, _ = quantizer.publish(request_for("s3://missing-checkpoints/llamas/rand"))
    assert job.state == Q.JOB_STATE_FAILED
    assert job.error.startswith("load failed: ") and "bucket 'missing-checkpoints' does not exist" in job.error

    moto.client().delete_bucket(Bucket=bucket_store.bucket)
    job, _ = quantizer.publish(request_for(small_model))
    assert job.state == Q.JOB_STATE_FAILED
    assert job.error.startswith("upload failed: ") and f"bucket {bucket_store.bucket!r} does not exist" in job.error
    assert job.artifact.state == common_pb2.ARTIFACT_STATE_FAILED


def test_stopping_the_quantizer_fails_its_jobs(bucket_store, start_quantizer, registry_url, open_registry,
                                               small_model, request_for, tmp_path):
    second = tmp_path / "second-llama"
    shutil.copytree(small_model, second)
    quantizer = start_quantizer(bucket_store, registry_url)
    first = quantizer.stub.Publish(request_for(small_model))
    queued = quantizer.stub.Publish(request_for(second, model_name="second"))
    quantizer.stop()
    with open_registry(registry_url).sessions() as session:
        for job_id in (first.job_id, queued.job_id):
            job = get_job(session, job_id)
            assert job.state in (JobState.FAILED, JobState.SUCCEEDED)  # the first may finish before the stop
        job = get_job(session, queued.job_id)
        assert job.state == JobState.FAILED and "the quantizer stopped before the job ran" in job.error
        assert all(a.state != ArtifactState.PENDING for a in list_artifacts(session))


def test_a_publish_whose_job_row_did_not_commit_takes_no_queue_slot(bucket_store, start_quantizer, registry_url,
                                                                    small_model, request_for, monkeypatch):
    import grpc
    from contextlib import contextmanager

    from sqlalchemy.exc import OperationalError

    quantizer = start_quantizer(bucket_store, registry_url, workers=1, max_queued=1)
    registry = quantizer.server.running.runner.services.registry

    @contextmanager
    def commit_fails():  # the database goes away as the transaction commits: nothing was written
        session = registry.writes()
        try:
            with session.begin():
                yield session
                raise OperationalError("COMMIT", {}, Exception("server closed the connection unexpectedly"))
        finally:
            session.close()

    monkeypatch.setattr(registry, "transaction", commit_fails)
    for _ in range(2):  # as many as the queue limit (1 running + 1 queued)
        with pytest.raises(grpc.RpcError) as raised:
            quantizer.stub.Publish(request_for(small_model))
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    monkeypatch.undo()

    job = quantizer.stub.Publish(request_for(small_model))  # the database is back: the queue is empty
    assert job.state in (Q.JOB_STATE_QUEUED, Q.JOB_STATE_RUNNING)


def _running_jobs_beat(registry, job_id: str):
    """Waits until the job runs; -> a function reading its (state, heartbeat_at)."""

    def beat():
        with registry.sessions() as session:
            job = get_job(session, job_id)
            return job.state, job.heartbeat_at

    deadline = time.monotonic() + 10
    while beat()[0] != JobState.RUNNING:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return beat


def test_a_stopping_quantizer_heartbeats_its_jobs_until_they_have_ended(bucket_store, start_quantizer, registry_url,
                                                                       open_registry, small_model, request_for,
                                                                       monkeypatch):
    """A job winding down after stop() still belongs to this quantizer: were its heartbeats to end first,
    another quantizer could fail it as an orphan and retry its artifact while it still runs."""
    import threading

    from services.quantizer.pipeline import Pipeline

    release = threading.Event()

    def slow_to_stop(self, finish):  # a job in a long step that reaches its next cancellation check late
        release.wait(10)
        self.reporter.check()

    monkeypatch.setattr(Pipeline, "run", slow_to_stop)
    quantizer = start_quantizer(bucket_store, registry_url, heartbeat_s=0.05, orphan_after_s=0.5)
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    beat = _running_jobs_beat(open_registry(registry_url), job_id)
    stopping = threading.Thread(target=quantizer.stop)
    stopping.start()
    time.sleep(0.2)
    _, first = beat()
    time.sleep(0.3)
    state, later = beat()
    release.set()
    stopping.join(30)
    assert state == JobState.RUNNING and later > first, "no heartbeat while the job was winding down"
    assert beat()[0] == JobState.FAILED


def test_heartbeats_go_on_while_what_an_orphan_left_is_deleted(bucket_store, start_quantizer, registry_url,
                                                              open_registry, small_model, request_for, monkeypatch):
    """Deleting what an orphaned job left can take minutes (an object store retrying): it ran on the heartbeat
    thread, so this quantizer's live jobs went unheard meanwhile and another quantizer's sweep failed them as
    orphans in turn. Orphans are swept on a thread of their own."""
    import threading

    from services.quantizer.pipeline import Pipeline

    release = threading.Event()
    monkeypatch.setattr(Pipeline, "run", lambda self, finish: (release.wait(10), self.reporter.check()))
    quantizer = start_quantizer(bucket_store, registry_url, heartbeat_s=0.05, orphan_after_s=0.5)
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    beat = _running_jobs_beat(open_registry(registry_url), job_id)
    runner = quantizer.server.running.runner
    monkeypatch.setattr(runner, "_sweep_orphans", lambda: time.sleep(1.5) or [])  # a slow store's deletion
    time.sleep(0.2)
    _, first = beat()
    time.sleep(0.5)
    _, later = beat()
    release.set()
    assert later > first, "no heartbeat while orphans were being swept"


def test_an_orphan_time_within_one_heartbeat_is_refused(registry_url, tmp_path):
    from services.quantizer.config import ConfigError, QuantizerConfig

    with pytest.raises(ConfigError, match="orphan_after_s"):
        QuantizerConfig(registry_url=registry_url, store=s3_config("http://127.0.0.1:1", "any-bucket"), work_dir=tmp_path,
                        heartbeat_s=10.0, orphan_after_s=5.0)


def test_a_running_quantizer_purges_stale_staging_now_and_then(tmp_path, start_quantizer, registry_url, monkeypatch):
    """Only a start purged it: a quantizer restarted at once after a kill mid-upload found that staging too young,
    and kept it until a start an hour later at least, which might never come."""
    from services.quantizer import leftovers

    monkeypatch.setattr(leftovers, "STAGING_MAX_AGE_S", 0.0)  # anything not written since the last second
    monkeypatch.setattr(leftovers, "PURGE_INTERVAL_S", 0.2)
    store_config = StorageConfig(kind="local", root=tmp_path / "objects")
    start_quantizer(store_config, registry_url, create_bucket=True, heartbeat_s=0.2)
    store = open_store(store_config)
    stale = store.put_bytes(b"x", "_staging/1000-killed/weights.safetensors").key  # after the start's purge
    deadline = time.monotonic() + 20
    while store.exists(stale):
        assert time.monotonic() < deadline, "never purged while running"
        time.sleep(0.1)

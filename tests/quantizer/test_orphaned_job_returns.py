"""A job failed as an orphan while its quantizer was cut off from the registry, which then comes back:
by then another job may be retrying the same artifact, and the returning job must not touch it; if none
does, what the returning job published is deleted. And deleting what an orphan left holds no registry lock."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

from services.quantizer.pipeline import Pipeline
from services.quantizer.views import Stage
from shared.registry import (
    ArtifactState,
    JobState,
    create_job,
    fail_orphaned_jobs,
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
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import StorageConfig

OTHER = "quantizer@other:1:cafe"


def test_a_returning_orphan_leaves_the_artifact_another_job_retries(tmp_path, start_quantizer, registry_url,
                                                                    open_registry, small_model, request_for,
                                                                    monkeypatch):
    entered, release = threading.Event(), threading.Event()

    def long_step_without_the_registry(self, *args):
        entered.set()
        release.wait(20)
        self.reporter.progress(Stage.QUANTIZE, 1, 2)  # back: the registry says the job is FAILED
        raise AssertionError("unreachable: the progress report above raises")

    monkeypatch.setattr(Pipeline, "_quantize_and_fp16_eval", long_step_without_the_registry)
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True)
    runner = quantizer.server.running.runner
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    assert entered.wait(30)

    registry = open_registry(registry_url)
    with registry.transaction() as session:  # another quantizer: the job looks orphaned, it is failed...
        assert [job.id for job in fail_orphaned_jobs(session, "gone", current_owner=OTHER,
                                                     stale_after=timedelta(0))] == [job_id]
        [artifact] = list_artifacts(session)
        assert artifact.state == ArtifactState.FAILED
        retry_artifact(session, artifact.id, actor=OTHER)  # ...and a new job there retries the binding
        retry = create_job(session, owner=OTHER, artifact_id=artifact.id)
        start_job(session, retry.id, owner=OTHER)
        artifact_id, retry_id = artifact.id, retry.id

    release.set()
    deadline = time.monotonic() + 30
    while runner._live:  # the returning job winds down
        assert time.monotonic() < deadline
        time.sleep(0.05)

    with registry.sessions() as session:
        assert get_job(session, job_id).state == JobState.FAILED
        assert get_job(session, retry_id).state == JobState.RUNNING
        artifact = get_artifact(session, artifact_id)
        assert artifact.state == ArtifactState.PENDING, artifact.failure_reason


def test_a_returning_orphan_does_not_delete_what_the_retrying_job_published(tmp_path, start_quantizer, registry_url,
                                                                             open_registry, small_model, request_for,
                                                                             monkeypatch):
    from services.quantizer.jobs import JobRunner

    store_config = StorageConfig(kind="local", root=tmp_path / "objects")
    quantizer = start_quantizer(store_config, registry_url, create_bucket=True)
    runner = quantizer.server.running.runner
    store = runner.services.store
    registry = open_registry(registry_url)
    real_progress = JobRunner._progress
    theirs = tmp_path / "retry-artifact"
    theirs.mkdir()
    (theirs / "manifest.json").write_text("{}")
    published = []

    def cut_off_just_before_register(self, job_id, stage, *args):
        real_progress(self, job_id, stage, *args)
        if stage is not Stage.REGISTER:
            return
        # The job's quantizer loses the registry here; meanwhile another quantizer fails the job as an
        # orphan, retries its artifact and publishes it to the same prefix, and is about to mark it READY.
        with registry.transaction() as session:
            fail_orphaned_jobs(session, "gone", current_owner=OTHER, stale_after=timedelta(0))
            [artifact] = list_artifacts(session)
            retry_artifact(session, artifact.id, actor=OTHER)
            start_job(session, create_job(session, owner=OTHER, artifact_id=artifact.id).id, owner=OTHER)
            prefix = artifact.object_prefix
        store.delete_prefix(prefix)
        published.extend(info.key for info in store.publish_folder(theirs, prefix))

    monkeypatch.setattr(JobRunner, "_progress", cut_off_just_before_register)
    job, _ = quantizer.publish(request_for(small_model))

    assert job.state == quantizer_pb2.JOB_STATE_FAILED
    with registry.sessions() as session:
        [artifact] = list_artifacts(session)
        assert artifact.state == ArtifactState.PENDING, artifact.failure_reason
        prefix = artifact.object_prefix
    assert published and [info.key for info in store.list(prefix)] == published


def test_a_returning_orphan_deletes_what_it_published_when_no_job_retries(tmp_path, start_quantizer, registry_url,
                                                                           open_registry, small_model, request_for,
                                                                           monkeypatch):
    """The sweep that failed it deleted what was under the prefix then; the job, cut off but alive, went on to
    publish a whole artifact (manifest included: a worker without a registry finds it) behind a FAILED artifact,
    and kept it: its failed register deleted nothing, as the job no longer held the artifact."""
    from services.quantizer.jobs import JobRunner

    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True)
    store = quantizer.server.running.runner.services.store
    registry = open_registry(registry_url)
    real_progress = JobRunner._progress

    def failed_as_an_orphan_before_register(self, job_id, stage, *args):
        real_progress(self, job_id, stage, *args)
        if stage is Stage.REGISTER:
            with registry.transaction() as session:
                fail_orphaned_jobs(session, "gone", current_owner=OTHER, stale_after=timedelta(0))

    monkeypatch.setattr(JobRunner, "_progress", failed_as_an_orphan_before_register)
    job, _ = quantizer.publish(request_for(small_model))

    assert job.state == quantizer_pb2.JOB_STATE_FAILED
    with registry.sessions() as session:
        [artifact] = list_artifacts(session)
        assert artifact.state == ArtifactState.FAILED
        prefix = artifact.object_prefix
    assert store.list(prefix) == []
    assert store.list("_claims/") == []


def _an_orphans_leftover(tmp_path, start_quantizer, registry_url, open_registry, **config):
    """A quantizer, and a FAILED artifact with an object its orphaned job left: (runner, registry, id, key)."""
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True, **config)
    runner = quantizer.server.running.runner
    registry = open_registry(registry_url)
    with registry.transaction() as session:
        version = register_model_version(session, "rand", "f" * 64)
        artifact = reserve_artifact(session, version.id, "w4a8kv4-g128", "cpu").artifact
        mark_artifact_failed(session, artifact.id, "orphaned")
        artifact_id, prefix = artifact.id, artifact.object_prefix
    return runner, registry, artifact_id, runner.services.store.put_bytes(b"w", f"{prefix}weights/a.bin").key


def test_deleting_what_an_orphan_left_holds_no_registry_lock(tmp_path, start_quantizer, any_registry_url,
                                                             open_registry, monkeypatch):
    """It ran inside a transaction holding the artifact's row lock (on SQLite the whole registry's write lock)
    for as long as the store took: heartbeats, progress reports and a new claim of the artifact waited, and
    past the lock bound (30 s) healthy jobs failed."""
    runner, registry, artifact_id, key = _an_orphans_leftover(tmp_path, start_quantizer, any_registry_url,
                                                              open_registry)
    store = runner.services.store
    deleting, finish = threading.Event(), threading.Event()
    delete_prefix = store.delete_prefix

    def slow_store(prefix):  # botocore retrying: up to max_attempts x read_timeout_s
        deleting.set()
        finish.wait(20)
        return delete_prefix(prefix)

    monkeypatch.setattr(store, "delete_prefix", slow_store)
    deletion = threading.Thread(target=runner._delete_orphaned_objects, args=(artifact_id,))
    deletion.start()
    try:
        assert deleting.wait(10)
        started = time.monotonic()
        with registry.transaction(lock_wait_s=2.0) as session:
            get_artifact(session, artifact_id, for_update=True)
            heartbeat(session, OTHER)
        waited = time.monotonic() - started
    finally:
        finish.set()
        deletion.join(20)
    assert waited < 1.0
    assert not store.exists(key)


def test_what_a_killed_publish_left_is_deleted_once_its_claim_is_stale(tmp_path, start_quantizer, registry_url,
                                                                       open_registry, monkeypatch):
    """The sweep finds the prefix still claimed by the killed publish (its claim not stale yet): the deletion is
    tried again every housekeeping round, not dropped (its job FAILED, no later sweep would come back to it)."""
    from shared.storage import claims

    runner, _registry, artifact_id, key = _an_orphans_leftover(tmp_path, start_quantizer, registry_url, open_registry,
                                                               heartbeat_s=0.2)
    store = runner.services.store
    prefix = key.rsplit("/", 2)[0] + "/"  # the artifact's: key is <prefix>weights/a.bin
    killed = {"attempt": "1-killed", "process": "gone", "host": "gone", "pid": 1, "at": time.time()}
    store.put_bytes(json.dumps(killed).encode(), claims.claim_key(prefix, 1))

    runner._delete_orphaned_objects(artifact_id)
    assert store.exists(key)  # claimed: left for now
    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 0.0)  # ... until the claim is stale
    deadline = time.monotonic() + 20
    while store.exists(key):
        assert time.monotonic() < deadline, "never deleted"
        time.sleep(0.1)
    assert store.list("") == []


@pytest.mark.parametrize("killed", ["moving", "uploading"])  # objects under the prefix, or only in staging
def test_a_retry_waits_for_the_claim_a_killed_publish_left(tmp_path, start_quantizer, registry_url, open_registry,
                                                           small_model, request_for, monkeypatch, killed):
    """A quantizer killed mid-publish and restarted at once fails its own jobs at start: a retry seconds later
    found the prefix still claimed by the killed publish and failed; it waits for the claim to go stale."""
    from services.quantizer import pipeline
    from services.quantizer.jobs import JobRunner
    from shared.model.checkpoint import HfCheckpoint
    from shared.storage import claims

    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 2.0)
    monkeypatch.setattr(pipeline, "CLEAR_POLL_S", 0.2)
    quantizer = start_quantizer(StorageConfig(kind="local", root=tmp_path / "objects"), registry_url,
                                create_bucket=True)
    store = quantizer.server.running.runner.services.store
    with open_registry(registry_url).transaction() as session:
        version = register_model_version(session, "rand", HfCheckpoint(small_model).content_hash())
        artifact = reserve_artifact(session, version.id, "w4a8kv4-g128", "cpu").artifact
        mark_artifact_failed(session, artifact.id, "its quantizer was killed")
        prefix = artifact.object_prefix
    if killed == "moving":
        store.put_bytes(b"half", f"{prefix}weights/block_000.safetensors")
    real_progress, claimed = JobRunner._progress, []

    def killed_just_now(self, job_id, stage, *args):  # the killed publish's claim, 0 s old when the upload starts
        if stage is Stage.UPLOAD and not claimed:
            record = {"attempt": "1-killed", "process": "gone", "host": "gone", "pid": 1, "at": time.time()}
            store.put_bytes(json.dumps(record).encode(), claims.claim_key(prefix, 1))
            claimed.append(True)
        real_progress(self, job_id, stage, *args)

    monkeypatch.setattr(JobRunner, "_progress", killed_just_now)
    job, updates = quantizer.publish(request_for(small_model))
    assert job.state == quantizer_pb2.JOB_STATE_SUCCEEDED, job.error
    assert job.artifact.object_key_prefix == prefix
    assert any("waiting for the artifact's prefix" in update.message for update in updates)

"""A job failed as an orphan while its quantizer was cut off from the registry, which then comes back:
by then another job may be retrying the same artifact, and the returning job must not touch it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from services.quantizer.pipeline import Pipeline
from services.quantizer.views import Stage
from shared.registry import (
    ArtifactState,
    JobState,
    create_job,
    fail_orphaned_jobs,
    get_artifact,
    get_job,
    list_artifacts,
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

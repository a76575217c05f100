"""Stopping a quantizer (stop() / SIGTERM) while a job is past its upload: the artifact ends FAILED
and its objects do not stay behind in the store, where a worker without a registry finds an artifact
by its manifest."""

from __future__ import annotations

import threading
import time

from services.quantizer.pipeline import Pipeline
from shared.registry import ArtifactState, JobState, get_artifact, get_job, list_artifacts
from shared.storage import StorageConfig, open_store


def test_a_stop_between_upload_and_register_leaves_no_objects(tmp_path, start_quantizer, registry_url, open_registry,
                                                              small_model, request_for, monkeypatch):
    store_config = StorageConfig(kind="local", root=tmp_path / "objects")
    quantizer = start_quantizer(store_config, registry_url, create_bucket=True)
    runner = quantizer.server.running.runner
    real_register = Pipeline._register
    stopping = threading.Thread(target=quantizer.stop, daemon=True)

    def stop_arrives_after_the_upload(self, *args):
        stopping.start()
        deadline = time.monotonic() + 10
        while not runner._stopping.is_set():  # the stop has begun: the job's next check cancels it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return real_register(self, *args)

    monkeypatch.setattr(Pipeline, "_register", stop_arrives_after_the_upload)
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    deadline = time.monotonic() + 60
    while not stopping.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    stopping.join(60)  # stop() returns once every job has ended
    assert not stopping.is_alive()

    with open_registry(registry_url).sessions() as session:
        job = get_job(session, job_id)
        assert job.state == JobState.FAILED and "stopping" in job.error
        [artifact] = list_artifacts(session)
        assert artifact.state == ArtifactState.FAILED
        prefix = get_artifact(session, artifact.id).object_prefix
    assert open_store(store_config).list(prefix) == []


def test_a_stop_mid_upload_to_s3_leaves_no_objects(moto, bucket_store, start_quantizer, registry_url, open_registry,
                                                    small_model, request_for, monkeypatch):
    from shared.storage.s3 import S3Store

    quantizer = start_quantizer(bucket_store, registry_url)
    runner = quantizer.server.running.runner
    stopping = threading.Thread(target=quantizer.stop, daemon=True)
    real_put = S3Store.put_file
    puts = []

    def stop_arrives_after_the_second_put(self, local_path, key):
        info = real_put(self, local_path, key)
        puts.append(key)
        if len(puts) == 2:
            stopping.start()
            while not runner._stopping.is_set():
                time.sleep(0.01)
        return info

    monkeypatch.setattr(S3Store, "put_file", stop_arrives_after_the_second_put)
    job_id = quantizer.stub.Publish(request_for(small_model)).job_id
    deadline = time.monotonic() + 60
    while not stopping.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    stopping.join(60)
    assert not stopping.is_alive() and len(puts) == 2

    with open_registry(registry_url).sessions() as session:
        job = get_job(session, job_id)
        assert job.state == JobState.FAILED and job.error.startswith("upload failed: ") and "stopping" in job.error
        assert [a.state for a in list_artifacts(session)] == [ArtifactState.FAILED]
    assert moto.keys(bucket_store.bucket) == []  # staged objects deleted too

"""Two quantizers sharing one registry and one store: the same binding published on both at once
makes one artifact, and each quantizer's WatchJob follows the other's job to its end."""

from __future__ import annotations

import threading

from shared.registry import list_artifacts
from shared.rpc.qserve.v1 import common_pb2, quantizer_pb2

Q = quantizer_pb2


def test_one_binding_published_on_two_quantizers_at_once(moto, bucket_store, start_quantizer, any_registry_url,
                                                          open_registry, small_model, request_for):
    first = start_quantizer(bucket_store, any_registry_url)
    second = start_quantizer(bucket_store, any_registry_url)
    request = request_for(small_model)
    jobs = {first: first.stub.Publish(request).job_id, second: second.stub.Publish(request).job_id}
    finals: dict[str, Q.Job] = {}

    def follow_through(watcher, job_id: str) -> None:  # the quantizer that does not run the job
        finals[job_id] = list(watcher.stub.WatchJob(Q.WatchJobRequest(job_id=job_id), timeout=60))[-1].job

    threads = [threading.Thread(target=follow_through, args=(second, jobs[first])),
               threading.Thread(target=follow_through, args=(first, jobs[second]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(70)

    assert [finals[job_id].state for job_id in jobs.values()] == [Q.JOB_STATE_SUCCEEDED] * 2, \
        [finals[job_id].error for job_id in jobs.values()]
    [artifact_id] = {finals[job_id].artifact.artifact_id for job_id in jobs.values()}
    assert {finals[job_id].artifact.state for job_id in jobs.values()} == {common_pb2.ARTIFACT_STATE_READY}
    with open_registry(any_registry_url).sessions() as session:
        assert [a.id for a in list_artifacts(session)] == [artifact_id]
    prefix = finals[jobs[first]].artifact.object_key_prefix
    keys = moto.keys(bucket_store.bucket)
    assert keys and all(key.startswith(prefix) for key in keys)  # one upload, nothing staged left

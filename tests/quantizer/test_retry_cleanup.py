"""A retry of a FAILED artifact clears what an earlier attempt left under its prefix, also when the
retry reuses the objects of an identical READY artifact: a worker without a registry finds an
artifact by the manifest under `<...>/<artifact_id>/`, and must not find the earlier attempt's."""

from __future__ import annotations

from shared.model.checkpoint import HfCheckpoint
from shared.registry import mark_artifact_failed, register_model_version, reserve_artifact
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import open_store

Q = quantizer_pb2


def test_a_retry_that_reuses_a_twin_clears_its_own_earlier_attempt(bucket_store, start_quantizer, registry_url,
                                                                    open_registry, small_model, request_for):
    quantizer = start_quantizer(bucket_store, registry_url)
    first, _ = quantizer.publish(request_for(small_model, model_name="rand"))
    assert first.state == Q.JOB_STATE_SUCCEEDED, first.error

    store = open_store(bucket_store)
    with open_registry(registry_url).transaction() as session:  # an earlier attempt of "rand-twin" failed
        version = register_model_version(session, "rand-twin", HfCheckpoint(small_model).content_hash())
        artifact = reserve_artifact(session, version.id, "w4a8kv4-g128", "cpu").artifact
        mark_artifact_failed(session, artifact.id, "upload failed: the store went away, cleanup too")
        stale_prefix = artifact.object_prefix
    store.put_bytes(b'{"artifact_id": "stale"}', stale_prefix + "manifest.json")

    twin, updates = quantizer.publish(request_for(small_model, model_name="rand-twin"))
    assert twin.state == Q.JOB_STATE_SUCCEEDED, twin.error
    assert any("reusing" in u.message for u in updates)
    assert twin.artifact.object_key_prefix == first.artifact.object_key_prefix
    assert store.list(stale_prefix) == []

"""The catalog's read-only questions (GetArtifact, ListArtifacts, ListModels) on both databases."""

from __future__ import annotations

import pytest

from services.quantizer.catalog import ArtifactFilter, artifact_view, artifact_views, model_views
from services.quantizer.errors import InvalidRequest
from shared.registry import mark_artifact_ready, register_model_version, reserve_artifact
from shared.storage import StorageError


def _no_details(artifact_id: str) -> None:
    return None


class _SlowStore:
    """A store whose GET gives up (as a slow S3 read does after its retries), noting whether a registry
    connection was held meanwhile."""

    def __init__(self, registry):
        self.registry = registry
        self.held_while_reading: list[int] = []

    def get_bytes(self, key: str) -> bytes:
        self.held_while_reading.append(self.registry.engine.pool.checkedout())
        raise StorageError(f"read timeout on {key}")


def test_get_artifact_reads_the_store_outside_any_registry_transaction(any_registry_url, open_registry) -> None:
    # Before: the manifest was read inside the session, and on SQLite that session held the database's write
    # lock, so a slow store read made every other service's registry call fail with 'database is locked'.
    registry = open_registry(any_registry_url)
    with registry.transaction() as session:
        version = register_model_version(session, "tiny-llama", "a" * 64, label="v1")
        artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
        mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest="d")
    store = _SlowStore(registry)
    view = artifact_view(registry, store, artifact.id, _no_details)
    assert store.held_while_reading == [0]
    assert (view.artifact_id, view.model_name, view.size_bytes) == (artifact.id, "tiny-llama", 0)  # the row answers


@pytest.mark.parametrize("ask", [
    lambda registry: artifact_views(registry, ArtifactFilter(model_name="tiny\x00llama"), _no_details),
    lambda registry: artifact_views(registry, ArtifactFilter(model_version="a\x00"), _no_details),
    lambda registry: model_views(registry, "tiny\x00llama", _no_details),
], ids=["artifacts by model", "artifacts by version", "models"])
def test_a_nul_in_a_filter_is_an_invalid_request_on_both_databases(any_registry_url, open_registry, ask) -> None:
    # Before: PostgreSQL raised a DataError (gRPC UNKNOWN and a traceback) where SQLite found nothing.
    with pytest.raises(InvalidRequest, match="holds a NUL character"):
        ask(open_registry(any_registry_url))


def test_a_snapshot_read_before_a_job_ended_does_not_replace_its_end():
    """A cancel posts a "stopping" snapshot read before the job thread stopped; posted after the thread's
    CANCELLED, it made every later WatchJob stream RUNNING and wait for an end already posted."""
    import dataclasses
    from datetime import datetime, timedelta, timezone

    from services.quantizer.board import JobBoard, Update
    from services.quantizer.views import JobView
    from shared.registry import JobState

    running = JobView(job_id="j", state=JobState.RUNNING, stage=None, block_index=0, block_count=0,
                      elapsed=timedelta(0), remaining=None, error="", artifact=None, request=None,
                      created_at=datetime.now(timezone.utc))
    board = JobBoard()
    board.post(Update(running))
    board.post(Update(dataclasses.replace(running, state=JobState.CANCELLED)))
    board.post(Update(running, "stopping: cancel requested"))
    assert board.latest("j").job.state is JobState.CANCELLED

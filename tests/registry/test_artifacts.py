from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry import (
    ArtifactState,
    EventKind,
    InvalidState,
    InvalidValue,
    ModelVersion,
    Registry,
    find_ready_by_digest,
    get_artifact,
    list_artifacts,
    list_events,
    mark_artifact_failed,
    mark_artifact_ready,
    prefix_served_by_another,
    reserve_artifact,
    retry_artifact,
)
from shared.registry.models import Artifact
from tests.registry.pg_waits import wait_until_blocked

SHA = "e" * 64


def test_reserve_creates_one_pending_artifact_per_binding(session: Session, version: ModelVersion) -> None:
    first = reserve_artifact(session, version.id, "w4a8kv4-g128", "sm90")
    assert first.created and first.artifact.state == ArtifactState.PENDING
    assert first.artifact.object_prefix == f"tiny-llama/{'a' * 64}/w4a8kv4-g128/sm90/{first.artifact.id}/"
    again = reserve_artifact(session, version, "w4a8kv4-g128", "sm90")
    assert not again.created and again.artifact.id == first.artifact.id
    other_gpu = reserve_artifact(session, version, "w4a8kv4-g128", "cpu")
    assert other_gpu.created and other_gpu.artifact.id != first.artifact.id


def test_concurrent_publishes_of_one_binding_leave_one_artifact(registry: Registry, version: ModelVersion) -> None:
    n = 8
    barrier = threading.Barrier(n)
    results: list[tuple[str, bool]] = []
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            barrier.wait()
            with registry.transaction() as session:
                reservation = reserve_artifact(session, version.id, "w4a8kv4-g128", "sm90")
                results.append((reservation.artifact.id, reservation.created))
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    threads = [threading.Thread(target=publish) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert len({artifact_id for artifact_id, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    with registry.sessions() as session:
        assert session.scalar(sa.select(sa.func.count()).select_from(Artifact)) == 1


def test_a_publish_that_loses_the_insert_race_gets_the_winners_row(registry: Registry, version: ModelVersion) -> None:
    """The loser's INSERT meets the winner's uncommitted row: on PostgreSQL it waits for the commit,
    then fails on the unique constraint and must return the winner's row (not raise)."""
    is_postgres = registry.engine.dialect.name == "postgresql"
    loser_pid: list[int] = []
    loser: list[object] = []
    savepoint_rollbacks: list[str] = []
    sa.event.listen(registry.engine, "rollback_savepoint", lambda conn, name, context: savepoint_rollbacks.append(name))

    def lose() -> None:
        with registry.transaction() as session:
            if is_postgres:
                loser_pid.append(session.scalar(sa.text("SELECT pg_backend_pid()")))
            loser.append(reserve_artifact(session, version.id, "fp16", "sm90"))

    with registry.transaction() as winner_session:
        won = reserve_artifact(winner_session, version.id, "fp16", "sm90")
        thread = threading.Thread(target=lose)
        thread.start()
        _wait_until_blocked(registry, loser_pid, is_postgres)
    thread.join(timeout=30)
    (lost,) = loser
    assert won.created and not lost.created
    assert lost.artifact.id == won.artifact.id
    if is_postgres:  # the loser really took the unique-violation path, not the plain lookup
        assert len(savepoint_rollbacks) == 1


def _wait_until_blocked(registry: Registry, loser_pid: list[int], is_postgres: bool) -> None:
    if not is_postgres:  # SQLite: the loser waits in BEGIN IMMEDIATE; nothing to observe from here
        time.sleep(0.2)
        return
    wait_until_blocked(registry, loser_pid, "the second publish never blocked on the first one's row")


def test_pending_becomes_ready_with_its_evaluation(session: Session, version: ModelVersion) -> None:
    artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    ready = mark_artifact_ready(
        session, artifact.id, manifest_sha256=SHA, content_digest="digest-1",
        ppl_fp16=5.012, ppl_quant=5.2, eval_data="pystdlib-eval", actor="quantizer-1",
    )
    assert (ready.state, ready.ppl_fp16, ready.ppl_quant, ready.eval_data) == (
        ArtifactState.READY, 5.012, 5.2, "pystdlib-eval"
    )
    assert ready.updated_at >= ready.created_at and ready.updated_at.tzinfo is not None
    kinds = [e.kind for e in list_events(session, artifact_id=artifact.id)]
    assert kinds == [EventKind.ARTIFACT_RESERVED, EventKind.ARTIFACT_READY]
    with pytest.raises(InvalidState, match=r"is READY and cannot become FAILED; allowed transitions: PENDING -> READY"):
        mark_artifact_failed(session, artifact.id, "late failure")
    with pytest.raises(InvalidState, match="is READY and cannot become PENDING"):
        retry_artifact(session, artifact.id)


def test_failed_keeps_its_reason_and_can_be_retried(session: Session, version: ModelVersion) -> None:
    artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    with pytest.raises(InvalidState, match="is PENDING and cannot become PENDING"):
        retry_artifact(session, artifact.id)
    failed = mark_artifact_failed(session, artifact.id, "CUDA out of memory in calibration")
    assert failed.state == ArtifactState.FAILED and failed.failure_reason == "CUDA out of memory in calibration"
    with pytest.raises(InvalidState, match="is FAILED and cannot become READY"):
        mark_artifact_ready(session, artifact.id, manifest_sha256=SHA, content_digest="d")
    again = reserve_artifact(session, version, "w4a8kv4-g128", "sm90")
    assert not again.created and again.artifact.state == ArtifactState.FAILED
    retried = retry_artifact(session, artifact.id)
    assert retried.state == ArtifactState.PENDING and retried.failure_reason is None
    ready = mark_artifact_ready(session, artifact.id, manifest_sha256=SHA, content_digest="d")
    assert ready.state == ArtifactState.READY
    assert [a.id for a in list_artifacts(session, model="tiny-llama", state=ArtifactState.READY)] == [artifact.id]


def test_identical_content_is_found_and_reused_not_stored_twice(session: Session, version: ModelVersion) -> None:
    first = reserve_artifact(session, version, "w4a8kv4-g128", "sm89").artifact
    assert find_ready_by_digest(session, "same-content") is None
    mark_artifact_ready(session, first.id, manifest_sha256=SHA, content_digest="same-content")
    second = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    assert find_ready_by_digest(session, "same-content").id == first.id
    reused = mark_artifact_ready(
        session, second.id, manifest_sha256=SHA, content_digest="same-content", reuse_prefix_of=first.id
    )
    assert reused.object_prefix == first.object_prefix
    assert find_ready_by_digest(session, "same-content").id == first.id
    # one prefix, two READY artifacts: each one's objects serve the other
    assert prefix_served_by_another(session, first) and prefix_served_by_another(session, reused)
    third = reserve_artifact(session, version, "w4a8kv4-chn", "sm90").artifact
    assert not prefix_served_by_another(session, third)


def test_reuse_needs_a_ready_artifact_with_the_same_digest(session: Session, version: ModelVersion) -> None:
    first = reserve_artifact(session, version, "w4a8kv4-g128", "sm89").artifact
    mark_artifact_ready(session, first.id, manifest_sha256=SHA, content_digest="content-a")
    second = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    with pytest.raises(InvalidValue, match="reuse needs a READY artifact with content digest 'content-b'"):
        mark_artifact_ready(
            session, second.id, manifest_sha256=SHA, content_digest="content-b", reuse_prefix_of=first.id
        )
    assert get_artifact(session, second.id).state == ArtifactState.PENDING


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"manifest_sha256": "xyz"}, "manifest sha256 'xyz' is not accepted: use 64 lowercase hex digits"),
        ({"ppl_fp16": 5.0}, "evaluation .* is incomplete"),
        ({"ppl_fp16": 0.5, "ppl_quant": 5.0, "eval_data": "e"}, "fp16 perplexity 0.5 is not accepted"),
        ({"ppl_fp16": 5.0, "ppl_quant": float("nan"), "eval_data": "e"}, "quantized perplexity nan"),
    ],
)
def test_bad_ready_arguments_are_named(session: Session, version: ModelVersion, kwargs: dict, message: str) -> None:
    artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    with pytest.raises(InvalidValue, match=message):
        mark_artifact_ready(session, artifact.id, **{"manifest_sha256": SHA, "content_digest": "d", **kwargs})


def test_bad_bindings_are_named(session: Session, version: ModelVersion) -> None:
    with pytest.raises(InvalidValue, match="GPU target 'sm 90' is not accepted"):
        reserve_artifact(session, version, "w4a8kv4-g128", "sm 90")
    with pytest.raises(InvalidValue, match="artifact format '' is not accepted"):
        reserve_artifact(session, version, "", "sm90")

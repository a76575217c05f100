"""A cancel racing the transaction that publishes a job (mark_artifact_ready, then finish_job). Whichever
takes the rows first wins outright: a publish that got there first stands and the cancel is refused as
SUCCEEDED; a cancel that got there first makes the publish roll back whole, its artifact never READY."""

from __future__ import annotations

import threading

import sqlalchemy as sa

from shared.registry import (
    ArtifactState,
    InvalidState,
    JobState,
    ModelVersion,
    Registry,
    cancel_job,
    create_job,
    finish_job,
    get_artifact,
    get_job,
    mark_artifact_ready,
    reserve_artifact,
    start_job,
)
from tests.registry.pg_waits import wait_until_blocked

OWNER = "host-a:101:boot1"


def _running_job(registry: Registry, version: ModelVersion) -> tuple[str, str]:
    with registry.transaction() as session:
        artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
        job = create_job(session, owner=OWNER, artifact_id=artifact.id, model_name="tiny-llama")
        start_job(session, job.id, owner=OWNER)
        return job.id, artifact.id


def _publish(session, job_id: str, artifact_id: str) -> None:
    mark_artifact_ready(session, artifact_id, manifest_sha256="b" * 64, content_digest="d", actor=OWNER)
    finish_job(session, job_id, artifact_id=artifact_id)


def _race(registry: Registry, first, second) -> dict[str, object]:
    """Runs `first` in a transaction up to its commit, then `second` in another one, which must wait for the
    first's locks (PostgreSQL: seen waiting; SQLite: one writer at a time) before the first commits."""
    is_postgres = registry.engine.dialect.name == "postgresql"
    holding, commit = threading.Event(), threading.Event()
    second_pid: list[int] = []
    outcomes: dict[str, object] = {}

    def run_first() -> None:
        try:
            with registry.transaction() as session:
                outcomes["first"] = first(session)
                holding.set()
                assert commit.wait(timeout=20)
        except BaseException as exc:  # kept for the asserts
            outcomes["first"] = exc
        finally:
            holding.set()

    def run_second() -> None:
        try:
            assert holding.wait(timeout=20)
            with registry.transaction() as session:
                if is_postgres:
                    second_pid.append(session.scalar(sa.text("SELECT pg_backend_pid()")))
                outcomes["second"] = second(session)
        except BaseException as exc:  # kept for the asserts
            outcomes["second"] = exc

    threads = [threading.Thread(target=run_first), threading.Thread(target=run_second)]
    for t in threads:
        t.start()
    if is_postgres:
        wait_until_blocked(registry, second_pid, "the second transaction never waited for the first")
    commit.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a transaction never finished"
    return outcomes


def test_a_cancel_after_the_publish_took_the_job_is_refused_as_succeeded(registry: Registry,
                                                                         version: ModelVersion) -> None:
    job_id, artifact_id = _running_job(registry, version)
    outcomes = _race(registry, lambda s: _publish(s, job_id, artifact_id),
                     lambda s: cancel_job(s, job_id, actor="alice", reason="too late"))
    assert outcomes["first"] is None
    assert isinstance(outcomes["second"], InvalidState) and "it is SUCCEEDED" in str(outcomes["second"])
    with registry.sessions() as session:
        job = get_job(session, job_id)
        assert job.state == JobState.SUCCEEDED and job.cancel_requested_at is None
        assert get_artifact(session, artifact_id).state == ArtifactState.READY


def test_a_publish_after_the_cancel_took_the_job_rolls_back_whole(registry: Registry, version: ModelVersion) -> None:
    job_id, artifact_id = _running_job(registry, version)
    outcomes = _race(registry, lambda s: cancel_job(s, job_id, actor="alice", reason="wrong model").state,
                     lambda s: _publish(s, job_id, artifact_id))
    assert outcomes["first"] == JobState.RUNNING  # asked to stop
    assert isinstance(outcomes["second"], InvalidState) and "asked to stop" in str(outcomes["second"])
    with registry.sessions() as session:
        job = get_job(session, job_id)
        assert job.state == JobState.RUNNING and job.cancel_reason == "cancelled by alice: wrong model"
        artifact = get_artifact(session, artifact_id)
        assert artifact.state == ArtifactState.PENDING and artifact.manifest_sha256 is None  # never READY

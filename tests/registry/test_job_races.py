"""A quantizer's sweep of orphaned jobs racing the job it judges orphaned as that job finishes
(its owner was only slow, not dead). The finishing transaction takes the artifact, then the job
(mark_artifact_ready, then finish_job, in one transaction); the sweep must take them in the same
order, or on PostgreSQL each waits for the other and one of them dies with a deadlock error."""

from __future__ import annotations

import threading
from datetime import timedelta

import sqlalchemy as sa

from shared.registry import (
    ArtifactState,
    JobState,
    ModelVersion,
    Registry,
    RegistryError,
    create_job,
    fail_orphaned_jobs,
    finish_job,
    get_artifact,
    get_job,
    mark_artifact_ready,
    reserve_artifact,
    start_job,
)
from shared.registry.models import utcnow
from tests.registry.pg_waits import wait_until_blocked

SLOW, SWEEPER = "host-a:101:boot1", "host-b:202:boot1"


def _running_job(registry: Registry, version: ModelVersion) -> tuple[str, str]:
    with registry.transaction() as session:
        artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
        job = create_job(session, owner=SLOW, artifact_id=artifact.id)
        start_job(session, job.id, owner=SLOW)
        return job.id, artifact.id


def test_a_sweep_racing_the_job_it_judges_orphaned_as_it_finishes_never_deadlocks(
    registry: Registry, version: ModelVersion
) -> None:
    job_id, artifact_id = _running_job(registry, version)
    is_postgres = registry.engine.dialect.name == "postgresql"
    artifact_locked, finish_now = threading.Event(), threading.Event()
    sweep_pid: list[int] = []
    outcomes: dict[str, object] = {}

    def finish() -> None:  # the slow owner publishing at last
        try:
            with registry.transaction() as session:
                mark_artifact_ready(session, artifact_id, manifest_sha256="b" * 64, content_digest="d", actor=SLOW)
                artifact_locked.set()
                assert finish_now.wait(timeout=20)
                outcomes["finish"] = finish_job(session, job_id, artifact_id=artifact_id).state
        except BaseException as exc:  # kept for the asserts, with its type
            outcomes["finish"] = exc
        finally:
            artifact_locked.set()

    def sweep() -> None:  # another quantizer, for which the owner's heartbeat is an hour old
        try:
            assert artifact_locked.wait(timeout=20)
            with registry.transaction() as session:
                if is_postgres:
                    sweep_pid.append(session.scalar(sa.text("SELECT pg_backend_pid()")))
                orphans = fail_orphaned_jobs(session, "owner lost", current_owner=SWEEPER,
                                             stale_after=timedelta(seconds=60), now=utcnow() + timedelta(hours=1))
                outcomes["sweep"] = [job.id for job in orphans]
        except BaseException as exc:  # kept for the asserts, with its type
            outcomes["sweep"] = exc

    threads = [threading.Thread(target=finish), threading.Thread(target=sweep)]
    for t in threads:
        t.start()
    if is_postgres:  # the sweep is inside fail_orphaned_jobs, waiting on a lock the finisher holds
        wait_until_blocked(registry, sweep_pid, "the sweep never blocked on the finishing transaction")
    finish_now.set()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a transaction never finished"

    errors = [o for o in outcomes.values() if isinstance(o, BaseException) and not isinstance(o, RegistryError)]
    assert not errors, errors  # before: psycopg DeadlockDetected in one of the two
    assert outcomes == {"finish": JobState.SUCCEEDED, "sweep": []}
    with registry.sessions() as session:
        assert get_job(session, job_id).state == JobState.SUCCEEDED
        assert get_artifact(session, artifact_id).state == ArtifactState.READY

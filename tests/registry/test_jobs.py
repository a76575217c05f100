from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from shared.registry import (
    ArtifactState,
    EventKind,
    InvalidState,
    InvalidValue,
    JobState,
    ModelVersion,
    create_job,
    fail_job,
    fail_orphaned_jobs,
    finish_job,
    get_artifact,
    get_job,
    heartbeat,
    list_events,
    list_jobs,
    mark_artifact_ready,
    report_progress,
    reserve_artifact,
    start_job,
)
from shared.registry.models import utcnow

DEAD, ALIVE, ME = "host-a:101:boot1", "host-b:202:boot1", "host-a:303:boot2"


def test_a_job_runs_block_by_block_and_succeeds_with_its_artifact(session: Session, version: ModelVersion) -> None:
    artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    job = create_job(session, owner=ME, artifact_id=artifact.id)
    assert job.state == JobState.QUEUED
    start_job(session, job.id, owner=ME)
    progressed = report_progress(session, job.id, stage="calibrate", block_index=3, block_count=6)
    assert (progressed.stage, progressed.block_index, progressed.block_count) == ("calibrate", 3, 6)
    with pytest.raises(InvalidState, match="cannot succeed with artifact .* in state PENDING"):
        finish_job(session, job.id)
    mark_artifact_ready(session, artifact.id, manifest_sha256="f" * 64, content_digest="d")
    done = finish_job(session, job.id)
    assert done.state == JobState.SUCCEEDED and done.finished_at is not None and done.artifact_id == artifact.id
    assert [e.kind for e in list_events(session, job_id=job.id)] == [
        EventKind.JOB_QUEUED, EventKind.JOB_STARTED, EventKind.JOB_SUCCEEDED
    ]
    with pytest.raises(InvalidState, match="is SUCCEEDED: fail_job accepts only a job that is QUEUED or RUNNING"):
        fail_job(session, job.id, "too late")


def test_job_transitions_and_progress_are_validated(session: Session) -> None:
    job = create_job(session, owner=ME)
    with pytest.raises(InvalidState, match="is QUEUED: report_progress accepts only a job that is RUNNING"):
        report_progress(session, job.id, stage="pack", block_index=0, block_count=6)
    start_job(session, job.id, owner=ME)
    with pytest.raises(InvalidState, match="is RUNNING: start_job accepts only a job that is QUEUED"):
        start_job(session, job.id, owner=ME)
    with pytest.raises(InvalidValue, match="block 7 of 6 is not accepted"):
        report_progress(session, job.id, stage="pack", block_index=7, block_count=6)
    failed = fail_job(session, job.id, "tokenizer missing")
    assert failed.state == JobState.FAILED and failed.error == "tokenizer missing"


def test_restart_fails_the_jobs_and_artifacts_a_dead_process_left(session: Session, version: ModelVersion) -> None:
    now = utcnow()
    orphan_artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    orphan = create_job(session, owner=DEAD, artifact_id=orphan_artifact.id)
    start_job(session, orphan.id, owner=DEAD)
    queued_orphan = create_job(session, owner=DEAD)
    alive = create_job(session, owner=ALIVE)
    mine = create_job(session, owner=ME)
    finished = create_job(session, owner=DEAD)
    fail_job(session, finished.id, "earlier failure")
    heartbeat(session, DEAD, now=now - timedelta(minutes=5))
    heartbeat(session, ALIVE, now=now - timedelta(seconds=5))

    failed = fail_orphaned_jobs(
        session, "quantizer restarted", current_owner=ME, stale_after=timedelta(seconds=60), now=now
    )

    assert {job.id for job in failed} == {orphan.id, queued_orphan.id}
    assert get_job(session, orphan.id).error.startswith(f"quantizer restarted (owner '{DEAD}' last seen")
    assert get_job(session, finished.id).error == "earlier failure"
    assert {j.id for j in list_jobs(session, states=[JobState.QUEUED, JobState.RUNNING])} == {alive.id, mine.id}
    artifact = get_artifact(session, orphan_artifact.id)
    assert artifact.state == ArtifactState.FAILED and "quantizer restarted" in artifact.failure_reason
    assert EventKind.ARTIFACT_FAILED in [e.kind for e in list_events(session, artifact_id=artifact.id)]
    assert fail_orphaned_jobs(session, "again", current_owner=ME, stale_after=timedelta(seconds=60), now=now) == []
    with pytest.raises(InvalidValue, match=r"stale_after datetime.timedelta\(days=-1\) is not accepted"):
        fail_orphaned_jobs(session, "x", current_owner=ME, stale_after=timedelta(days=-1))


def test_liveness_is_judged_by_the_database_clock_not_the_hosts(session: Session, version: ModelVersion,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Quantizers on two hosts share the registry. Before: heartbeat_at carried the owner's clock and the sweep
    # compared it with the sweeper's, so a sweeper whose clock ran a minute ahead failed live jobs.
    artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    host_clock = lambda skew: lambda: utcnow() + skew  # noqa: E731
    monkeypatch.setattr("shared.registry.jobs.utcnow", host_clock(timedelta(seconds=-61)))  # the owner's host
    queued = create_job(session, owner=ALIVE)
    running = create_job(session, owner=ALIVE, artifact_id=artifact.id)
    start_job(session, running.id, owner=ALIVE)
    report_progress(session, running.id, stage="calibrate", block_index=1, block_count=6)
    heartbeat(session, ALIVE)
    monkeypatch.setattr("shared.registry.jobs.utcnow", host_clock(timedelta(seconds=61)))  # the sweeper's host
    assert fail_orphaned_jobs(session, "no heartbeat", current_owner=ME, stale_after=timedelta(seconds=60)) == []
    assert [get_job(session, job.id).state for job in (queued, running)] == [JobState.QUEUED, JobState.RUNNING]
    assert get_artifact(session, artifact.id).state == ArtifactState.PENDING

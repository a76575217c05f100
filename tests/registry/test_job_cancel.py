"""Cancelling jobs in the registry: a queued job ends at once, a running one gets a request its owner acts on
(and can then no longer succeed), an ended one is refused naming its state."""

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
    NotFound,
    cancel_job,
    cancel_requests,
    create_job,
    fail_job,
    fail_orphaned_jobs,
    finish_job,
    get_artifact,
    get_job,
    list_events,
    mark_artifact_ready,
    report_progress,
    reserve_artifact,
    start_job,
)
from shared.registry.models import utcnow

OWNER, SWEEPER = "host-a:101:boot1", "host-b:202:boot1"


def _running(session: Session, version: ModelVersion | None = None) -> str:
    artifact_id = None
    if version is not None:
        artifact_id = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact.id
    job = create_job(session, owner=OWNER, artifact_id=artifact_id, model_name="tiny-llama")
    start_job(session, job.id, owner=OWNER)
    return job.id


def test_a_queued_job_ends_cancelled_at_once(session: Session) -> None:
    job = create_job(session, owner=OWNER, model_name="tiny-llama")
    cancelled = cancel_job(session, job.id, actor="alice", reason="  wrong checkpoint ")
    assert cancelled.state == JobState.CANCELLED and cancelled.finished_at is not None
    assert cancelled.error == cancelled.cancel_reason == "cancelled by alice: wrong checkpoint"
    events = list_events(session, job_id=job.id)
    assert [e.kind for e in events] == [EventKind.JOB_QUEUED, EventKind.JOB_CANCELLED]
    assert events[-1].actor == "alice" and events[-1].detail == {"error": "cancelled by alice: wrong checkpoint"}
    with pytest.raises(InvalidState, match="is CANCELLED: start_job accepts only a job that is QUEUED"):
        start_job(session, job.id, owner=OWNER)


def test_a_queued_job_with_a_pending_artifact_fails_the_artifact_too(session: Session, version: ModelVersion) -> None:
    artifact = reserve_artifact(session, version, "w4a8kv4-g128", "sm90").artifact
    job = create_job(session, owner=OWNER, artifact_id=artifact.id)
    cancel_job(session, job.id, actor="alice")
    assert get_job(session, job.id).error == "cancelled by alice"  # no reason given: who alone
    failed = get_artifact(session, artifact.id)
    assert failed.state == ArtifactState.FAILED
    assert failed.failure_reason == f"quantization job {job.id} was cancelled: cancelled by alice"


def test_a_running_job_gets_a_request_once_and_ends_cancelled_by_its_owner(session: Session) -> None:
    job_id = _running(session)
    asked = cancel_job(session, job_id, actor="alice", reason="wrong model")
    assert asked.state == JobState.RUNNING and asked.cancel_requested_at is not None and asked.error is None
    again = cancel_job(session, job_id, actor="bob", reason="me too")  # idempotent: the first request stands
    assert again.cancel_reason == "cancelled by alice: wrong model" and again.state == JobState.RUNNING
    assert [j.id for j in cancel_requests(session, [job_id])] == [job_id]
    report_progress(session, job_id, stage="quantize", block_index=2, block_count=6)  # it runs on until it stops

    ended = fail_job(session, job_id, "quantize failed: cancelled by alice: wrong model")  # the owner stopped it
    assert ended.state == JobState.CANCELLED and ended.error == "cancelled by alice: wrong model"
    events = list_events(session, job_id=job_id)
    assert [e.kind for e in events] == [EventKind.JOB_QUEUED, EventKind.JOB_STARTED, EventKind.JOB_CANCEL_REQUESTED,
                                        EventKind.JOB_CANCELLED]
    assert events[2].actor == "alice" and events[2].detail == {"reason": "wrong model"}
    assert events[3].detail == {"error": "cancelled by alice: wrong model",
                                "stopped_with": "quantize failed: cancelled by alice: wrong model"}


def test_a_job_asked_to_stop_can_no_longer_succeed(session: Session, version: ModelVersion) -> None:
    job_id = _running(session, version)
    cancel_job(session, job_id, actor="alice")
    artifact_id = get_job(session, job_id).artifact_id
    mark_artifact_ready(session, artifact_id, manifest_sha256="b" * 64, content_digest="d")
    with pytest.raises(InvalidState, match="cannot succeed: it was asked to stop \\(cancelled by alice\\)"):
        finish_job(session, job_id)
    assert get_job(session, job_id).state == JobState.RUNNING


@pytest.mark.parametrize("end", ["succeeded", "failed", "cancelled"])
def test_an_ended_job_is_refused_naming_its_state(session: Session, version: ModelVersion, end: str) -> None:
    job_id = _running(session, version)
    if end == "succeeded":
        mark_artifact_ready(session, get_job(session, job_id).artifact_id, manifest_sha256="b" * 64,
                            content_digest="d")
        finish_job(session, job_id)
    elif end == "failed":
        fail_job(session, job_id, "tokenizer missing")
    else:
        cancel_job(session, job_id, actor="alice")
        fail_job(session, job_id, "stopped")
    with pytest.raises(InvalidState, match=f"has already ended: it is {end.upper()}; only a QUEUED or RUNNING"):
        cancel_job(session, job_id, actor="bob")


def test_cancel_arguments_are_checked(session: Session) -> None:
    with pytest.raises(NotFound, match="quantization job 'nope' does not exist"):
        cancel_job(session, "nope", actor="alice")
    job = create_job(session, owner=OWNER)
    with pytest.raises(InvalidValue, match="actor '' is not accepted"):
        cancel_job(session, job.id, actor="")
    with pytest.raises(InvalidValue, match="cancel reason .* use at most 1000 characters"):
        cancel_job(session, job.id, actor="alice", reason="x" * 1001)
    assert get_job(session, job.id).state == JobState.QUEUED


def test_an_orphan_asked_to_stop_is_swept_as_cancelled(session: Session, version: ModelVersion) -> None:
    job_id = _running(session, version)
    cancel_job(session, job_id, actor="alice", reason="wrong model")  # then its owner died
    [swept] = fail_orphaned_jobs(session, "owner lost", current_owner=SWEEPER, stale_after=timedelta(seconds=60),
                                 now=utcnow() + timedelta(hours=1))
    assert swept.id == job_id and swept.state == JobState.CANCELLED and swept.error == "cancelled by alice: wrong model"
    artifact = get_artifact(session, swept.artifact_id)
    assert artifact.state == ArtifactState.FAILED and "was cancelled: cancelled by alice" in artifact.failure_reason


def test_cancel_requests_name_only_the_asked_jobs_among_those_given(session: Session) -> None:
    asked, other, elsewhere = _running(session), _running(session), _running(session)
    queued = create_job(session, owner=OWNER).id
    for job_id in (asked, queued, elsewhere):
        cancel_job(session, job_id, actor="alice")
    assert {j.id for j in cancel_requests(session, [asked, other, queued])} == {asked, queued}
    assert cancel_requests(session, []) == []

"""Quantization jobs: QUEUED -> RUNNING -> SUCCEEDED | FAILED | CANCELLED (and QUEUED -> FAILED | CANCELLED).

A job is held by an `owner`, a string naming one quantizer process (host, pid and a per-boot id, so a
restarted process is a new owner). The owner calls heartbeat() while it lives; when a quantizer starts
it calls fail_orphaned_jobs() to fail what a dead process left QUEUED or RUNNING, with its artifact.
Heartbeats are stamped and judged with the database's clock, not the hosts': quantizers on hosts whose
clocks disagree would otherwise fail each other's live jobs.

cancel_job() ends a QUEUED job at once; a RUNNING one only gets a cancel request, because only its owner
can stop its pipeline and clean up (work folder, uploaded objects). The owner learns of it through
cancel_requests() and ends the job with fail_job(), which then records CANCELLED. A job asked to stop
can no longer succeed (finish_job refuses it), so nothing is published after a cancel."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry._rows import MAX_INT, check_key, check_no_nul, check_segment, check_text, locked, new_id
from shared.registry.artifacts import get_artifact, mark_artifact_failed
from shared.registry.errors import InvalidState, InvalidValue, NotFound
from shared.registry.events import EventKind, append_event
from shared.registry.models import MAX_ACTOR, ArtifactState, JobState, QuantJob, utcnow

_ACTIVE = (JobState.QUEUED, JobState.RUNNING)
MAX_LIST_LIMIT = 10_000
MAX_CANCEL_REASON = 1000  # the operator's "why"; the stored reason adds "cancelled by <actor>: "


def create_job(
    session: Session, *, owner: str, artifact_id: str | None = None, model_name: str | None = None,
    actor: str | None = None,
) -> QuantJob:
    """A QUEUED job. `model_name` is the model it publishes (list_jobs filters on it); `actor`, who asked
    for it, is the actor of its JOB_QUEUED event (default: the owner)."""
    check_text("job owner", owner, 256)
    if actor is not None:
        check_text("actor", actor, MAX_ACTOR)
    if model_name is not None:
        check_segment("model name", model_name)
    if artifact_id is not None:
        get_artifact(session, artifact_id)
    now = utcnow()
    job = QuantJob(
        id=new_id(), state=JobState.QUEUED, owner=owner, artifact_id=artifact_id, model_name=model_name,
        block_index=0, block_count=0, heartbeat_at=_db_now(session), created_at=now, updated_at=now,
    )
    session.add(job)
    session.flush()
    append_event(session, EventKind.JOB_QUEUED, actor=actor or owner, job_id=job.id, artifact_id=artifact_id)
    return job


def get_job(session: Session, job_id: str) -> QuantJob:
    job = session.get(QuantJob, check_key("quantization job id", job_id))
    if job is None:
        raise NotFound(f"quantization job {job_id!r} does not exist")
    return job


def list_jobs(
    session: Session,
    *,
    states: Iterable[JobState] | None = None,
    owner: str | None = None,
    model_name: str | None = None,
    newest_first: bool = False,
    limit: int | None = None,
) -> list[QuantJob]:
    """Jobs matching every filter given, oldest first (or newest first), at most `limit` of them."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT):
        raise InvalidValue(f"job limit {limit!r} is not accepted: use an integer from 1 to {MAX_LIST_LIMIT}")
    if newest_first:
        stmt = sa.select(QuantJob).order_by(QuantJob.created_at.desc(), QuantJob.id.desc())
    else:
        stmt = sa.select(QuantJob).order_by(QuantJob.created_at, QuantJob.id)
    if states is not None:
        stmt = stmt.where(QuantJob.state.in_([JobState(s) for s in states]))
    if owner is not None:
        stmt = stmt.where(QuantJob.owner == check_key("job owner", owner))
    if model_name is not None:
        stmt = stmt.where(QuantJob.model_name == check_key("model name", model_name))
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(session.scalars(stmt))


def start_job(session: Session, job_id: str, *, owner: str) -> QuantJob:
    """QUEUED -> RUNNING under `owner` (which may take over a queued job of another live process)."""
    check_text("job owner", owner, 256)
    job = _lock(session, job_id)
    _require(job, (JobState.QUEUED,), "start_job")
    now = utcnow()
    job.state, job.owner, job.started_at, job.updated_at = JobState.RUNNING, owner, now, now
    job.heartbeat_at = _db_now(session)
    append_event(session, EventKind.JOB_STARTED, actor=owner, job_id=job.id, artifact_id=job.artifact_id)
    session.flush()
    return job


def report_progress(session: Session, job_id: str, *, stage: str, block_index: int, block_count: int) -> QuantJob:
    """Records `stage` and "block i of n" of a RUNNING job; counts as a heartbeat. Not an event."""
    check_segment("job stage", stage, 64)
    if (
        isinstance(block_index, bool) or isinstance(block_count, bool)
        or not isinstance(block_index, int) or not isinstance(block_count, int)
        or not 0 <= block_index <= block_count <= MAX_INT
    ):
        raise InvalidValue(
            f"job progress block {block_index!r} of {block_count!r} is not accepted: "
            f"use integers with 0 <= block_index <= block_count <= {MAX_INT}"
        )
    job = _lock(session, job_id)
    _require(job, (JobState.RUNNING,), "report_progress")
    job.stage, job.block_index, job.block_count = stage, block_index, block_count
    job.heartbeat_at, job.updated_at = _db_now(session), utcnow()
    session.flush()
    return job


def heartbeat(session: Session, owner: str, *, now: datetime | None = None) -> int:
    """Marks every QUEUED or RUNNING job of `owner` alive; returns how many there are. `now` (tests) stands
    for the database's clock."""
    now = now or _db_now(session)
    stmt = (
        sa.update(QuantJob)
        .where(QuantJob.owner == owner, QuantJob.state.in_(_ACTIVE))
        .values(heartbeat_at=now)
        .execution_options(synchronize_session="fetch")
    )
    return session.execute(stmt).rowcount


def finish_job(session: Session, job_id: str, *, artifact_id: str | None = None) -> QuantJob:
    """RUNNING -> SUCCEEDED. The artifact it produced (given here or at creation) must be READY, and no
    cancel may have been requested: the caller marks the artifact READY in the same transaction, and this
    refusal rolls that back too, so a cancel that won the job's lock leaves nothing published."""
    job = _lock(session, job_id)
    _require(job, (JobState.RUNNING,), "finish_job")
    if job.cancel_requested_at is not None:
        raise InvalidState(
            f"job {job.id} cannot succeed: it was asked to stop ({job.cancel_reason}); end it with fail_job, "
            f"which records it CANCELLED"
        )
    artifact_id = artifact_id or job.artifact_id
    if artifact_id is not None:
        artifact = get_artifact(session, artifact_id)
        if artifact.state != ArtifactState.READY:
            raise InvalidState(
                f"job {job.id} cannot succeed with artifact {artifact_id} in state {artifact.state.value}; "
                f"mark the artifact READY first (mark_artifact_ready) or fail the job"
            )
    now = utcnow()
    job.state, job.artifact_id, job.finished_at, job.updated_at = JobState.SUCCEEDED, artifact_id, now, now
    append_event(session, EventKind.JOB_SUCCEEDED, actor=job.owner, job_id=job.id, artifact_id=artifact_id)
    session.flush()
    return job


def fail_job(session: Session, job_id: str, error: str) -> QuantJob:
    """QUEUED or RUNNING -> FAILED with `error`; or -> CANCELLED, with the cancel's reason as its error,
    when a cancel was requested (the job stopped as asked, whatever it stopped with). The artifact, if
    any, is left to the caller."""
    check_text("job error", error, 10_000)
    job = _lock(session, job_id)
    _require(job, _ACTIVE, "fail_job")
    _fail(session, job, error, actor=job.owner)
    return job


def fail_orphaned_jobs(
    session: Session, reason: str, *, current_owner: str, stale_after: timedelta, now: datetime | None = None
) -> list[QuantJob]:
    """Fails every QUEUED or RUNNING job that is not `current_owner`'s and whose heartbeat is older
    than `stale_after`, and fails its PENDING artifact too, so that the binding can be retried.
    With one quantizer per registry, stale_after=timedelta(0) fails everything a previous process left.
    `now` (tests) stands for the database's clock."""
    check_text("orphan reason", reason, 10_000)
    if not isinstance(stale_after, timedelta) or stale_after < timedelta(0):
        raise InvalidValue(f"stale_after {stale_after!r} is not accepted: use a timedelta >= 0")
    cutoff = (now or _db_now(session)) - stale_after
    orphaned = (QuantJob.state.in_(_ACTIVE), QuantJob.owner != current_owner, QuantJob.heartbeat_at <= cutoff)
    candidates = session.execute(sa.select(QuantJob.id, QuantJob.artifact_id).where(*orphaned)).all()
    # Artifacts before jobs: the order in which a quantizer finishing (mark_artifact_ready, then
    # finish_job) or failing its job takes them. Taking the job first deadlocked on PostgreSQL with an
    # owner that was slow, not dead, finishing just then (the job's events also key-share its artifact).
    artifact_ids = sorted({artifact_id for _, artifact_id in candidates if artifact_id is not None})
    for artifact_id in artifact_ids:
        get_artifact(session, artifact_id, for_update=True)
    stmt = (
        sa.select(QuantJob)
        .where(QuantJob.id.in_([job_id for job_id, _ in candidates]), *orphaned)  # again, now under the lock
        .order_by(QuantJob.created_at, QuantJob.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    # A job that got an artifact since the first read (a claim committed in between) is left to the
    # next sweep: locking that artifact now, after its job, is the order that deadlocks.
    orphans = [job for job in session.scalars(stmt) if job.artifact_id is None or job.artifact_id in artifact_ids]
    for job in orphans:
        error = f"{reason} (owner {job.owner!r} last seen {job.heartbeat_at.isoformat()})"
        _fail(session, job, error, actor=current_owner)
        _fail_pending_artifact(session, job, actor=current_owner)
    session.flush()
    return orphans


def cancel_job(session: Session, job_id: str, *, actor: str, reason: str = "") -> QuantJob:
    """Cancels the job for `actor` (who asks) because of `reason` (may be empty).

    QUEUED -> CANCELLED at once (with its PENDING artifact, if it has one, FAILED). RUNNING: records the
    request; the owner stops the job at its next step and ends it with fail_job (CANCELLED). A job asked
    already is returned as it is (the first request's who and why stand). An ended job: InvalidState."""
    check_text("actor", actor, MAX_ACTOR)
    if not isinstance(reason, str) or len(reason) > MAX_CANCEL_REASON:
        raise InvalidValue(f"cancel reason {reason!r:.80} is not accepted: use at most {MAX_CANCEL_REASON} characters")
    check_no_nul("cancel reason", reason)
    # Artifact before job, the order in which finishing and failing take them (see fail_orphaned_jobs).
    artifact_id = get_job(session, job_id).artifact_id
    if artifact_id is not None:
        get_artifact(session, artifact_id, for_update=True)
    job = _lock(session, job_id)
    if job.state not in _ACTIVE:
        raise InvalidState(f"job {job.id} has already ended: it is {job.state.value}; only a QUEUED or RUNNING job "
                           f"can be cancelled")
    if job.cancel_requested_at is not None:
        return job
    now = utcnow()
    job.cancel_requested_at, job.updated_at = now, now
    reason = reason.strip()
    job.cancel_reason = f"cancelled by {actor}" + (f": {reason}" if reason else "")
    if job.state == JobState.QUEUED:  # nothing runs yet: nothing for an owner to clean up
        _fail(session, job, job.cancel_reason, actor=actor)
        _fail_pending_artifact(session, job, actor=actor)
    else:
        append_event(session, EventKind.JOB_CANCEL_REQUESTED, actor=actor, job_id=job.id,
                     artifact_id=job.artifact_id, detail={"reason": reason})
    session.flush()
    return job


def cancel_requests(session: Session, job_ids: Iterable[str]) -> list[QuantJob]:
    """Those of these jobs that were cancelled or asked to stop: what their owner has to act on."""
    ids = [check_key("quantization job id", job_id) for job_id in job_ids]
    if not ids:
        return []
    stmt = (
        sa.select(QuantJob).where(QuantJob.id.in_(ids), QuantJob.cancel_requested_at.is_not(None))
        .order_by(QuantJob.created_at, QuantJob.id).execution_options(populate_existing=True)
    )
    return list(session.scalars(stmt))


def _fail(session: Session, job: QuantJob, error: str, *, actor: str) -> None:
    now = utcnow()
    if job.cancel_requested_at is not None:
        detail = {"error": job.cancel_reason} | ({} if error == job.cancel_reason else {"stopped_with": error})
        job.state, job.error, kind = JobState.CANCELLED, job.cancel_reason, EventKind.JOB_CANCELLED
    else:
        job.state, job.error, kind, detail = JobState.FAILED, error, EventKind.JOB_FAILED, {"error": error}
    job.finished_at = job.updated_at = now
    append_event(session, kind, actor=actor, job_id=job.id, artifact_id=job.artifact_id, detail=detail)
    session.flush()


def _fail_pending_artifact(session: Session, job: QuantJob, *, actor: str) -> None:
    """An ended job's PENDING artifact FAILED too, so that its binding can be retried."""
    if job.artifact_id is not None and get_artifact(session, job.artifact_id).state == ArtifactState.PENDING:
        ended = "was cancelled" if job.state == JobState.CANCELLED else "failed"
        mark_artifact_failed(session, job.artifact_id, f"quantization job {job.id} {ended}: {job.error}", actor=actor)


def _db_now(session: Session) -> datetime:
    """The database's clock, for heartbeat_at and the orphan sweep's cutoff: one clock for every quantizer
    sharing the registry, whatever their hosts' clocks say."""
    if session.get_bind().dialect.name == "sqlite":
        # UTC text; CURRENT_TIMESTAMP would drop the fraction of a second that %f keeps (milliseconds).
        text = session.scalar(sa.select(sa.func.strftime("%Y-%m-%d %H:%M:%f", "now")))
        return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)
    return session.scalar(sa.select(sa.func.now())).astimezone(timezone.utc)


def _require(job: QuantJob, states: tuple[JobState, ...], action: str) -> None:
    if job.state not in states:
        allowed = " or ".join(state.value for state in states)
        raise InvalidState(f"job {job.id} is {job.state.value}: {action} accepts only a job that is {allowed}")


def _lock(session: Session, job_id: str) -> QuantJob:
    check_key("quantization job id", job_id)
    job = locked(session, sa.select(QuantJob).where(QuantJob.id == job_id), QuantJob)
    if job is None:
        raise NotFound(f"quantization job {job_id!r} does not exist")
    return job

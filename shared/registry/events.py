"""The append-only event log. This module only appends and reads: there is no update or delete,
records come back as frozen dataclasses, and the ORM and the database both refuse changes."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry._rows import check_key, check_text
from shared.registry.errors import InvalidValue
from shared.registry.models import MAX_ACTOR, Deployment, Event


class EventKind(str, enum.Enum):
    DEPLOYMENT_CREATE = "deployment_create"
    ROLLOUT_START = "rollout_start"
    ROLLOUT_PERCENT = "rollout_percent"
    PROMOTE = "promote"
    ABORT = "abort"
    FALLBACK_ON = "fallback_on"
    FALLBACK_OFF = "fallback_off"
    BASELINE_SET = "baseline_set"
    ARTIFACT_RESERVED = "artifact_reserved"
    ARTIFACT_READY = "artifact_ready"
    ARTIFACT_FAILED = "artifact_failed"
    ARTIFACT_RETRY = "artifact_retry"
    JOB_QUEUED = "job_queued"
    JOB_STARTED = "job_started"
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    JOB_CANCEL_REQUESTED = "job_cancel_requested"
    JOB_CANCELLED = "job_cancelled"


@dataclass(frozen=True, slots=True)
class EventRecord:
    id: int
    at: datetime
    kind: EventKind
    actor: str
    deployment: str | None  # deployment name
    artifact_id: str | None
    job_id: str | None
    detail: Mapping[str, Any]  # read-only view of the JSON object


def append_event(
    session: Session,
    kind: EventKind,
    *,
    actor: str,
    deployment: Deployment | None = None,
    artifact_id: str | None = None,
    job_id: str | None = None,
    detail: Mapping[str, Any] | None = None,
) -> None:
    """Adds one event to the session's transaction: it commits or rolls back with the change it records."""
    kind = EventKind(kind)
    check_text("actor", actor, MAX_ACTOR)
    try:
        detail_json = json.dumps(dict(detail or {}), sort_keys=True)
    except TypeError as exc:
        raise InvalidValue(f"event detail {detail!r} is not accepted: use a JSON-serializable mapping ({exc})") from exc
    if deployment is not None and deployment.id is None:
        session.flush()  # the event refers to the new deployment's id
    session.add(
        Event(
            kind=kind.value,
            actor=actor,
            deployment_id=None if deployment is None else deployment.id,
            artifact_id=artifact_id,
            job_id=job_id,
            detail=detail_json,
        )
    )


def list_events(
    session: Session,
    *,
    deployment: str | None = None,
    artifact_id: str | None = None,
    job_id: str | None = None,
    kinds: Iterable[EventKind] | None = None,
    after_id: int = 0,
    limit: int = 100,
) -> list[EventRecord]:
    """Events in the order they were appended; `after_id` lists those after an id already seen. Not a
    gap-free tail on PostgreSQL: ids are taken at insert, not at commit, so an event whose transaction
    commits after a later-numbered one's can appear behind an id a reader already passed (SQLite has one
    writer at a time: there it is gap-free). Nothing in the services tails the log this way."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise InvalidValue(f"event limit {limit!r} is not accepted: use an integer from 1 to 10000")
    check_key("event id to list after", after_id, int)
    for what, key in (("deployment name", deployment), ("artifact id", artifact_id), ("job id", job_id)):
        if key is not None:
            check_key(what, key)
    stmt = (
        sa.select(Event, Deployment.name)
        .outerjoin(Deployment, Event.deployment_id == Deployment.id)
        .where(Event.id > after_id)
        .order_by(Event.id)
        .limit(limit)
    )
    if deployment is not None:
        stmt = stmt.where(Deployment.name == deployment)
    if artifact_id is not None:
        stmt = stmt.where(Event.artifact_id == artifact_id)
    if job_id is not None:
        stmt = stmt.where(Event.job_id == job_id)
    if kinds is not None:
        stmt = stmt.where(Event.kind.in_([EventKind(k).value for k in kinds]))
    return [_record(event, name) for event, name in session.execute(stmt)]


def last_rollout_event(session: Session, deployment: Deployment, canary: str | None = None) -> EventRecord | None:
    """The deployment's latest rollout start, promote or abort (None before its first rollout); with canary, the
    latest that concerns that artifact (its start, its abort, its promotion), whatever rollouts came after."""
    kinds = (EventKind.ROLLOUT_START.value, EventKind.PROMOTE.value, EventKind.ABORT.value)
    events = session.scalars(sa.select(Event).where(Event.deployment_id == deployment.id, Event.kind.in_(kinds))
                             .order_by(Event.id.desc()).execution_options(yield_per=100))
    for event in events:
        record = _record(event, deployment.name)
        # a start or an abort names its canary; a promote, the canary it made the stable
        if canary is None or record.detail.get("stable" if record.kind is EventKind.PROMOTE else "canary") == canary:
            return record
    return None


def _record(event: Event, deployment_name: str | None) -> EventRecord:
    return EventRecord(
        id=event.id,
        at=event.at,
        kind=EventKind(event.kind),
        actor=event.actor,
        deployment=deployment_name,
        artifact_id=event.artifact_id,
        job_id=event.job_id,
        detail=MappingProxyType(json.loads(event.detail)),
    )

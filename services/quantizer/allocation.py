"""Claiming the artifact of a binding (model version, format, GPU target) for one job.

Two publishes of the same binding end with one artifact: the first job reserves it (PENDING) and
builds it; a second one waits for that job and adopts its result. A READY artifact is adopted at
once (services/quantizer/adoption.py checks that it answers the request); a FAILED one is taken back
to PENDING (a retry) by whichever job gets to it first, a waiting job included: the job it waited
for may have failed for its own request (a tighter budget) or been cancelled by its owner, and this
request deserves its own attempt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry import (
    Artifact,
    ArtifactState,
    Conflict,
    JobState,
    Model,
    ModelVersion,
    QuantJob,
    Registry,
    get_artifact,
    get_job,
    mark_artifact_failed,
    register_model_version,
    reserve_artifact,
    retry_artifact,
)

POLL_S = 0.5


@dataclass(slots=True, frozen=True)
class Claim:
    artifact_id: str
    object_prefix: str
    owned: bool  # True: this job builds it; False: it is READY already and this job adopts it


@dataclass(slots=True, frozen=True)
class Binding:
    model_name: str
    model_version: str  # content hash of the checkpoint
    version_label: str  # '' = none given
    format: str
    gpu_target: str


def claim_binding(
    registry: Registry,
    job_id: str,
    binding: Binding,
    *,
    actor: str,
    check: Callable[[], None],
    waiting: Callable[[str], None],
) -> Claim:
    """The artifact this job builds (owned) or adopts. `check` raises to abandon the wait (the quantizer
    is stopping); `waiting(job_id)` is told which job holds the binding when this one has to wait."""
    told = None
    while True:
        check()
        with registry.transaction() as session:
            claim, holder = _try_claim(session, job_id, binding, actor)
        if claim is not None:
            return claim
        if holder != told:
            waiting(holder)
            told = holder
        _wait_while_pending(registry, holder, check)  # then claimed again: READY adopted, FAILED retried


def model_version_row(session: Session, binding: Binding) -> ModelVersion:
    """The version with this content hash, registered (with the label, if given) when new. An existing
    version keeps the label of its first publish."""
    stmt = (
        sa.select(ModelVersion).join(Model)
        .where(Model.name == binding.model_name, ModelVersion.content_hash == binding.model_version)
    )
    existing = session.scalars(stmt).unique().one_or_none()
    if existing is not None:
        return existing
    try:
        return register_model_version(session, binding.model_name, binding.model_version,
                                      binding.version_label or None)
    except Conflict:
        # Registered meanwhile by another publish of the checkpoint with its label (PostgreSQL: that insert won):
        # as when it came first, the version keeps that label. A label naming another version stays refused.
        existing = session.scalars(stmt).unique().one_or_none()
        if existing is None:
            raise
        return existing


def _try_claim(session: Session, job_id: str, binding: Binding, actor: str) -> tuple[Claim | None, str | None]:
    """-> (claim, None), or (None, id of the job that holds the binding)."""
    version = model_version_row(session, binding)
    reservation = reserve_artifact(session, version.id, binding.format, binding.gpu_target, actor=actor)
    artifact = reservation.artifact
    if reservation.created:
        return _own(session, job_id, artifact), None
    # Locked before its state and its job are read: a job claiming it at the same time (PostgreSQL)
    # commits first, and this one then sees that job as the holder instead of taking it over too.
    artifact = get_artifact(session, artifact.id, for_update=True)
    if artifact.state == ArtifactState.READY:
        return Claim(artifact.id, artifact.object_prefix, owned=False), None
    if artifact.state == ArtifactState.FAILED:
        retry_artifact(session, artifact.id, actor=actor)
        return _own(session, job_id, artifact), None
    holder = _holder(session, artifact.id, job_id)
    if holder is None:  # PENDING with no live job: its job failed without settling it
        mark_artifact_failed(session, artifact.id, "left PENDING by a job that no longer runs", actor=actor)
        retry_artifact(session, artifact.id, actor=actor)
        return _own(session, job_id, artifact), None
    return None, holder


def _own(session: Session, job_id: str, artifact: Artifact) -> Claim:
    # Linked in the reserving transaction, so a PENDING artifact always has its job.
    get_job(session, job_id).artifact_id = artifact.id
    session.flush()
    return Claim(artifact.id, artifact.object_prefix, owned=True)


def _holder(session: Session, artifact_id: str, job_id: str) -> str | None:
    stmt = sa.select(QuantJob.id).where(
        QuantJob.artifact_id == artifact_id,
        QuantJob.state.in_((JobState.QUEUED, JobState.RUNNING)),
        QuantJob.id != job_id,
    )
    return session.scalars(stmt).first()


def _wait_while_pending(registry: Registry, holder_job_id: str, check: Callable[[], None]) -> None:
    """Waits for the holding job to end."""
    while True:
        check()
        with registry.sessions() as session:
            if get_job(session, holder_job_id).state not in (JobState.QUEUED, JobState.RUNNING):
                return
        time.sleep(POLL_S)

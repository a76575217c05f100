"""Artifacts: one per (model version, format, GPU target). States: PENDING -> READY | FAILED,
and FAILED -> PENDING for a retry. READY is final."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry._rows import (
    check_key,
    check_perplexity,
    check_segment,
    check_sha256,
    check_text,
    insert_or_get,
    locked,
    new_id,
)
from shared.registry.errors import InvalidState, InvalidValue, NotFound
from shared.registry.events import EventKind, append_event
from shared.registry.models import Artifact, ArtifactState, Model, ModelVersion, utcnow

_TRANSITIONS = {
    ArtifactState.PENDING: {ArtifactState.READY, ArtifactState.FAILED},
    ArtifactState.FAILED: {ArtifactState.PENDING},
    ArtifactState.READY: set(),
}
_ALLOWED = "PENDING -> READY, PENDING -> FAILED, FAILED -> PENDING (retry)"


@dataclass(frozen=True, slots=True)
class Reservation:
    artifact: Artifact
    created: bool  # False: the binding already had an artifact (in any state), returned as it is


def object_prefix(model: str, model_version: str, format: str, gpu: str, artifact_id: str) -> str:
    return f"{model}/{model_version}/{format}/{gpu}/{artifact_id}/"


def reserve_artifact(
    session: Session, model_version: ModelVersion | int, format: str, gpu: str, *, actor: str = "quantizer"
) -> Reservation:
    """The artifact of this binding, created PENDING if there is none. Two concurrent calls for the
    same binding (two processes, two connections) end with one row, which both get back."""
    check_segment("artifact format", format, 64)
    check_segment("GPU target", gpu, 64)
    version = _version(session, model_version)
    artifact_id = new_id()
    row = Artifact(
        id=artifact_id,
        model_version_id=version.id,
        format=format,
        gpu=gpu,
        state=ArtifactState.PENDING,
        object_prefix=object_prefix(version.model.name, version.content_hash, format, gpu, artifact_id),
    )
    artifact, created = insert_or_get(session, row, lambda: find_artifact(session, version.id, format, gpu))
    if created:
        append_event(
            session, EventKind.ARTIFACT_RESERVED, actor=actor, artifact_id=artifact.id,
            detail={"model": version.model.name, "model_version": version.content_hash, "format": format, "gpu": gpu},
        )
    return Reservation(artifact=artifact, created=created)


def get_artifact(session: Session, artifact_id: str, for_update: bool = False) -> Artifact:
    """The artifact; with for_update its row stays locked until the transaction ends (and is read
    after the commit of any transaction that held it)."""
    if for_update:
        return _lock(session, artifact_id)
    artifact = session.get(Artifact, check_key("artifact id", artifact_id))
    if artifact is None:
        raise NotFound(f"artifact {artifact_id!r} does not exist; `qctl ls` lists the registered artifacts")
    return artifact


def find_artifact(session: Session, model_version: ModelVersion | int, format: str, gpu: str) -> Artifact | None:
    version_id = model_version if isinstance(model_version, int) else model_version.id
    stmt = sa.select(Artifact).where(
        Artifact.model_version_id == version_id, Artifact.format == format, Artifact.gpu == gpu
    )
    return session.scalars(stmt).unique().one_or_none()


def find_ready_by_digest(session: Session, content_digest: str) -> Artifact | None:
    """The oldest READY artifact whose files have this content digest: their objects can be reused
    instead of uploading identical content again."""
    stmt = (
        sa.select(Artifact)
        .where(Artifact.content_digest == content_digest, Artifact.state == ArtifactState.READY)
        .order_by(Artifact.created_at, Artifact.id)
        .limit(1)
    )
    return session.scalars(stmt).unique().first()


def prefix_served_by_another(session: Session, artifact: Artifact) -> bool:
    """Whether a READY artifact other than this one points at this one's object prefix (reuse by digest):
    then those objects must stay whatever becomes of this artifact."""
    stmt = sa.select(Artifact.id).where(Artifact.object_prefix == artifact.object_prefix,
                                        Artifact.state == ArtifactState.READY, Artifact.id != artifact.id).limit(1)
    return session.scalars(stmt).first() is not None


def list_artifacts(
    session: Session, *, model: str | None = None, state: ArtifactState | None = None
) -> list[Artifact]:
    stmt = sa.select(Artifact).join(ModelVersion).join(Model).order_by(Artifact.created_at, Artifact.id)
    if model is not None:
        stmt = stmt.where(Model.name == model)
    if state is not None:
        stmt = stmt.where(Artifact.state == ArtifactState(state))
    return list(session.scalars(stmt).unique())


def mark_artifact_ready(
    session: Session,
    artifact_id: str,
    *,
    manifest_sha256: str,
    content_digest: str,
    actor: str = "quantizer",
    ppl_fp16: float | None = None,
    ppl_quant: float | None = None,
    eval_data: str | None = None,
    reuse_prefix_of: str | None = None,
    vocabulary_digest: str | None = None,
) -> Artifact:
    """PENDING -> READY. `reuse_prefix_of` names a READY artifact with the same content digest
    (see find_ready_by_digest) whose stored objects this artifact points to instead of a new upload.
    `vocabulary_digest`: sha256 of its tokenizer's id -> token table (Tokenizer.vocabulary_digest), which
    the arms of a deployment must share."""
    check_sha256("manifest sha256", manifest_sha256)
    if vocabulary_digest is not None:
        check_sha256("vocabulary digest", vocabulary_digest)
    check_text("content digest", content_digest, 128)
    if ppl_fp16 is not None or ppl_quant is not None or eval_data is not None:
        if ppl_fp16 is None or ppl_quant is None or eval_data is None:
            raise InvalidValue(
                f"evaluation (ppl_fp16={ppl_fp16!r}, ppl_quant={ppl_quant!r}, eval_data={eval_data!r}) is "
                f"incomplete: give both perplexities and the eval data name, or none of them"
            )
        check_perplexity("fp16 perplexity", ppl_fp16)
        check_perplexity("quantized perplexity", ppl_quant)
        check_text("eval data name", eval_data, 256)
    artifact = _lock(session, artifact_id)
    if reuse_prefix_of is not None:
        source = get_artifact(session, reuse_prefix_of)
        if source.state != ArtifactState.READY or source.content_digest != content_digest:
            raise InvalidValue(
                f"artifact {reuse_prefix_of!r} ({source.state.value}, content digest {source.content_digest!r}) "
                f"cannot lend its objects: reuse needs a READY artifact with content digest {content_digest!r}"
            )
        artifact.object_prefix = source.object_prefix
    _move(artifact, ArtifactState.READY)
    artifact.failure_reason = None
    artifact.manifest_sha256 = manifest_sha256
    artifact.content_digest = content_digest
    artifact.ppl_fp16, artifact.ppl_quant, artifact.eval_data = ppl_fp16, ppl_quant, eval_data
    artifact.vocabulary_digest = vocabulary_digest
    append_event(
        session, EventKind.ARTIFACT_READY, actor=actor, artifact_id=artifact.id,
        detail={"content_digest": content_digest, "object_prefix": artifact.object_prefix,
                "ppl_fp16": ppl_fp16, "ppl_quant": ppl_quant, "eval_data": eval_data},
    )
    session.flush()
    return artifact


def mark_artifact_failed(session: Session, artifact_id: str, reason: str, *, actor: str = "quantizer") -> Artifact:
    """PENDING -> FAILED, keeping the reason for `qctl ls` and a later retry."""
    check_text("failure reason", reason, 10_000)
    artifact = _lock(session, artifact_id)
    _move(artifact, ArtifactState.FAILED)
    artifact.failure_reason = reason
    append_event(session, EventKind.ARTIFACT_FAILED, actor=actor, artifact_id=artifact.id, detail={"reason": reason})
    session.flush()
    return artifact


def retry_artifact(session: Session, artifact_id: str, *, actor: str = "quantizer") -> Artifact:
    """FAILED -> PENDING, so that the binding can be published again."""
    artifact = _lock(session, artifact_id)
    previous_reason = artifact.failure_reason
    _move(artifact, ArtifactState.PENDING)
    artifact.failure_reason = None
    append_event(
        session, EventKind.ARTIFACT_RETRY, actor=actor, artifact_id=artifact.id,
        detail={"previous_reason": previous_reason},
    )
    session.flush()
    return artifact


def _move(artifact: Artifact, to: ArtifactState) -> None:
    if to not in _TRANSITIONS[artifact.state]:
        raise InvalidState(
            f"artifact {artifact.id} is {artifact.state.value} and cannot become {to.value}; "
            f"allowed transitions: {_ALLOWED}"
        )
    artifact.state = to
    artifact.updated_at = utcnow()


def _lock(session: Session, artifact_id: str) -> Artifact:
    check_key("artifact id", artifact_id)
    artifact = locked(session, sa.select(Artifact).where(Artifact.id == artifact_id), Artifact)
    if artifact is None:
        raise NotFound(f"artifact {artifact_id!r} does not exist; `qctl ls` lists the registered artifacts")
    return artifact


def _version(session: Session, model_version: ModelVersion | int) -> ModelVersion:
    version_id = model_version if isinstance(model_version, int) else model_version.id
    version = session.get(ModelVersion, version_id)
    if version is None:
        raise NotFound(f"model version id {version_id!r} does not exist; register it with register_model_version")
    return version

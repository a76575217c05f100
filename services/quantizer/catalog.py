"""Read-only questions about the registry: artifacts and models, as views."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from services.quantizer.errors import InvalidRequest
from services.quantizer.views import ArtifactDetails, ArtifactView, EvaluationView, ModelView, VersionView
from shared.formats.manifest import GPU_TARGETS, MANIFEST_NAME, Manifest
from shared.formats.spec import FORMATS
from shared.registry import Artifact, ArtifactState, Model, ModelVersion, Registry, get_artifact
from shared.storage import ObjectStore, StorageError

log = logging.getLogger(__name__)

Details = Callable[[str], ArtifactDetails | None]  # artifact id -> what this process knows beyond the registry


@dataclass(slots=True, frozen=True)
class ArtifactFilter:
    model_name: str = ""
    format: str = ""
    gpu_target: str = ""
    state: ArtifactState | None = None
    model_version: str = ""

    def __post_init__(self) -> None:
        _check_no_nul("model_name filter", self.model_name)
        _check_no_nul("model_version filter", self.model_version)
        if self.format and self.format not in FORMATS:
            raise InvalidRequest(f"format filter {self.format!r} is not a format; accepted: {', '.join(FORMATS)}")
        if self.gpu_target and self.gpu_target not in GPU_TARGETS:
            raise InvalidRequest(
                f"gpu_target filter {self.gpu_target!r} is not a GPU target; accepted: {', '.join(GPU_TARGETS)}"
            )


def artifact_view(registry: Registry, store: ObjectStore, artifact_id: str, details: Details) -> ArtifactView:
    """One artifact (raises the registry's NotFound). For a READY artifact this process did not publish,
    the size and eval window settings are read from its manifest in the store."""
    with registry.sessions() as session:
        row = get_artifact(session, artifact_id)  # with its model version and model (joined eagerly)
    # The store is read after the session ends: a slow store (an S3 GET may retry for minutes) must not
    # keep a registry transaction open meanwhile.
    known = details(artifact_id)
    if known is None and row.state == ArtifactState.READY:
        known = _details_from_store(store, row)
    return ArtifactView.from_row(row, known)


def artifact_views(registry: Registry, where: ArtifactFilter, details: Details) -> list[ArtifactView]:
    """Artifacts matching every set filter, newest first."""
    stmt = sa.select(Artifact).join(ModelVersion).join(Model).order_by(Artifact.created_at.desc(), Artifact.id)
    if where.model_name:
        stmt = stmt.where(Model.name == where.model_name)
    if where.format:
        stmt = stmt.where(Artifact.format == where.format)
    if where.gpu_target:
        stmt = stmt.where(Artifact.gpu == where.gpu_target)
    if where.state is not None:
        stmt = stmt.where(Artifact.state == where.state)
    if where.model_version:
        stmt = stmt.where(ModelVersion.content_hash == where.model_version)
    with registry.sessions() as session:
        return [ArtifactView.from_row(row, details(row.id)) for row in session.scalars(stmt).unique()]


def model_views(registry: Registry, model_name: str, details: Details) -> list[ModelView]:
    """Models by name, each with its versions newest first and every artifact of each version."""
    _check_no_nul("model_name filter", model_name)
    models = sa.select(Model).order_by(Model.name)
    if model_name:
        models = models.where(Model.name == model_name)
    with registry.sessions() as session:
        out = []
        for model in session.scalars(models):
            versions = session.scalars(
                sa.select(ModelVersion).where(ModelVersion.model_id == model.id)
                .order_by(ModelVersion.created_at.desc(), ModelVersion.id.desc())
            ).unique()
            out.append(ModelView(model.name, model.created_at, tuple(_version_view(session, v, details) for v in versions)))
        return out


def _version_view(session, version: ModelVersion, details: Details) -> VersionView:
    rows = session.scalars(
        sa.select(Artifact).where(Artifact.model_version_id == version.id).order_by(Artifact.created_at, Artifact.id)
    ).unique()
    return VersionView(version.content_hash, version.label, version.created_at,
                       tuple(ArtifactView.from_row(row, details(row.id)) for row in rows))


def _check_no_nul(what: str, value: str) -> None:
    # PostgreSQL refuses text holding NUL (a DataError, which no status maps) where SQLite finds no row:
    # refused here, the same on both.
    if "\x00" in value:
        raise InvalidRequest(f"{what} {value!r} is not accepted: it holds a NUL character")


def _details_from_store(store: ObjectStore, row: Artifact) -> ArtifactDetails | None:
    try:
        manifest = Manifest.from_json(store.get_bytes(row.object_prefix + MANIFEST_NAME).decode())
    except (StorageError, ValueError) as exc:  # the registry's record still answers
        log.warning("cannot read the manifest of artifact %s: %s", row.id, exc)
        return None
    evaluation = None
    if manifest.evaluation is not None:
        e = manifest.evaluation
        evaluation = EvaluationView(e.data_name, e.ppl_fp16, e.ppl_quantized, e.seq_len, e.windows)
    return ArtifactDetails(sum(f.size for f in manifest.files), evaluation)

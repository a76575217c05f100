"""Models and their versions. A version is the content hash of a source checkpoint plus a label."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.registry._rows import check_segment, insert_or_get
from shared.registry.errors import Conflict, NotFound
from shared.registry.models import Model, ModelVersion


def get_or_create_model(session: Session, name: str) -> Model:
    check_segment("model name", name)
    model, _ = insert_or_get(session, Model(name=name), lambda: _find_model(session, name))
    return model


def register_model_version(
    session: Session, model_name: str, content_hash: str, label: str | None = None
) -> ModelVersion:
    """Returns the version of `model_name` with this content hash, creating it (and the model) if new.
    `label` defaults to the first 12 characters of the hash; it must be unique within the model."""
    check_segment("model version content hash", content_hash)
    label_given = label is not None
    label = check_segment("model version label", label) if label_given else content_hash[:12]
    model = get_or_create_model(session, model_name)
    try:
        version, created = insert_or_get(
            session,
            ModelVersion(model_id=model.id, content_hash=content_hash, label=label),
            lambda: _find_version(session, model.id, ModelVersion.content_hash == content_hash),
        )
    except IntegrityError:
        taken = _find_version(session, model.id, ModelVersion.label == label)
        if taken is None:
            raise
        raise Conflict(
            f"label {label!r} of model {model_name!r} already names version {taken.content_hash!r}: "
            f"choose another label for {content_hash!r}"
        ) from None
    if not created and label_given and version.label != label:
        raise Conflict(
            f"model {model_name!r} version {content_hash!r} is already registered with label {version.label!r}, "
            f"not {label!r}: register it with label {version.label!r} or leave the label out"
        )
    return version


def get_model_version(session: Session, model_name: str, hash_or_label: str) -> ModelVersion:
    """Looks a version up by its content hash or its label."""
    stmt = (
        sa.select(ModelVersion)
        .join(Model)
        .where(Model.name == model_name)
        .where(sa.or_(ModelVersion.content_hash == hash_or_label, ModelVersion.label == hash_or_label))
    )
    version = session.scalars(stmt).unique().first()
    if version is None:
        known = [f"{v.label} ({v.content_hash})" for v in list_model_versions(session, model_name)]
        raise NotFound(
            f"model {model_name!r} has no version with hash or label {hash_or_label!r}; "
            f"registered versions: {', '.join(known) or 'none'}"
        )
    return version


def list_model_versions(session: Session, model_name: str) -> list[ModelVersion]:
    stmt = sa.select(ModelVersion).join(Model).where(Model.name == model_name).order_by(ModelVersion.id)
    return list(session.scalars(stmt).unique())


def _find_model(session: Session, name: str) -> Model | None:
    return session.scalars(sa.select(Model).where(Model.name == name)).unique().one_or_none()


def _find_version(session: Session, model_id: int, where: sa.ColumnElement[bool]) -> ModelVersion | None:
    stmt = sa.select(ModelVersion).where(ModelVersion.model_id == model_id, where)
    return session.scalars(stmt).unique().one_or_none()

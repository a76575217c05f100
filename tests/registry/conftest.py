"""Every registry test runs on a SQLite file and on PostgreSQL (a fresh schema per test)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from shared.registry import (
    Artifact,
    ModelVersion,
    Registry,
    create_registry,
    mark_artifact_ready,
    register_model_version,
    reserve_artifact,
    sqlite_url,
)
from tests.conftest import fresh_postgres_schema

@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_url(tmp_path / "registry.db")
        return
    with fresh_postgres_schema("test_registry") as url:
        yield url


@pytest.fixture
def registry(db_url: str) -> Iterator[Registry]:
    registry = create_registry(db_url)
    yield registry
    registry.close()


@pytest.fixture
def session(registry: Registry) -> Iterator[Session]:
    """A session that may write (registry.sessions() only reads), never committed."""
    with registry.writes() as session:
        yield session


@pytest.fixture
def version(registry: Registry) -> ModelVersion:
    """A committed model version, so that other connections (threads) see it."""
    with registry.transaction() as session:
        return register_model_version(session, "tiny-llama", "a" * 64, label="v1")


@pytest.fixture
def make_ready(version: ModelVersion) -> Callable[..., Artifact]:
    """Reserves the binding (format, gpu) and marks it READY with the given content digest."""

    def make(session: Session, format: str, gpu: str = "sm90", digest: str | None = None) -> Artifact:
        artifact = reserve_artifact(session, version.id, format, gpu).artifact
        return mark_artifact_ready(
            session, artifact.id, manifest_sha256="b" * 64, content_digest=digest or uuid.uuid4().hex, actor="test"
        )

    return make

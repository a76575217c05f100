"""A later migration that alters a table other rows refer to (a new artifact column with a constraint,
a new job state in a CHECK) must upgrade a registry in use. SQLite alters such a table by rebuilding
it (alembic batch mode: copy, drop the old table, rename the copy); with foreign keys enforced the
drop failed with 'FOREIGN KEY constraint failed' as soon as a deployment, job or event referred to
an artifact. Tested with a migration written for the test, on top of the real ones."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa

from shared.registry import (
    InvalidState,
    create_deployment,
    create_job,
    create_registry,
    current_revision,
    get_deployment,
    head_revision,
    list_events,
    mark_artifact_ready,
    register_model_version,
    reserve_artifact,
    sqlite_url,
)
from shared.registry import migrate
from shared.registry.db import make_engine

REBUILD_ARTIFACTS = '''
import sqlalchemy as sa
from alembic import op

revision = "test_rebuild"
down_revision = {down!r}
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A new CHECK: SQLite cannot add one in place, so batch mode rebuilds the table there.
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("size_bytes", sa.BigInteger, nullable=True))
        batch.create_check_constraint("ck_artifacts_size_bytes", "size_bytes IS NULL OR size_bytes > 0")
{extra}

def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_constraint("ck_artifacts_size_bytes", type_="check")
        batch.drop_column("size_bytes")
'''


def _with_test_migration(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, extra: str = "") -> None:
    """The shipped migrations plus one that rebuilds `artifacts`, as the migrations folder."""
    folder = tmp_path / "migrations"
    shutil.copytree(migrate.MIGRATIONS_DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "versions" / "test_rebuild.py").write_text(REBUILD_ARTIFACTS.format(down=head_revision(), extra=extra))
    monkeypatch.setattr(migrate, "MIGRATIONS_DIR", folder)


def _registry_in_use(url: str) -> str:
    """A registry at the shipped head whose artifact a deployment, a job and events refer to."""
    registry = create_registry(url)
    try:
        with registry.transaction() as session:
            version = register_model_version(session, "tiny-llama", "a" * 64, label="v1")
            artifact = reserve_artifact(session, version, "fp16", "sm90").artifact
            mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest="d")
            create_deployment(session, "chat", stable_artifact_id=artifact.id, actor="alice")
            create_job(session, owner="host:1:boot", artifact_id=artifact.id)
            return artifact.id
    finally:
        registry.close()


def test_a_migration_rebuilding_a_referenced_table_upgrades_a_registry_in_use(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    artifact_id = _registry_in_use(db_url)
    _with_test_migration(monkeypatch, tmp_path)

    registry = create_registry(db_url)  # a service of the newer version starting: migrates
    try:
        assert current_revision(registry.engine) == "test_rebuild"
        with registry.transaction() as session:
            assert get_deployment(session, "chat").stable_artifact_id == artifact_id
            assert len(list_events(session, artifact_id=artifact_id)) == 3  # reserved, ready, job queued
            # foreign keys are enforced again on the connections the registry goes on with
            with pytest.raises(sa.exc.IntegrityError), session.begin_nested():
                session.execute(sa.text("UPDATE deployments SET stable_artifact_id = 'missing'"))
    finally:
        registry.close()


def test_a_migration_leaving_dangling_references_is_rolled_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite only: PostgreSQL refuses the DELETE itself. With foreign keys off during migrations,
    the check at the end is what keeps a broken migration from committing."""
    url = sqlite_url(tmp_path / "registry.db")
    _registry_in_use(url)
    shipped_head = head_revision()
    _with_test_migration(monkeypatch, tmp_path, extra='    op.execute("DELETE FROM artifacts")\n')

    with pytest.raises(InvalidState, match=r"would leave \d+ row\(s\) referring to missing rows .*nothing was changed"):
        create_registry(url)
    engine = make_engine(url)
    try:
        assert current_revision(engine) == shipped_head
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM artifacts")).scalar() == 1
    finally:
        engine.dispose()

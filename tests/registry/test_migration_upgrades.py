"""Upgrading a registry that holds rows: from every revision, written at that revision's schema, to
head, keeping every row and ending in the schema models.py declares; and refusing, with the
registry's own error, a database these migrations did not make (a newer revision, stray tables)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from shared.registry import (
    ArtifactState,
    EventKind,
    InvalidState,
    create_registry,
    current_revision,
    get_artifact,
    get_deployment,
    head_revision,
    list_events,
    promote,
    upgrade,
)
from shared.registry.db import make_engine
from shared.registry.migrate import alembic_config
from shared.registry.models import Base

T0 = datetime(2025, 12, 1, 12, 0, tzinfo=timezone.utc)
STABLE, CANARY, BASELINE, FAILED, PENDING, JOB, CANCELLED_JOB, CANCELLING_JOB = (c * 32 for c in "scbfpjkl")


def _insert(conn: sa.Connection, table: str, **row: object) -> int | None:
    """Inserts through the table as the database has it at this revision; returns the new id."""
    reflected = sa.Table(table, sa.MetaData(), autoload_with=conn)
    result = conn.execute(reflected.insert().values(**row))
    return result.inserted_primary_key[0] if result.inserted_primary_key else None


def _artifact(conn: sa.Connection, artifact_id: str, version_id: int, format: str, state: str, **extra) -> None:
    _insert(conn, "artifacts", id=artifact_id, model_version_id=version_id, format=format, gpu="sm90", state=state,
            object_prefix=f"tiny-llama/{'a' * 64}/{format}/sm90/{artifact_id}/", created_at=T0, updated_at=T0,
            **extra)


def _seed_0001(conn: sa.Connection) -> None:
    """A registry in use: a rollout at 10 %, a failed and a running publish, the events of it all."""
    model = _insert(conn, "models", name="tiny-llama", created_at=T0)
    version = _insert(conn, "model_versions", model_id=model, content_hash="a" * 64, label="v1", created_at=T0)
    ready = {"manifest_sha256": "e" * 64, "ppl_fp16": 5.012, "ppl_quant": 5.2, "eval_data": "pystdlib-eval"}
    _artifact(conn, STABLE, version, "w4a8kv4-g128", "READY", content_digest="d1", **ready)
    _artifact(conn, CANARY, version, "w4a8kv4-chn", "READY", content_digest="d2", **ready)
    _artifact(conn, BASELINE, version, "fp16", "READY", content_digest="d3", manifest_sha256="e" * 64)
    _artifact(conn, FAILED, version, "w4a8kv4-g64", "FAILED", failure_reason="CUDA out of memory")
    _artifact(conn, PENDING, version, "w4a8kv4-g32", "PENDING")
    _insert(conn, "quant_jobs", id=JOB, state="RUNNING", stage="calibrate", block_index=2, block_count=6,
            artifact_id=PENDING, owner="host-a:101:boot1", heartbeat_at=T0, created_at=T0, started_at=T0,
            updated_at=T0)
    deployment = _insert(conn, "deployments", name="chat", stable_artifact_id=STABLE, canary_artifact_id=CANARY,
                         canary_percent=10, baseline_artifact_id=BASELINE, fallback=False, revision=2,
                         created_at=T0, updated_at=T0)
    _insert(conn, "events", at=T0, kind="deployment_create", deployment_id=deployment, actor="alice",
            detail=f'{{"baseline": "{BASELINE}", "revision": 1, "stable": "{STABLE}"}}')
    _insert(conn, "events", at=T0, kind="rollout_start", deployment_id=deployment, actor="alice",
            detail=f'{{"canary": "{CANARY}", "percent": 10, "revision": 2, "stable": "{STABLE}"}}')
    _insert(conn, "events", at=T0, kind="artifact_failed", artifact_id=FAILED, actor="quantizer",
            detail='{"reason": "CUDA out of memory"}')
    _insert(conn, "events", at=T0, kind="job_started", job_id=JOB, artifact_id=PENDING, actor="host-a:101:boot1",
            detail="{}")


def _seed_0002(conn: sa.Connection) -> None:
    """As at 0001, plus a cancelled job and a running one an operator asked to stop."""
    _seed_0001(conn)
    for job_id, state, requested in ((CANCELLED_JOB, "CANCELLED", None), (CANCELLING_JOB, "RUNNING", T0)):
        _insert(conn, "quant_jobs", id=job_id, state=state, block_index=0, block_count=0, owner="host-a:101:boot1",
                model_name="tiny-llama", heartbeat_at=T0, created_at=T0, updated_at=T0, cancel_requested_at=requested,
                cancel_reason="cancelled by alice: wrong checkpoint",
                error="cancelled by alice: wrong checkpoint" if state == "CANCELLED" else None)


def _seed_0003(conn: sa.Connection) -> None:
    """As at 0002, plus an artifact that records its vocabulary digest."""
    _seed_0002(conn)
    version = conn.execute(sa.text("SELECT id FROM model_versions")).scalar_one()
    _artifact(conn, "v" * 32, version, "w4a8kv4-g16", "READY", content_digest="d4", manifest_sha256="e" * 64,
              vocabulary_digest="0" * 64)


def _seed_0004(conn: sa.Connection) -> None:
    """As at 0003, plus a gateway replica's report of a second."""
    _seed_0003(conn)
    _insert(conn, "arm_reports", gateway_id="g" * 32, deployment="chat", artifact_id=CANARY, second=1764590400,
            requests=3, errors=1, tpot_counts='{"120": 2}')


def _seed_0005(conn: sa.Connection) -> None:
    """As at 0004, plus a report with times to the first token."""
    _seed_0004(conn)
    _insert(conn, "arm_reports", gateway_id="g" * 32, deployment="chat", artifact_id=CANARY, second=1764590401,
            requests=2, errors=0, tpot_counts='{"120": 2}', ttft_counts='{"35": 2}')


# Rows written at each revision with that revision's schema. A new migration adds its own entry
# (test_every_revision_has_seed_rows says so), so that an upgrade from it is tested with data too.
SEEDS: dict[str, Callable[[sa.Connection], None]] = {"0001": _seed_0001, "0002": _seed_0002, "0003": _seed_0003,
                                                        "0004": _seed_0004, "0005": _seed_0005}


def _revisions() -> list[str]:
    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def _rows(engine: sa.Engine) -> dict[str, list[dict]]:
    with engine.connect() as conn:
        tables = sa.MetaData()
        names = {t.name for t in Base.metadata.sorted_tables}
        tables.reflect(conn, only=lambda name, _: name in names)  # those this revision has
        return {
            name: [dict(r._mapping) for r in conn.execute(sa.select(t).order_by(*t.primary_key.columns))]
            for name, t in tables.tables.items()
        }


def test_every_revision_has_seed_rows() -> None:
    assert list(SEEDS) == _revisions()


@pytest.mark.parametrize("revision", _revisions())
def test_an_upgrade_from_a_revision_holding_rows_keeps_them_and_reaches_the_models_schema(
    db_url: str, revision: str
) -> None:
    engine = make_engine(db_url)
    try:
        upgrade(engine, revision)
        with engine.begin() as conn:
            SEEDS[revision](conn)
        before = _rows(engine)
        upgrade(engine)
        assert current_revision(engine) == head_revision()
        after = _rows(engine)
        for table, rows in before.items():  # a later migration may add columns, never lose a value
            assert [{c: row[c] for c in rows[0]} for row in after[table]] == rows, table
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"after upgrading from {revision}, models.py and the schema disagree: {diff}"
        with pytest.raises(sa.exc.DatabaseError, match="events are append-only"), engine.begin() as conn:
            conn.execute(sa.text("UPDATE events SET actor = 'mallory'"))
    finally:
        engine.dispose()
    _assert_the_repository_carries_on(db_url)


def _assert_the_repository_carries_on(db_url: str) -> None:
    registry = create_registry(db_url, migrate_to_head=False)
    try:
        with registry.transaction() as session:
            assert get_artifact(session, PENDING).state == ArtifactState.PENDING
            assert get_deployment(session, "chat").canary_percent == 10
            promoted = promote(session, "chat", actor="bob")  # new ids come after the seeded ones
        with registry.sessions() as session:
            events = list_events(session, deployment="chat")
            assert [e.kind for e in events] == [EventKind.DEPLOYMENT_CREATE, EventKind.ROLLOUT_START, EventKind.PROMOTE]
            assert [e.detail["revision"] for e in events] == [1, 2, 3] and promoted.stable_artifact_id == CANARY
    finally:
        registry.close()


def _set_revision(db_url: str, revision: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision})
    finally:
        engine.dispose()


def test_upgrade_refuses_a_database_of_a_newer_revision(db_url: str) -> None:
    create_registry(db_url).close()
    _set_revision(db_url, "9999_from_the_future")
    with pytest.raises(InvalidState, match="'9999_from_the_future'.*newer version"):
        upgrade(db_url)


def test_a_schema_another_applications_migrations_keep_is_refused_as_such(db_url: str) -> None:
    """Its alembic revision read as one of a newer qserve: the operator went looking for a release that does not
    exist instead of giving the registry a schema of its own."""
    create_registry(db_url).close()
    _set_revision(db_url, "3f1c2a9b7d41")
    with pytest.raises(InvalidState, match="another application's schema revision '3f1c2a9b7d41'"):
        upgrade(db_url)


def test_a_database_with_registry_tables_but_no_revision_is_refused(db_url: str) -> None:
    # e.g. made by metadata.create_all: migrating it would fail half-way on "table already exists",
    # and stamping it would trust a schema without triggers or named constraints.
    engine = make_engine(db_url)
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()
    with pytest.raises(InvalidState, match="has registry tables .* but no schema revision"):
        create_registry(db_url)
    with pytest.raises(InvalidState, match="has registry tables .* but no schema revision"):
        upgrade(db_url)


def _open_together(url: str) -> list[BaseException]:
    """Two services opening the registry at `url` at the same moment; what each raised."""
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def start() -> None:
        try:
            barrier.wait(timeout=10)
            create_registry(url).close()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return errors


def test_services_starting_together_migrate_an_empty_database_once(db_url: str) -> None:
    errors = _open_together(db_url)
    assert not errors, errors
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_services_opening_a_new_sqlite_registry_together_never_see_it_locked(tmp_path) -> None:
    """Both switch a new file's journal mode to WAL at connect; the loser's switch failed at once with
    'database is locked' (about one start in 25-60 on 2 cores) instead of waiting for the winner."""
    for attempt in range(40):
        errors = _open_together(f"sqlite:///{tmp_path}/registry-{attempt}.db")
        assert not errors, (attempt, errors)


@pytest.mark.postgres
def test_a_start_waits_for_another_services_migration_past_the_lock_bound(monkeypatch) -> None:
    """The migration lock was taken under the connection's lock bound (30 s): a service starting while another's
    migration ran longer (an ALTER TABLE queued behind a long transaction) failed on a lock timeout."""
    from shared.registry import db
    from shared.registry.migrate import _PG_MIGRATION_LOCK
    from tests.conftest import fresh_postgres_schema

    monkeypatch.setattr(db, "LOCK_WAIT_S", 1.0)  # the bound, scaled down: the other migration takes 2.5 s
    with fresh_postgres_schema("test_migration_wait") as url:
        other = sa.create_engine(url)
        held, release = threading.Event(), threading.Event()

        def another_services_migration() -> None:
            with other.connect() as conn, conn.begin():
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
                held.set()
                release.wait(2.5)

        migrating = threading.Thread(target=another_services_migration)
        migrating.start()
        try:
            assert held.wait(10)
            upgrade(url)  # waits for it, then migrates
        finally:
            release.set()
            migrating.join(10)
            other.dispose()
        engine = make_engine(url)
        try:
            assert current_revision(engine) == head_revision()
        finally:
            engine.dispose()

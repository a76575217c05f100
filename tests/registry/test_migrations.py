from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from shared.registry import (
    InvalidState,
    InvalidValue,
    create_registry,
    current_revision,
    downgrade,
    head_revision,
    sqlite_url,
    upgrade,
)
from shared.registry.db import make_engine
from shared.registry.migrate import alembic_config
from shared.registry.models import Base
from shared.registry.urls import shown_url
from tests.registry.test_migration_rebuilds import _registry_in_use

TABLES = {"models", "model_versions", "artifacts", "quant_jobs", "deployments", "events"}


def test_upgrade_from_empty_reaches_head_and_matches_the_models(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) is None
        upgrade(engine)
        assert current_revision(engine) == head_revision()
        assert TABLES <= set(sa.inspect(engine).get_table_names())
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        assert diff == [], f"models.py and the migrations disagree: {diff}"
    finally:
        engine.dispose()


def test_upgrade_twice_is_harmless_and_downgrade_round_trips(db_url: str) -> None:
    upgrade(db_url)
    upgrade(db_url)
    engine = make_engine(db_url)
    try:
        downgrade(engine, "base")
        assert not TABLES & set(sa.inspect(engine).get_table_names())
        upgrade(engine)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_opening_without_migrating_refuses_an_old_schema(db_url: str) -> None:
    upgrade(db_url, "0001")
    with pytest.raises(InvalidState) as raised:
        create_registry(db_url, migrate_to_head=False)
    # Said to an operator (a worker's --registry-url), not in terms of a Python keyword.
    message = str(raised.value)
    assert f"schema revision '0001', this code needs '{head_revision()}': start the quantizer or the gateway" in message
    assert "check --registry-url" in message and "migrate_to_head" not in message
    create_registry(db_url).close()
    create_registry(db_url, migrate_to_head=False).close()


def test_opening_without_migrating_creates_nothing_at_a_missing_sqlite_path(tmp_path: Path) -> None:
    # A worker's mistyped --registry-url: before, its folders and an empty database were created there
    # (which a gateway or quantizer started with the same typo would then have served).
    typo = tmp_path / "var" / "qserv" / "registry.db"
    with pytest.raises(InvalidValue, match=re.escape(f"there is no SQLite database at '{typo}'; check --registry-url")):
        create_registry(sqlite_url(typo), migrate_to_head=False)
    with pytest.raises(InvalidValue, match="there is no SQLite database"):
        downgrade(sqlite_url(typo), "0001")
    assert not (tmp_path / "var").exists()


def _counts(db_url: str) -> dict[str, int]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return {table: conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one() for table in TABLES}
    finally:
        engine.dispose()


BELOW_HEAD = [r.revision for r in ScriptDirectory.from_config(alembic_config()).walk_revisions()][1:]


@pytest.mark.parametrize("target", BELOW_HEAD)
def test_a_registry_in_use_downgrades_keeping_its_rows_and_upgrades_again(db_url: str, target: str) -> None:
    # Before: on SQLite the downgrades that rebuild artifacts or quant_jobs (batch mode: copy, drop, rename)
    # failed with 'FOREIGN KEY constraint failed', foreign keys being enforced while the old table was dropped.
    _registry_in_use(db_url)
    before = _counts(db_url)
    downgrade(db_url, target)
    engine = make_engine(db_url)
    try:
        assert current_revision(engine) == target
    finally:
        engine.dispose()
    assert _counts(db_url) == before
    upgrade(db_url)
    assert _counts(db_url) == before


@pytest.mark.parametrize(
    "url, expected",
    [("mysql://u@h/db", "backend 'mysql' is not supported"), ("sqlite://", "in-memory SQLite"),
     # In URI form too: a registry that vanished when its last connection closed, accepted.
     ("sqlite:///file::memory:?cache=shared&uri=true", "in-memory SQLite"),
     ("sqlite:///file:reg?mode=memory&cache=shared&uri=true", "in-memory SQLite"),
     # Drivers that are not dependencies: a traceback of every service on the missing module.
     ("postgresql+psycopg2://u@127.0.0.1/db", "driver 'postgresql\\+psycopg2' is not supported"),
     ("sqlite+aiosqlite:////tmp/x.db", "driver 'sqlite\\+aiosqlite' is not supported")],
)
def test_unsupported_urls_say_what_is_accepted(url: str, expected: str) -> None:
    with pytest.raises(InvalidValue, match=expected):
        make_engine(url)


def test_a_password_in_the_url_query_is_never_shown() -> None:
    """libpq takes ?password= as well as user:password@; only the latter was masked in the services' errors."""
    with pytest.raises(InvalidValue) as refused:
        make_engine("postgresql+psycopg2://u@127.0.0.1/db?password=S3cret&sslpassword=K3y")
    assert "S3cret" not in str(refused.value) and "K3y" not in str(refused.value)
    assert shown_url("postgresql://u:S3cret@h/db?password=S3cret&sslmode=require") == \
        "postgresql://u:***@h/db?sslmode=require"


def test_a_sqlite_path_under_the_home_folder_is_expanded(tmp_path, monkeypatch) -> None:
    """sqlite3 made a folder named '~' in the working directory and the registry in it."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    engine = make_engine("sqlite:///~/qserve/registry.db")
    try:
        with engine.connect():
            pass
    finally:
        engine.dispose()
    assert (tmp_path / "home" / "qserve" / "registry.db").is_file() and not (tmp_path / "~").exists()

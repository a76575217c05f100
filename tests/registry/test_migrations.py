from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from shared.registry import InvalidState, InvalidValue, create_registry, current_revision, head_revision, upgrade
from shared.registry.db import make_engine
from shared.registry.migrate import alembic_config
from shared.registry.models import Base

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
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        assert not TABLES & set(sa.inspect(engine).get_table_names())
        upgrade(engine)
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_opening_without_migrating_refuses_an_old_schema(db_url: str) -> None:
    with pytest.raises(InvalidState, match=f"schema revision None, this code needs '{head_revision()}'"):
        create_registry(db_url, migrate_to_head=False)
    create_registry(db_url).close()
    create_registry(db_url, migrate_to_head=False).close()


@pytest.mark.parametrize(
    "url, expected",
    [("mysql://u@h/db", "backend 'mysql' is not supported"), ("sqlite://", "in-memory SQLite")],
)
def test_unsupported_urls_say_what_is_accepted(url: str, expected: str) -> None:
    with pytest.raises(InvalidValue, match=expected):
        make_engine(url)

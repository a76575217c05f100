"""Alembic, configured from code so that migrations run from an installed package (no alembic.ini).

    upgrade("sqlite:///var/registry.db")          # to head
    upgrade(engine, "0001")                       # to a given revision
    revision(engine, "add artifact size")         # developers: autogenerate a new version file
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant: serializes concurrent upgrades of one PostgreSQL database (two services starting).
_PG_MIGRATION_LOCK = 0x5153_5256  # "QSRV"


def alembic_config(connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, f"no migration found under {MIGRATIONS_DIR}"
    return head


def current_revision(engine: sa.Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(url_or_engine: str | sa.Engine, target: str = "head") -> None:
    """Migrates the database to `target` (default head), creating the schema on an empty database."""
    from shared.registry.db import make_engine  # db imports this module

    owned = isinstance(url_or_engine, str)
    engine = make_engine(url_or_engine) if owned else url_or_engine
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            command.upgrade(alembic_config(conn), target)
    finally:
        if owned:
            engine.dispose()


def revision(engine: sa.Engine, message: str, autogenerate: bool = True) -> None:
    """Writes a new file under migrations/versions, diffing the models against a database at head."""
    with engine.begin() as conn:
        command.revision(alembic_config(conn), message=message, autogenerate=autogenerate)

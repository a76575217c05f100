"""Alembic, configured from code so that migrations run from an installed package (no alembic.ini).

    upgrade("sqlite:///var/registry.db")            # to head
    upgrade(engine, "0001")                         # to a given revision
    downgrade("sqlite:///var/registry.db", "0004")  # back to a revision, to run an older release against it
    revision(engine, "add artifact size")           # developers: autogenerate a new version file

Migrate through these functions, not the alembic command line (migrations/env.py refuses it): they hold
the migration lock and handle SQLite's foreign keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError

from shared.registry.errors import InvalidState
from shared.registry.models import Base
from shared.registry.urls import shown_url

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any constant: serializes concurrent upgrades of one PostgreSQL database (two services starting).
_PG_MIGRATION_LOCK = 0x5153_5256  # "QSRV"
MIGRATION_WAIT_S = 600.0  # how long a start waits for another service's migration (PostgreSQL)


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


def _known_revision(revision: str) -> bool:
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(revision) is not None
    except CommandError:
        return False


def refuse_unknown_schema(conn: sa.Connection) -> None:
    """Refuses a database these migrations cannot take further: one a newer version migrated (alembic
    would fail on the revision it cannot locate) and one holding registry tables without a revision
    (made some other way: creating the tables again fails half-way, and its constraints and triggers
    are not the migrations')."""
    where = f"registry at {shown_url(conn.engine.url)!r}"
    current = MigrationContext.configure(conn).get_current_revision()
    if current is not None and not re.fullmatch(r"\d{4}(?:_\w+)?", current):  # ours: 0001, 0002, ...
        raise InvalidState(
            f"{where} holds another application's schema revision {current!r} (alembic_version): give the "
            f"registry a database or schema of its own, e.g. ?options=-csearch_path%3Dqserve on PostgreSQL"
        )
    if current is not None and not _known_revision(current):
        raise InvalidState(
            f"{where} is at schema revision {current!r}, which this code (head {head_revision()!r}) does not "
            f"know: a newer version of qserve-stack migrated it; run that version"
        )
    if current is None:
        stray = sorted(set(Base.metadata.tables) & set(sa.inspect(conn).get_table_names()))
        if stray:
            raise InvalidState(
                f"{where} has registry tables ({', '.join(stray)}) but no schema revision (no alembic_version "
                f"row): these migrations did not create it; point the registry URL at an empty database or "
                f"one qserve-stack created"
            )


def upgrade(url_or_engine: str | sa.Engine, target: str = "head") -> None:
    """Migrates the database to `target` (default head), creating the schema on an empty database."""
    _migrate(url_or_engine, target, command.upgrade, create=True)


def downgrade(url_or_engine: str | sa.Engine, target: str) -> None:
    """Migrates the database back to `target` (a revision such as "0004", or "base": no registry tables),
    so that an older release can run against it. What the later revisions added is dropped (each version's
    downgrade() says how). Stop the services first: the code of this version needs head. Not dropped: events of
    kinds the older release does not know (the events table is append-only; its event listing refuses them), and
    what a dropped column meant (below 0002, a cancel asked for a running job is forgotten: let jobs end first)."""
    _migrate(url_or_engine, target, command.downgrade, create=False)


def _migrate(url_or_engine: str | sa.Engine, target: str, step: Callable[[Config, str], None], create: bool) -> None:
    """One alembic step in one transaction: under PostgreSQL's advisory lock, with SQLite's foreign keys
    off (downgrades rebuild tables too) and the references checked before the commit."""
    from shared.registry.db import LOCK_WAIT_S, make_engine  # db imports this module

    owned = isinstance(url_or_engine, str)
    engine = make_engine(url_or_engine, create=create) if owned else url_or_engine
    try:
        with engine.connect() as conn, _sqlite_foreign_keys_off(conn), conn.begin():
            if conn.dialect.name == "postgresql":
                # Another service migrating holds it as long as its migration takes (an ALTER TABLE queued behind
                # a long transaction): waited for up to MIGRATION_WAIT_S, not the connection's 30 s lock bound,
                # which failed this start; then the bound again for the migration's own statements.
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {round(1000 * MIGRATION_WAIT_S)}")
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {round(1000 * LOCK_WAIT_S)}")
            refuse_unknown_schema(conn)  # under the lock: what another process migrated meanwhile counts
            step(alembic_config(conn), target)
            _refuse_dangling_references(conn, target)
    finally:
        if owned:
            engine.dispose()


@contextmanager
def _sqlite_foreign_keys_off(conn: sa.Connection) -> Iterator[None]:
    """SQLite alters a table by rebuilding it (alembic batch mode: copy, drop the old, rename the copy),
    and with foreign keys enforced, dropping a table that other rows refer to fails: any migration (up
    or down) that alters artifacts, jobs, versions or deployments would fail with 'FOREIGN KEY
    constraint failed' on every registry in use. SQLite's own recipe for such changes: foreign keys off
    around the transaction, checked before it commits (_refuse_dangling_references), on again after. The pragma
    does nothing inside a transaction, hence on the driver connection, before BEGIN."""
    if conn.dialect.name != "sqlite":
        yield
        return
    driver = conn.connection.driver_connection
    driver.execute("PRAGMA foreign_keys = OFF")
    try:
        yield
    finally:  # the connection goes back to the pool, and the registry's sessions rely on the checks
        driver.execute("PRAGMA foreign_keys = ON")


def _refuse_dangling_references(conn: sa.Connection, target: str) -> None:
    """What SQLite did not check while the migrations ran with foreign keys off, checked at the end,
    before the commit: a migration that left a row referring to a missing one is rolled back whole."""
    if conn.dialect.name != "sqlite":
        return  # PostgreSQL checked every statement
    dangling = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
    if dangling:
        shown = ", ".join(f"{table} row {rowid} -> {parent}" for table, rowid, parent, _ in dangling[:5])
        raise InvalidState(
            f"migrating the registry at {shown_url(conn.engine.url)!r} to {target!r} "
            f"would leave {len(dangling)} row(s) referring to missing rows ({shown}); nothing was changed"
        )


def revision(engine: sa.Engine, message: str, autogenerate: bool = True) -> None:
    """Writes a new file under migrations/versions, diffing the models against a database at head."""
    with engine.begin() as conn:
        command.revision(alembic_config(conn), message=message, autogenerate=autogenerate)

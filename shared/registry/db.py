"""Engines and sessions from a URL: a SQLite file by default, PostgreSQL (psycopg 3) by URL.

    registry = create_registry("sqlite:///var/qserve/registry.db")   # migrates to head
    with registry.transaction() as session:                          # commits on success
        reserve_artifact(session, version, "w4a8kv4-g128", "sm90")
    with registry.sessions() as session:                             # reads only
        get_artifact(session, artifact_id)

A lock another transaction holds is waited for at most LOCK_WAIT_S (a transaction may ask for less), on both
backends; then the statement fails with an OperationalError, as when the database cannot be reached.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from shared.registry import migrate
from shared.registry.errors import InvalidState, InvalidValue
from shared.registry.urls import shown_url

_ACCEPTED_URLS = "sqlite:///path/to/registry.db or postgresql+psycopg://user@host:5432/dbname"
# PostgreSQL waits for a row lock (SELECT ... FOR UPDATE) without limit by default: a session left open in
# psql, or a paused process mid-transaction, held every writer (and a gateway's threads) for good.
LOCK_WAIT_S = 30.0
# Execution option: this transaction's own bound on lock waits, in seconds (Registry.transaction(lock_wait_s)).
_LOCK_WAIT = "qserve_registry_lock_wait_s"
# Execution option of the engine behind Registry.sessions: its transactions only read (see _on_begin).
_READ_ONLY = "qserve_registry_read_only"


def sqlite_url(path: str | Path) -> str:
    """The URL of a SQLite file; '?' and '%' in the path are escaped (pasted as they are, `qctl up --workdir
    'demo?a'` opened the file `demo`, beside the folder, and shared it with every `demo?...`)."""
    return sa.URL.create("sqlite", database=str(Path(path).expanduser().resolve())).render_as_string()


# The drivers this code is built and tested with (psycopg 3, the standard library's sqlite3): another named in
# the URL (psycopg2, asyncpg, aiosqlite) failed on its missing module with a traceback of every service.
_DRIVERS = {"sqlite": ("sqlite", "sqlite+pysqlite"), "postgresql": ("postgresql", "postgresql+psycopg")}

def make_engine(url: str, *, create: bool = True) -> sa.Engine:
    """With create=False a SQLite file that does not exist is refused (InvalidValue) instead of created."""
    try:
        parsed = sa.make_url(url)
    except ValueError as exc:  # a port that is not a number: int()'s words, as a traceback of every service
        raise InvalidValue(f"the registry URL cannot be parsed ({exc}); use {_ACCEPTED_URLS}") from None
    backend = parsed.get_backend_name()
    if backend in _DRIVERS and parsed.drivername not in _DRIVERS[backend]:
        raise InvalidValue(f"registry URL {shown_url(parsed)!r}: driver {parsed.drivername!r} is not supported; "
                           f"use {_ACCEPTED_URLS}")
    if backend == "sqlite":
        return _sqlite_engine(parsed, create)
    if backend == "postgresql":
        if parsed.drivername == "postgresql":  # the bare scheme means psycopg2, which is not a dependency
            parsed = parsed.set(drivername="postgresql+psycopg")
        # search_path etc. can ride in the URL: ...?options=-csearch_path%3Dregistry
        # READ COMMITTED whatever the server's default_transaction_isolation: the repository relies on
        # it. A lookup after a lost insert race must see the winner's committed row, and a row locked
        # FOR UPDATE is read as the other writer committed it; under REPEATABLE READ or SERIALIZABLE
        # both end in an IntegrityError or a serialization failure instead of the registry's answer.
        # The default bound is the connection's (a read waits on locks too, behind a migration's ALTER TABLE
        # say), set once when it opens, added to the URL's own options; a transaction asking for another pays
        # for one SET LOCAL, the others for nothing.
        options = " ".join([*_listed(parsed.query.get("options")), f"-c lock_timeout={round(1000 * LOCK_WAIT_S)}"])
        engine = sa.create_engine(parsed, pool_pre_ping=True, isolation_level="READ COMMITTED",
                                  connect_args={"options": options})

        @sa.event.listens_for(engine, "begin")
        def _on_begin(conn: sa.Connection) -> None:
            if _LOCK_WAIT in conn.get_execution_options():
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {_lock_wait_ms(conn)}")

        return engine
    raise InvalidValue(f"registry URL {shown_url(parsed)!r}: backend {backend!r} is not supported; "
                       f"use {_ACCEPTED_URLS}")


def _sqlite_engine(url: sa.URL, create: bool) -> sa.Engine:
    # Also in URI form (file::memory:?uri=true, file:x?mode=memory&uri=true): a registry gone at its close.
    if not url.database or ":memory:" in url.database or url.query.get("mode") == "memory":
        raise InvalidValue(
            f"registry URL {shown_url(url)!r}: an in-memory SQLite database is not shared between "
            f"connections; use a file, e.g. sqlite:///var/qserve/registry.db"
        )
    if url.database.startswith("~"):  # as sqlite_url() does: sqlite3 made a folder named '~' in the working one
        url = url.set(database=str(Path(url.database).expanduser()))
    path = Path(url.database)
    if not create and not path.is_file():
        # sqlite3 would create an empty database (and mkdir below its folders) at a mistyped path, which the
        # schema check then calls an old registry.
        raise InvalidValue(
            f"registry URL {shown_url(url)!r}: there is no SQLite database at {str(path.resolve())!r}; "
            f"check --registry-url (the quantizer and the gateway create the registry, a worker only opens it)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": LOCK_WAIT_S})

    @sa.event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # sqlite3 must not emit its own BEGIN; _on_begin does
        cursor = dbapi_conn.cursor()
        cursor.execute("PRAGMA foreign_keys = ON")
        _use_wal(cursor)
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _on_begin(conn: sa.Connection) -> None:
        if conn.get_execution_options().get(_READ_ONLY):
            # Registry.sessions: a deferred BEGIN takes no lock, and in WAL mode it reads a snapshot beside
            # a writer, so a slow reader (one that reads the store meanwhile) never locks the other services
            # out. query_only makes a write in it fail at once, instead of now and then with the SQLITE_BUSY
            # of a lock upgrade that the busy timeout does not retry (see below).
            conn.exec_driver_sql("PRAGMA query_only = ON")
            conn.exec_driver_sql("BEGIN")
            return
        # Take the write lock up front: a deferred transaction that reads and then writes can fail at
        # once with SQLITE_BUSY when another writer got in between, with no wait and no retry. The
        # registry's transactions are short, so serializing them costs little.
        conn.exec_driver_sql("PRAGMA query_only = OFF")  # the pooled connection may last have read only
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {_lock_wait_ms(conn)}")  # this transaction's, or the default
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _listed(value: str | tuple[str, ...] | None) -> list[str]:
    """A URL query parameter's values: absent, given once (a str) or repeated (a tuple)."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _lock_wait_ms(conn: sa.Connection) -> int:
    return max(1, round(1000 * conn.get_execution_options().get(_LOCK_WAIT, LOCK_WAIT_S)))


def _use_wal(cursor) -> None:
    """PRAGMA journal_mode = WAL, retried while the database is locked: two services opening a new
    registry together race to switch its journal mode, and the loser's switch can fail at once with
    'database is locked' instead of waiting out the busy timeout as a write does."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@dataclass
class Registry:
    engine: sa.Engine
    # Sessions that only read: on SQLite their transactions take no lock, and a write in one is refused.
    sessions: sessionmaker[Session]
    # Sessions that write (transaction() begins one): on SQLite each transaction holds the write lock.
    writes: sessionmaker[Session]

    def transaction(self, lock_wait_s: float | None = None) -> AbstractContextManager[Session]:
        """A session in a transaction that commits when the block ends and rolls back on an exception.
        lock_wait_s: how long it waits for a lock another transaction holds (default LOCK_WAIT_S), e.g. a
        caller's time left, so that a call its client gave up on does not hold a thread waiting."""
        if lock_wait_s is None:
            return self.writes.begin()
        return _transaction(self.writes(bind=self.engine.execution_options(**{_LOCK_WAIT: lock_wait_s})))

    def close(self) -> None:
        self.engine.dispose()


@contextmanager
def _transaction(session: Session) -> Iterator[Session]:
    with session, session.begin():
        yield session


def create_registry(url: str, *, migrate_to_head: bool = True) -> Registry:
    """Opens the registry at `url`. By default migrates it to head first (creating it when empty);
    with migrate_to_head=False it refuses a database that is not already at head (nor creates one)."""
    engine = make_engine(url, create=migrate_to_head)
    try:
        _migrate_or_check(engine, migrate_to_head)
    except BaseException:
        engine.dispose()
        raise
    return Registry(
        engine=engine,
        sessions=sessionmaker(engine.execution_options(**{_READ_ONLY: True}), expire_on_commit=False),
        writes=sessionmaker(engine, expire_on_commit=False),
    )


def _migrate_or_check(engine: sa.Engine, migrate_to_head: bool) -> None:
    if migrate_to_head:
        migrate.upgrade(engine)  # refuses a newer or unversioned schema itself
        return
    with engine.connect() as conn:
        migrate.refuse_unknown_schema(conn)
    current, head = migrate.current_revision(engine), migrate.head_revision()
    if current != head:
        raise InvalidState(
            f"registry at {shown_url(engine.url)!r} is at schema revision "
            f"{current!r}, this code needs {head!r}: start the quantizer or the gateway of this version once "
            f"against it (they migrate the registry), or check --registry-url"
        )

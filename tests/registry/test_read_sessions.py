"""Registry.sessions only reads; Registry.transaction writes. On SQLite a transaction() takes the
database's write lock at BEGIN, and before, the read-only sessions did too: a reader left open (the
quantizer's GetArtifact reading a manifest from a slow store) locked every other service out, whose
registry calls failed with 'database is locked' after the busy timeout."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from shared.registry import Registry, create_job, create_registry, list_jobs, sqlite_url


def test_a_reader_left_open_does_not_block_a_writer(registry: Registry, db_url: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.registry.db.LOCK_WAIT_S", 0.2)  # a writer kept waiting fails fast
    writer = create_registry(db_url)  # another service
    try:
        with registry.sessions() as session:
            assert list_jobs(session) == []  # the reader's transaction is open
            with writer.transaction() as other:
                job = create_job(other, owner="host-b:1:boot")
        with registry.sessions() as session:
            assert [j.id for j in list_jobs(session)] == [job.id]
    finally:
        writer.close()


def test_a_write_through_a_read_only_session_is_refused_on_sqlite(tmp_path: Path) -> None:
    # Its deferred transaction would take the write lock mid-way, which fails at once with SQLITE_BUSY
    # (no busy wait) when another writer got in first: refused every time instead of now and then.
    registry = create_registry(sqlite_url(tmp_path / "registry.db"))
    try:
        with pytest.raises(sa.exc.OperationalError, match="readonly database"), registry.sessions() as session:
            create_job(session, owner="host-a:1:boot")
        with registry.transaction() as session:  # query_only stays with the connection, which goes back to the pool
            create_job(session, owner="host-a:1:boot")
    finally:
        registry.close()

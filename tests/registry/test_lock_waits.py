"""A transaction waits for a lock another holds for a bounded time, on both backends: PostgreSQL's default is to
wait for good, so a session left open in psql (or a process paused mid-transaction) held every writer, and each
gateway thread running one, until it ended. A caller may bound its own transaction tighter (lock_wait_s): the
gateway gives an admin change no longer than its client's deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa

from shared.registry import Registry, create_deployment, create_registry, get_deployment


@contextmanager
def lock_held(db_url: str) -> Iterator[None]:
    """Another service's transaction holding the deployment's row lock (on SQLite: the write lock)."""
    other = create_registry(db_url)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with other.transaction() as session:
            get_deployment(session, "chat", for_update=True)
            held.set()
            release.wait(30)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert held.wait(10)
    try:
        yield
    finally:
        release.set()
        thread.join(30)
        other.close()


@pytest.fixture
def deployment(registry: Registry, make_ready) -> None:
    with registry.transaction() as session:
        stable = make_ready(session, "w4a8kv4-g128")
        baseline = make_ready(session, "fp16")
        create_deployment(session, "chat", stable_artifact_id=stable.id, baseline_artifact_id=baseline.id,
                          actor="test")


def waited(registry: Registry, **kwargs) -> float:
    started = time.monotonic()
    with pytest.raises(sa.exc.OperationalError):
        with registry.transaction(**kwargs) as session:
            get_deployment(session, "chat", for_update=True)
    return time.monotonic() - started


def test_a_transaction_gives_up_a_lock_wait_after_its_own_bound(registry: Registry, db_url: str,
                                                                deployment: None) -> None:
    with lock_held(db_url):
        assert 0.2 <= waited(registry, lock_wait_s=0.3) < 3.0
    with registry.transaction(lock_wait_s=0.3) as session:  # once the lock is free the same call goes through
        assert get_deployment(session, "chat", for_update=True).name == "chat"


def test_every_transaction_waits_at_most_the_default_bound(db_url: str, deployment: None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shared.registry.db.LOCK_WAIT_S", 0.3)
    registry = create_registry(db_url)  # SQLite's busy timeout is the connection's, set when it is made
    try:
        with lock_held(db_url):
            assert waited(registry) < 3.0
    finally:
        registry.close()


def test_a_bound_of_one_transaction_does_not_stay_with_its_pooled_connection(registry: Registry,
                                                                            deployment: None) -> None:
    with registry.transaction(lock_wait_s=0.05) as session:
        get_deployment(session, "chat")
    with registry.transaction() as session:  # the same pooled connection: the default bound again
        if registry.engine.dialect.name == "postgresql":
            assert session.execute(sa.text("SHOW lock_timeout")).scalar() == "30s"
        else:
            assert session.execute(sa.text("PRAGMA busy_timeout")).scalar() == 30_000

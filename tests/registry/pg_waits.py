"""For race tests on PostgreSQL: wait until a second writer's backend is blocked on the first's lock, so a
test orders the two explicitly instead of sleeping."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from shared.registry import Registry


def wait_until_blocked(registry: Registry, pid: list[int], what: str, timeout_s: float = 10.0) -> None:
    """Returns once backend pid[0] (appended by the writer's thread when it starts) waits for a lock;
    fails the test, saying `what` never happened, after timeout_s."""
    deadline = time.monotonic() + timeout_s
    with registry.engine.connect() as conn:
        while time.monotonic() < deadline:
            if pid:
                wait = conn.execute(
                    sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :pid"), {"pid": pid[0]}
                ).scalar()
                if wait == "Lock":
                    return
            conn.rollback()
            time.sleep(0.01)
    pytest.fail(what)

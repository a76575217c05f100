from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import shared.registry.events as events_module
from shared.registry import InvalidState, Registry, create_deployment, list_events, set_baseline
from shared.registry.models import Event


@pytest.fixture
def logged(registry: Registry, make_ready: Callable) -> int:
    """A committed deployment with two events; returns the first event's id."""
    with registry.transaction() as session:
        create_deployment(session, "chat", stable_artifact_id=make_ready(session, "w4a8kv4-g128").id, actor="alice")
        set_baseline(session, "chat", make_ready(session, "fp16").id, actor="alice")
    with registry.sessions() as session:
        return list_events(session, deployment="chat")[0].id


def test_records_are_read_only(session: Session, logged: int) -> None:
    record = list_events(session, deployment="chat")[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.actor = "mallory"  # type: ignore[misc]
    with pytest.raises(TypeError):
        record.detail["stable"] = "other"  # type: ignore[index]
    public = [name for name in dir(events_module) if not name.startswith("_")]
    assert not [name for name in public if any(word in name for word in ("update", "delete", "edit", "remove"))]


def test_the_orm_refuses_to_update_or_delete_an_event(registry: Registry, logged: int) -> None:
    with pytest.raises(InvalidState, match=f"event {logged} is append-only: it cannot be updated"):
        with registry.transaction() as session:
            session.get(Event, logged).actor = "mallory"
    with pytest.raises(InvalidState, match=f"event {logged} is append-only: it cannot be deleted"):
        with registry.transaction() as session:
            session.delete(session.get(Event, logged))
    with registry.sessions() as session:
        assert [e.actor for e in list_events(session, deployment="chat")] == ["alice", "alice"]


@pytest.mark.parametrize("statement", ["UPDATE events SET actor = 'mallory'", "DELETE FROM events"])
def test_the_database_refuses_to_update_or_delete_an_event(registry: Registry, logged: int, statement: str) -> None:
    with pytest.raises(sa.exc.DatabaseError, match="events are append-only"):
        with registry.engine.begin() as conn:
            conn.execute(sa.text(statement))
    with registry.sessions() as session:
        assert len(list_events(session)) >= 2


def test_the_log_can_be_tailed(session: Session, logged: int) -> None:
    assert [e.id for e in list_events(session, after_id=logged)] == [
        e.id for e in list_events(session) if e.id > logged
    ]
    assert list_events(session, after_id=logged, limit=1)[0].id > logged

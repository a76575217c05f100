"""Two transactions making conflicting changes at once (two gateways, a gateway and a quantizer) end
in a state that could have come from running them one after the other: never two canaries, never a
stable or canary that is not a READY artifact of the deployment's model, one event per change.

On PostgreSQL both transactions first read the deployment (as the admin servicer does) and only then
meet at the barrier, so the two really overlap; SQLite serializes writers (BEGIN IMMEDIATE), so
there the barrier only starts them together."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from sqlalchemy.orm import Session

from shared.registry import (
    ArtifactState,
    EventKind,
    InvalidState,
    ModelVersion,
    Registry,
    RegistryError,
    abort_rollout,
    create_deployment,
    get_artifact,
    get_deployment,
    list_events,
    mark_artifact_failed,
    mark_artifact_ready,
    promote,
    reserve_artifact,
    set_canary_percent,
    set_fallback,
    start_rollout,
)

Change = Callable[[Session, "Ids"], object]


@dataclass(frozen=True)
class Ids:
    stable: str
    canary: str  # the canary of "chat" at 10 %
    other: str  # a second READY candidate
    pending: str  # a PENDING artifact (its quantizer still running)


@pytest.fixture
def ids(registry: Registry, version: ModelVersion) -> Ids:
    with registry.transaction() as session:
        ids = Ids(stable=_ready(session, version, "w4a8kv4-g128"), canary=_ready(session, version, "w4a8kv4-chn"),
                  other=_ready(session, version, "w4a8kv4-g64"),
                  pending=reserve_artifact(session, version, "w4a8kv4-g32", "sm90").artifact.id)
        baseline = _ready(session, version, "fp16")
        create_deployment(session, "chat", stable_artifact_id=ids.stable, baseline_artifact_id=baseline, actor="t")
        start_rollout(session, "chat", canary_artifact_id=ids.canary, percent=10, actor="t")
    return ids


def _ready(session: Session, version: ModelVersion, format: str) -> str:
    artifact = reserve_artifact(session, version.id, format, "sm90").artifact
    mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest=uuid.uuid4().hex)
    return artifact.id


def _run_together(registry: Registry, ids: Ids, changes: tuple[Change, Change]) -> list[object]:
    """Runs both changes in their own transactions on two threads; returns each one's result or error."""
    barrier = threading.Barrier(2)
    outcomes: list[object] = [None, None]
    overlap = registry.engine.dialect.name == "postgresql"

    def run(i: int) -> None:
        try:
            with registry.transaction() as session:
                if overlap:
                    get_deployment(session, "chat")  # the snapshot a servicer decides on
                barrier.wait(timeout=10)
                outcomes[i] = changes[i](session, ids)
        except BaseException as exc:  # kept for the asserts, with its type
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a transaction never finished: deadlock?"
    return outcomes


def _assert_consistent(registry: Registry) -> None:
    with registry.sessions() as session:
        d = get_deployment(session, "chat")
        stable = get_artifact(session, d.stable_artifact_id)
        assert stable.state == ArtifactState.READY
        if d.canary_artifact_id is None:
            assert d.canary_percent == 0
        else:
            assert d.canary_artifact_id != d.stable_artifact_id
            assert get_artifact(session, d.canary_artifact_id).state == ArtifactState.READY
            assert 1 <= d.canary_percent <= 100
        # one event per change: the deployment's events carry revisions 1..revision, each once
        revisions = [e.detail["revision"] for e in list_events(session, deployment="chat")]
        assert revisions == list(range(1, d.revision + 1))


def _start(artifact: str) -> Change:
    return lambda s, ids: start_rollout(s, "chat", canary_artifact_id=getattr(ids, artifact), percent=20, actor="t")


def _abort_then_start(artifact: str) -> Change:
    def change(s: Session, ids: Ids) -> object:
        abort_rollout(s, "chat", actor="t")
        return start_rollout(s, "chat", canary_artifact_id=getattr(ids, artifact), percent=20, actor="t")

    return change


RACES: dict[str, tuple[Change, Change]] = {
    "two rollout starts": (_abort_then_start("other"), _abort_then_start("pending")),
    "two new canaries": (_abort_then_start("other"), _abort_then_start("other")),
    "promote and abort": (lambda s, i: promote(s, "chat", actor="t"), lambda s, i: abort_rollout(s, "chat", actor="t")),
    "promote and a new percent": (
        lambda s, i: promote(s, "chat", actor="t"), lambda s, i: set_canary_percent(s, "chat", 50, actor="t")),
    "promote and a start": (lambda s, i: promote(s, "chat", actor="t"), _start("other")),
    "two fallback switches": (
        lambda s, i: set_fallback(s, "chat", True, actor="t"), lambda s, i: set_fallback(s, "chat", True, actor="t")),
    "the canary failed while promoted": (
        lambda s, i: mark_artifact_failed(s, i.canary, "late"), lambda s, i: promote(s, "chat", actor="t")),
    "a pending artifact failed while rolled out": (
        lambda s, i: mark_artifact_failed(s, i.pending, "oom"), _abort_then_start("pending")),
    "a pending artifact made ready while rolled out": (
        lambda s, i: mark_artifact_ready(s, i.pending, manifest_sha256="c" * 64, content_digest="d"),
        _abort_then_start("pending")),
}


@pytest.mark.parametrize("changes", RACES.values(), ids=RACES.keys())
def test_racing_changes_leave_a_consistent_deployment(registry: Registry, ids: Ids, changes: tuple) -> None:
    outcomes = _run_together(registry, ids, changes)
    unexpected = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, RegistryError)]
    assert not unexpected, unexpected  # a refusal is the registry's own error, never a database error
    _assert_consistent(registry)


def test_of_two_rollout_starts_one_wins_and_the_other_is_told_why(registry: Registry, ids: Ids) -> None:
    with registry.transaction() as session:
        abort_rollout(session, "chat", actor="t")
    outcomes = _run_together(registry, ids, (_start("canary"), _start("other")))
    won = [o for o in outcomes if not isinstance(o, BaseException)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1 and len(lost) == 1, outcomes
    assert isinstance(lost[0], InvalidState) and "promote or abort it before starting another" in str(lost[0])
    with registry.sessions() as session:
        assert get_deployment(session, "chat").canary_artifact_id == won[0].canary_artifact_id
        starts = list_events(session, deployment="chat", kinds=[EventKind.ROLLOUT_START])
        assert [e.detail["canary"] for e in starts[1:]] == [won[0].canary_artifact_id]


def test_of_promote_and_abort_exactly_one_happens(registry: Registry, ids: Ids) -> None:
    promote_change = lambda s, i: promote(s, "chat", actor="t")  # noqa: E731
    abort_change = lambda s, i: abort_rollout(s, "chat", actor="t")  # noqa: E731
    promoted, aborted = _run_together(registry, ids, (promote_change, abort_change))
    assert isinstance(promoted, BaseException) != isinstance(aborted, BaseException), (promoted, aborted)
    loser = promoted if isinstance(promoted, BaseException) else aborted
    assert isinstance(loser, InvalidState) and "has no rollout in progress" in str(loser)
    with registry.sessions() as session:
        d = get_deployment(session, "chat")
        assert d.canary_artifact_id is None
        assert d.stable_artifact_id == (ids.stable if loser is promoted else ids.canary)
        ends = list_events(session, deployment="chat", kinds=[EventKind.PROMOTE, EventKind.ABORT])
        assert len(ends) == 1


def test_a_served_artifact_cannot_be_failed_under_a_race(registry: Registry, ids: Ids) -> None:
    failed, started = _run_together(
        registry, ids, (lambda s, i: mark_artifact_failed(s, i.other, "late"), _abort_then_start("other")))
    assert isinstance(failed, InvalidState) and "is READY and cannot become FAILED" in str(failed)
    assert not isinstance(started, BaseException)
    _assert_consistent(registry)

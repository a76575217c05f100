from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy.orm import Session

from shared.registry import (
    Conflict,
    EventKind,
    InvalidState,
    InvalidValue,
    ModelVersion,
    NotFound,
    Registry,
    abort_rollout,
    create_deployment,
    get_deployment,
    list_events,
    promote,
    reserve_artifact,
    set_baseline,
    set_canary_percent,
    set_fallback,
    start_rollout,
)


def test_a_rollout_from_start_to_promote_logs_every_change(session: Session, make_ready: Callable) -> None:
    stable, canary = make_ready(session, "w4a8kv4-g128"), make_ready(session, "w4a8kv4-chn")
    baseline = make_ready(session, "fp16")
    create_deployment(session, "chat", stable_artifact_id=stable.id, baseline_artifact_id=baseline.id, actor="alice")
    start_rollout(session, "chat", canary_artifact_id=canary.id, percent=5, actor="alice")
    set_canary_percent(session, "chat", 50, actor="alice")
    deployment = promote(session, "chat", actor="bob")
    assert (deployment.stable_artifact_id, deployment.canary_artifact_id) == (canary.id, None)
    assert deployment.canary_percent == 0
    assert deployment.revision == 4
    events = list_events(session, deployment="chat")
    assert [(e.kind, e.actor) for e in events] == [
        (EventKind.DEPLOYMENT_CREATE, "alice"), (EventKind.ROLLOUT_START, "alice"),
        (EventKind.ROLLOUT_PERCENT, "alice"), (EventKind.PROMOTE, "bob"),
    ]
    assert dict(events[1].detail) == {"canary": canary.id, "percent": 5, "stable": stable.id, "revision": 2}
    assert dict(events[3].detail) == {"stable": canary.id, "previous": stable.id, "revision": 4}


def test_abort_keeps_the_stable(session: Session, make_ready: Callable) -> None:
    stable, canary = make_ready(session, "w4a8kv4-g128"), make_ready(session, "w4a8kv4-chn")
    create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(InvalidState, match="has no rollout in progress: abort_rollout needs one"):
        abort_rollout(session, "chat", actor="alice")
    start_rollout(session, "chat", canary_artifact_id=canary.id, percent=10, actor="alice")
    with pytest.raises(InvalidState, match=f"already has a rollout of canary {canary.id} at 10%"):
        start_rollout(session, "chat", canary_artifact_id=canary.id, percent=20, actor="alice")
    deployment = abort_rollout(session, "chat", actor="gateway", reason="error budget")
    assert (deployment.stable_artifact_id, deployment.canary_artifact_id) == (stable.id, None)
    assert deployment.canary_percent == 0
    assert list_events(session, deployment="chat", kinds=[EventKind.ABORT])[0].detail["reason"] == "error budget"


def test_fallback_switch_needs_a_baseline_and_logs_only_changes(session: Session, make_ready: Callable) -> None:
    stable, baseline = make_ready(session, "w4a8kv4-g128"), make_ready(session, "fp16")
    create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(InvalidState, match="has no baseline artifact to fall back to"):
        set_fallback(session, "chat", True, actor="gateway")
    set_baseline(session, "chat", baseline.id, actor="alice")
    assert set_fallback(session, "chat", True, actor="gateway", reason="p99 latency over budget").fallback
    set_fallback(session, "chat", True, actor="gateway", reason="still over budget")
    assert not set_fallback(session, "chat", False, actor="alice").fallback
    kinds = [e.kind for e in list_events(session, deployment="chat")]
    assert kinds == [EventKind.DEPLOYMENT_CREATE, EventKind.BASELINE_SET, EventKind.FALLBACK_ON, EventKind.FALLBACK_OFF]


def test_a_change_and_its_event_commit_or_roll_back_together(registry: Registry, make_ready: Callable) -> None:
    with registry.transaction() as session:
        stable, canary = make_ready(session, "w4a8kv4-g128"), make_ready(session, "w4a8kv4-chn")
        create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(RuntimeError), registry.transaction() as session:
        start_rollout(session, "chat", canary_artifact_id=canary.id, percent=5, actor="alice")
        raise RuntimeError("the caller failed after the change")
    with registry.sessions() as session:
        assert get_deployment(session, "chat").canary_artifact_id is None
        assert [e.kind for e in list_events(session, deployment="chat")] == [EventKind.DEPLOYMENT_CREATE]


@pytest.mark.parametrize("percent", [-1, 0, 101, 12.5, True])
def test_canary_percent_must_be_1_to_100(session: Session, make_ready: Callable, percent: object) -> None:
    stable, canary = make_ready(session, "w4a8kv4-g128"), make_ready(session, "w4a8kv4-chn")
    create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(InvalidValue, match=f"canary percent {percent!r} is not accepted: use an integer from 1 to 100"):
        start_rollout(session, "chat", canary_artifact_id=canary.id, percent=percent, actor="alice")


def test_only_ready_artifacts_are_served_and_names_are_unique(
    session: Session, version: ModelVersion, make_ready: Callable
) -> None:
    stable = make_ready(session, "w4a8kv4-g128")
    pending = reserve_artifact(session, version, "w4a8kv4-chn", "sm90").artifact
    with pytest.raises(InvalidState, match=f"artifact {pending.id} is PENDING and cannot be a deployment's stable"):
        create_deployment(session, "chat", stable_artifact_id=pending.id, actor="alice")
    create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(Conflict, match="deployment 'chat' already exists"):
        create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(InvalidState, match="a canary must be a different artifact"):
        start_rollout(session, "chat", canary_artifact_id=stable.id, percent=5, actor="alice")
    with pytest.raises(NotFound, match="deployment 'code' does not exist; existing deployments: chat"):
        promote(session, "code", actor="alice")


def test_a_baseline_must_be_an_fp16_artifact(session: Session, make_ready: Callable) -> None:
    # The baseline is the unquantized fallback: a quantized artifact there would make the fallback switch
    # send every request to another quantized model.
    stable, other = make_ready(session, "w4a8kv4-g128"), make_ready(session, "w4a8kv4-chn")
    with pytest.raises(InvalidState, match=f"artifact {other.id} has format 'w4a8kv4-chn'.*baseline.*fp16"):
        create_deployment(session, "chat", stable_artifact_id=stable.id, baseline_artifact_id=other.id, actor="alice")
    create_deployment(session, "chat", stable_artifact_id=stable.id, actor="alice")
    with pytest.raises(InvalidState, match=f"artifact {other.id} has format 'w4a8kv4-chn'.*baseline.*fp16"):
        set_baseline(session, "chat", other.id, actor="alice")
    assert get_deployment(session, "chat").baseline_artifact_id is None
    assert [e.kind for e in list_events(session, deployment="chat")] == [EventKind.DEPLOYMENT_CREATE]

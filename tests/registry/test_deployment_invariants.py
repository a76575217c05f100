"""Deployment invariants enforced by the repository itself, whatever the caller (gateway servicer,
another gateway, a script): only READY artifacts of the deployment's own model are served, the
baseline is fp16 of that model, a canary takes 1..100 % of the traffic and is not the stable, and a
refused change leaves the deployment and the event log exactly as they were."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry import (
    ArtifactState,
    EventKind,
    InvalidState,
    InvalidValue,
    ModelVersion,
    NotFound,
    RegistryError,
    abort_rollout,
    create_deployment,
    get_artifact,
    get_deployment,
    list_events,
    mark_artifact_failed,
    mark_artifact_ready,
    promote,
    register_model_version,
    reserve_artifact,
    set_baseline,
    set_canary_percent,
    set_fallback,
    start_rollout,
)
from shared.registry.models import Event


@dataclass(frozen=True)
class World:
    stable: str  # tiny-llama w4a8kv4-g128, the stable of "chat" and "rolling"
    canary: str  # tiny-llama w4a8kv4-chn, the canary of "rolling" at 10 %
    baseline: str  # tiny-llama fp16
    spare: str  # tiny-llama w4a8kv4-g128 on sm89, READY and unused
    pending: str
    failed: str
    other_quant: str  # READY artifacts of another model
    other_fp16: str
    new_vocab: str  # another tiny-llama version's g128 and fp16, whose tokenizer maps ids otherwise (tokens added)
    new_vocab_fp16: str
    legacy: str  # of that version, w4a8kv4-chn published before vocabulary digests (none recorded)


VOCABULARY, OTHER_VOCABULARY = "0" * 64, "1" * 64


def _ready(session: Session, version: ModelVersion | int, format: str, gpu: str = "sm90",
           vocabulary: str | None = VOCABULARY) -> str:
    artifact = reserve_artifact(session, version, format, gpu).artifact
    mark_artifact_ready(session, artifact.id, manifest_sha256="b" * 64, content_digest=uuid.uuid4().hex,
                        vocabulary_digest=vocabulary)
    return artifact.id


@pytest.fixture
def world(session: Session, version: ModelVersion) -> World:
    other = register_model_version(session, "other-llama", "c" * 64, label="v1")
    retrained = register_model_version(session, "tiny-llama", "9" * 64, label="new-vocab")
    failed = reserve_artifact(session, version, "w4a8kv4-g64", "sm90").artifact.id
    mark_artifact_failed(session, failed, "calibration diverged")
    w = World(
        stable=_ready(session, version, "w4a8kv4-g128"), canary=_ready(session, version, "w4a8kv4-chn"),
        baseline=_ready(session, version, "fp16"), spare=_ready(session, version, "w4a8kv4-g128", "sm89"),
        pending=reserve_artifact(session, version, "w4a8kv4-g32", "sm90").artifact.id, failed=failed,
        other_quant=_ready(session, other, "w4a8kv4-g128"), other_fp16=_ready(session, other, "fp16"),
        new_vocab=_ready(session, retrained, "w4a8kv4-g128", vocabulary=OTHER_VOCABULARY),
        new_vocab_fp16=_ready(session, retrained, "fp16", vocabulary=OTHER_VOCABULARY),
        legacy=_ready(session, retrained, "w4a8kv4-chn", vocabulary=None),
    )
    create_deployment(session, "chat", stable_artifact_id=w.stable, baseline_artifact_id=w.baseline, actor="alice")
    create_deployment(session, "bare", stable_artifact_id=w.stable, actor="alice")
    create_deployment(session, "rolling", stable_artifact_id=w.stable, baseline_artifact_id=w.baseline, actor="alice")
    start_rollout(session, "rolling", canary_artifact_id=w.canary, percent=10, actor="alice")
    return w


def _snapshot(session: Session) -> tuple:
    """Every deployment's served state plus the number of events: what a refused change must not move."""
    rows = [
        (d.name, d.stable_artifact_id, d.canary_artifact_id, d.canary_percent, d.baseline_artifact_id, d.fallback,
         d.revision)
        for d in (get_deployment(session, name) for name in ("bare", "chat", "rolling"))
    ]
    return rows, session.scalar(sa.select(sa.func.count()).select_from(Event))


# (name, change, error type, message); `w` is the World.
REFUSALS: list[tuple[str, Callable[[Session, World], object], type[RegistryError], str]] = [
    ("canary of another model",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.other_quant, percent=5, actor="a"),
     InvalidState, "is of model 'other-llama'.*'tiny-llama'"),
    ("baseline of another model at creation",
     lambda s, w: create_deployment(s, "new", stable_artifact_id=w.stable, baseline_artifact_id=w.other_fp16,
                                    actor="a"),
     InvalidState, "is of model 'other-llama'.*'tiny-llama'"),
    ("baseline of another model later",
     lambda s, w: set_baseline(s, "chat", w.other_fp16, actor="a"),
     InvalidState, "is of model 'other-llama'.*'tiny-llama'"),
    ("canary with another vocabulary",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.new_vocab, percent=5, actor="a"),
     InvalidState, "its tokenizer maps token ids otherwise than that of the stable"),
    ("baseline with another vocabulary at creation",
     lambda s, w: create_deployment(s, "new", stable_artifact_id=w.stable, baseline_artifact_id=w.new_vocab_fp16,
                                    actor="a"),
     InvalidState, "cannot be the baseline of deployment 'new': its tokenizer maps token ids otherwise"),
    ("baseline with another vocabulary later",
     lambda s, w: set_baseline(s, "chat", w.new_vocab_fp16, actor="a"),
     InvalidState, "its tokenizer maps token ids otherwise"),
    ("a rollout at 0 percent",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.canary, percent=0, actor="a"),
     InvalidValue, "canary percent 0 is not accepted: use an integer from 1 to 100"),
    ("a canary turned down to 0 percent",
     lambda s, w: set_canary_percent(s, "rolling", 0, actor="a"),
     InvalidValue, "canary percent 0 is not accepted: use an integer from 1 to 100"),
    ("a rollout over 100 percent",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.canary, percent=101, actor="a"),
     InvalidValue, "canary percent 101 is not accepted"),
    ("a PENDING canary",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.pending, percent=5, actor="a"),
     InvalidState, "is PENDING and cannot be a deployment's canary"),
    ("a FAILED canary",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.failed, percent=5, actor="a"),
     InvalidState, "is FAILED and cannot be a deployment's canary"),
    ("a PENDING stable",
     lambda s, w: create_deployment(s, "new", stable_artifact_id=w.pending, actor="a"),
     InvalidState, "is PENDING and cannot be a deployment's stable"),
    ("a FAILED stable",
     lambda s, w: create_deployment(s, "new", stable_artifact_id=w.failed, actor="a"),
     InvalidState, "is FAILED and cannot be a deployment's stable"),
    ("a quantized baseline",
     lambda s, w: set_baseline(s, "chat", w.spare, actor="a"),
     InvalidState, "cannot be a deployment's baseline.*fp16"),
    ("the stable as its own canary",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id=w.stable, percent=5, actor="a"),
     InvalidState, "a canary must be a different artifact"),
    ("a second canary",
     lambda s, w: start_rollout(s, "rolling", canary_artifact_id=w.spare, percent=5, actor="a"),
     InvalidState, "promote or abort it before starting another"),
    ("promote without a canary",
     lambda s, w: promote(s, "chat", actor="a"),
     InvalidState, "has no rollout in progress: promote needs one"),
    ("abort without a canary",
     lambda s, w: abort_rollout(s, "chat", actor="a"),
     InvalidState, "has no rollout in progress: abort_rollout needs one"),
    ("a percent without a canary",
     lambda s, w: set_canary_percent(s, "chat", 20, actor="a"),
     InvalidState, "has no rollout in progress: set_canary_percent needs one"),
    ("fallback without a baseline",
     lambda s, w: set_fallback(s, "bare", True, actor="a"),
     InvalidState, "has no baseline artifact to fall back to"),
    ("an unknown deployment",
     lambda s, w: start_rollout(s, "nope", canary_artifact_id=w.canary, percent=5, actor="a"),
     NotFound, "deployment 'nope' does not exist"),
    ("an unknown canary",
     lambda s, w: start_rollout(s, "chat", canary_artifact_id="f" * 32, percent=5, actor="a"),
     NotFound, f"artifact '{'f' * 32}' does not exist"),
    ("a served artifact marked FAILED",
     lambda s, w: mark_artifact_failed(s, w.canary, "late failure"),
     InvalidState, "is READY and cannot become FAILED"),
]


@pytest.mark.parametrize("change, error, message", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_refused_change_raises_the_registry_error_and_changes_nothing(
    session: Session, world: World, change: Callable, error: type[RegistryError], message: str
) -> None:
    before = _snapshot(session)
    with pytest.raises(error, match=message):
        change(session, world)
    assert _snapshot(session) == before
    assert get_artifact(session, world.canary).state == ArtifactState.READY


def test_a_canary_may_be_another_version_or_the_fp16_of_the_same_model(session: Session, world: World) -> None:
    # A new checkpoint version of the model is what a rollout is for; `qctl up` rolls the fp16 out as
    # a canary to bring a demo deployment back to its baseline.
    v2 = register_model_version(session, "tiny-llama", "d" * 64, label="v2")
    newer = _ready(session, v2, "w4a8kv4-g128")
    assert start_rollout(session, "chat", canary_artifact_id=newer, percent=1, actor="a").canary_percent == 1
    abort_rollout(session, "chat", actor="a")
    rollout = start_rollout(session, "chat", canary_artifact_id=world.baseline, percent=100, actor="a")
    assert rollout.canary_percent == 100
    set_baseline(session, "bare", world.baseline, actor="a")
    assert get_deployment(session, "bare").baseline_artifact_id == world.baseline
    abort_rollout(session, "chat", actor="a")  # an artifact without a vocabulary digest is not checked
    assert start_rollout(session, "chat", canary_artifact_id=world.legacy, percent=5, actor="a").canary_percent == 5


def test_a_vocabulary_is_checked_against_every_arm_that_records_one(session: Session, world: World) -> None:
    """Beside a stable published before vocabulary digests, a canary and a baseline of two vocabularies each passed
    (compared with the stable alone), and a promote paired them: the fallback would answer in other token ids."""
    create_deployment(session, "mixed", stable_artifact_id=world.legacy, baseline_artifact_id=world.baseline,
                      actor="a")
    with pytest.raises(InvalidState, match="otherwise than that of the baseline"):
        start_rollout(session, "mixed", canary_artifact_id=world.new_vocab, percent=5, actor="a")
    create_deployment(session, "mixed-2", stable_artifact_id=world.legacy, actor="a")
    start_rollout(session, "mixed-2", canary_artifact_id=world.new_vocab, percent=5, actor="a")
    with pytest.raises(InvalidState, match="otherwise than that of the canary"):
        set_baseline(session, "mixed-2", world.baseline, actor="a")
    set_baseline(session, "mixed-2", world.new_vocab_fp16, actor="a")  # the canary's vocabulary: accepted


def test_every_rollout_and_fallback_change_appends_exactly_one_event(session: Session, world: World) -> None:
    changes = [
        (lambda: start_rollout(session, "chat", canary_artifact_id=world.canary, percent=5, actor="a"),
         EventKind.ROLLOUT_START),
        (lambda: set_canary_percent(session, "chat", 50, actor="a"), EventKind.ROLLOUT_PERCENT),
        (lambda: abort_rollout(session, "chat", actor="a", reason="latency"), EventKind.ABORT),
        (lambda: start_rollout(session, "chat", canary_artifact_id=world.spare, percent=5, actor="a"),
         EventKind.ROLLOUT_START),
        (lambda: promote(session, "chat", actor="a"), EventKind.PROMOTE),
        (lambda: set_fallback(session, "chat", True, actor="a"), EventKind.FALLBACK_ON),
        (lambda: set_fallback(session, "chat", False, actor="a"), EventKind.FALLBACK_OFF),
        (lambda: set_baseline(session, "bare", world.baseline, actor="a"), EventKind.BASELINE_SET),
    ]
    for change, kind in changes:
        before = session.scalar(sa.select(sa.func.max(Event.id)))
        deployment = change()
        appended = list_events(session, after_id=before)
        assert [(e.kind, e.deployment, e.detail["revision"]) for e in appended] == [
            (kind, deployment.name, deployment.revision)
        ]

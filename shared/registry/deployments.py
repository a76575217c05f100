"""Deployments: what the gateway serves under a name. Every change appends its event in the same
transaction, so the log and the state cannot disagree."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from shared.registry._rows import check_canary_percent, check_key, check_segment, check_text, insert_or_get, locked
from shared.registry.artifacts import get_artifact
from shared.registry.errors import Conflict, InvalidState, InvalidValue, NotFound
from shared.registry.events import EventKind, append_event, last_rollout_event
from shared.registry.models import MAX_ACTOR, Artifact, ArtifactState, Deployment, utcnow

BASELINE_FORMAT = "fp16"  # what the fallback switch serves: the unquantized model


def create_deployment(
    session: Session, name: str, *, stable_artifact_id: str, baseline_artifact_id: str | None = None, actor: str
) -> Deployment:
    check_text("actor", actor, MAX_ACTOR)
    check_segment("deployment name", name)
    stable = _ready(session, stable_artifact_id, "stable")
    if baseline_artifact_id is not None:
        _same_model(_ready(session, baseline_artifact_id, "baseline"), "baseline", name, {"stable": stable})
    now = utcnow()
    row = Deployment(
        name=name, stable_artifact_id=stable_artifact_id, baseline_artifact_id=baseline_artifact_id,
        canary_percent=0, fallback=False, revision=1, created_at=now, updated_at=now,
    )
    deployment, created = insert_or_get(session, row, lambda: _find(session, name))
    if not created:
        raise Conflict(f"deployment {name!r} already exists; choose another name or change it with a rollout")
    append_event(session, EventKind.DEPLOYMENT_CREATE, actor=actor, deployment=deployment,
                 detail={"stable": stable_artifact_id, "baseline": baseline_artifact_id, "revision": 1})
    session.flush()
    return deployment


def get_deployment(session: Session, name: str, for_update: bool = False) -> Deployment:
    """The deployment; with for_update its row stays locked until the transaction ends (a decision
    taken on what was read cannot race a change made through another gateway)."""
    if for_update:
        return _lock(session, name)
    deployment = _find(session, name)
    if deployment is None:
        raise NotFound(f"deployment {name!r} does not exist; existing deployments: {_names(session)}")
    return deployment


def list_deployments(session: Session) -> list[Deployment]:
    return list(session.scalars(sa.select(Deployment).order_by(Deployment.name)))


def start_rollout(session: Session, name: str, *, canary_artifact_id: str, percent: int, actor: str) -> Deployment:
    """Sends `percent` of traffic (sticky per session key, decided by the gateway) to the canary."""
    check_text("actor", actor, MAX_ACTOR)
    check_key("artifact id", canary_artifact_id)
    check_canary_percent(percent)
    deployment = _lock(session, name)
    if deployment.canary_artifact_id is not None:
        raise InvalidState(
            f"deployment {name!r} already has a rollout of canary {deployment.canary_artifact_id} "
            f"at {deployment.canary_percent}%: promote or abort it before starting another"
        )
    if canary_artifact_id == deployment.stable_artifact_id:
        raise InvalidState(f"artifact {canary_artifact_id} is already the stable of deployment {name!r}; "
                           f"a canary must be a different artifact")
    _same_model(_ready(session, canary_artifact_id, "canary"), "canary", name,
                _arms(session, deployment, "stable", "baseline"))
    deployment.canary_artifact_id, deployment.canary_percent = canary_artifact_id, percent
    _record(session, deployment, EventKind.ROLLOUT_START, actor,
            {"canary": canary_artifact_id, "percent": percent, "stable": deployment.stable_artifact_id})
    return deployment


def set_canary_percent(session: Session, name: str, percent: int, *, actor: str) -> Deployment:
    check_text("actor", actor, MAX_ACTOR)
    check_canary_percent(percent)
    deployment = _lock(session, name)
    _require_rollout(deployment, "set_canary_percent")
    previous = deployment.canary_percent
    if previous == percent:  # a retried call, or a ramp to where it is: nothing changes, nothing is logged
        return deployment
    deployment.canary_percent = percent
    _record(session, deployment, EventKind.ROLLOUT_PERCENT, actor,
            {"canary": deployment.canary_artifact_id, "from": previous, "to": percent})
    return deployment


def promote(session: Session, name: str, *, actor: str, expected_canary: str | None = None) -> Deployment:
    """The canary becomes the stable; the rollout ends. With expected_canary, only if that artifact is
    still the canary (the one the caller reviewed, not one started since); when the last rollout event is the
    promote of that artifact, it is a retry of that promote (its answer lost to a deadline), answered as done."""
    check_text("actor", actor, MAX_ACTOR)
    deployment = _lock(session, name)
    if expected_canary and deployment.canary_artifact_id is None \
            and deployment.stable_artifact_id == expected_canary:
        last = last_rollout_event(session, deployment)
        if last is not None and last.kind is EventKind.PROMOTE and last.detail.get("stable") == expected_canary:
            return deployment
    _require_rollout(deployment, "promote")
    if expected_canary and deployment.canary_artifact_id != expected_canary:
        raise InvalidState(
            f"deployment {name!r}: the canary is now {deployment.canary_artifact_id!r}, not {expected_canary!r}: "
            f"the rollout changed since it was reviewed; check `qctl rollout status` and promote again"
        )
    previous = deployment.stable_artifact_id
    deployment.stable_artifact_id, deployment.canary_artifact_id = deployment.canary_artifact_id, None
    deployment.canary_percent = 0
    detail = {"stable": deployment.stable_artifact_id, "previous": previous}
    _record(session, deployment, EventKind.PROMOTE, actor, detail)
    return deployment


def abort_rollout(session: Session, name: str, *, actor: str, reason: str = "", judged: bool = True,
                  expected_canary: str | None = None) -> Deployment:
    """The canary gets no more traffic; the stable stays. judged=False: the canary was not found at fault (the
    guard aborts it along with a fallback of the stable), recorded as "judged": false in the event. With
    expected_canary, only if that artifact is still the canary; when the last rollout event is its abort, it is a
    retry of that abort, answered as done."""
    check_text("actor", actor, MAX_ACTOR)
    deployment = _lock(session, name)
    if expected_canary and deployment.canary_artifact_id is None:
        last = last_rollout_event(session, deployment)
        if last is not None and last.kind is EventKind.ABORT and last.detail.get("canary") == expected_canary:
            return deployment
    _require_rollout(deployment, "abort_rollout")
    if expected_canary and deployment.canary_artifact_id != expected_canary:
        raise InvalidState(
            f"deployment {name!r}: the canary is now {deployment.canary_artifact_id!r}, not {expected_canary!r}: "
            f"the rollout changed since; check `qctl rollout status` and abort again"
        )
    canary = deployment.canary_artifact_id
    deployment.canary_artifact_id, deployment.canary_percent = None, 0
    detail = {"canary": canary, "reason": reason} | ({} if judged else {"judged": False})
    _record(session, deployment, EventKind.ABORT, actor, detail)
    return deployment


def set_baseline(session: Session, name: str, baseline_artifact_id: str, *, actor: str) -> Deployment:
    check_text("actor", actor, MAX_ACTOR)
    baseline = _ready(session, baseline_artifact_id, "baseline")
    deployment = _lock(session, name)
    _same_model(baseline, "baseline", name, _arms(session, deployment, "stable", "canary"))
    previous = deployment.baseline_artifact_id
    if previous == baseline_artifact_id:
        return deployment
    deployment.baseline_artifact_id = baseline_artifact_id
    detail = {"baseline": baseline_artifact_id, "previous": previous}
    _record(session, deployment, EventKind.BASELINE_SET, actor, detail)
    return deployment


def set_fallback(session: Session, name: str, on: bool, *, actor: str, reason: str = "") -> Deployment:
    """On: all traffic goes to the baseline. Turning it to the state it already has changes nothing
    and logs nothing (the gateway's automatic switch may ask repeatedly)."""
    check_text("actor", actor, MAX_ACTOR)
    if not isinstance(on, bool):
        raise InvalidValue(f"fallback switch {on!r} is not accepted: use True (on) or False (off)")
    deployment = _lock(session, name)
    if deployment.fallback == on:
        return deployment
    if on and deployment.baseline_artifact_id is None:
        raise InvalidState(
            f"deployment {name!r} has no baseline artifact to fall back to; set one with set_baseline first"
        )
    deployment.fallback = on
    _record(session, deployment, EventKind.FALLBACK_ON if on else EventKind.FALLBACK_OFF, actor, {"reason": reason})
    return deployment


def _record(session: Session, deployment: Deployment, kind: EventKind, actor: str, detail: Mapping[str, Any]) -> None:
    deployment.revision += 1
    deployment.updated_at = utcnow()
    append_event(session, kind, actor=actor, deployment=deployment, detail={**detail, "revision": deployment.revision})
    session.flush()


def _ready(session: Session, artifact_id: str, role: str) -> Artifact:
    artifact = get_artifact(session, artifact_id)
    if artifact.state != ArtifactState.READY:
        raise InvalidState(
            f"artifact {artifact_id} is {artifact.state.value} and cannot be a deployment's {role}: "
            f"only a READY artifact can be served"
        )
    if role == "baseline" and artifact.format != BASELINE_FORMAT:
        raise InvalidState(
            f"artifact {artifact_id} has format {artifact.format!r} and cannot be a deployment's baseline: "
            f"the baseline is the unquantized fallback, a READY {BASELINE_FORMAT!r} artifact"
        )
    return artifact


def _arms(session: Session, deployment: Deployment, *roles: str) -> dict[str, Artifact]:
    """The deployment's artifacts in these roles ("stable", "canary", "baseline"), where it has one."""
    ids = {"stable": deployment.stable_artifact_id, "canary": deployment.canary_artifact_id,
           "baseline": deployment.baseline_artifact_id}
    return {role: get_artifact(session, ids[role]) for role in roles if ids[role] is not None}


def _same_model(artifact: Artifact, role: str, deployment: str, arms: Mapping[str, Artifact]) -> None:
    """A deployment serves one model: its canary and baseline are of the stable's model (any version
    of it: a new checkpoint version is what a rollout is for). The stable of another model would be
    promoted from such a canary, and the fallback would answer with another model.

    And one vocabulary: a new version whose tokenizer maps ids otherwise (tokens added by a fine-tune)
    would give a client that sends token ids, or reads them from the stream, other tokens on that arm.
    Checked against every arm (`arms`: the stable and those it has) whose artifact carries a vocabulary
    digest (those published before migration 0003 do not): against the stable alone, a canary and a
    baseline of two vocabularies both passed beside a stable without one, and a promote paired them."""
    stable = arms["stable"]
    if artifact.model_version.model_id != stable.model_version.model_id:
        raise InvalidState(
            f"artifact {artifact.id} is of model {artifact.model_version.model.name!r} and cannot be the {role} "
            f"of deployment {deployment!r}, whose stable {stable.id} is of model "
            f"{stable.model_version.model.name!r}: a deployment serves one model"
        )
    for other_role, other in arms.items():
        ours, theirs = artifact.vocabulary_digest, other.vocabulary_digest
        if ours and theirs and ours != theirs:
            raise InvalidState(
                f"artifact {artifact.id} cannot be the {role} of deployment {deployment!r}: its tokenizer maps "
                f"token ids otherwise than that of the {other_role} {other.id} (vocabulary digests {ours[:12]}... "
                f"and {theirs[:12]}...), so clients sending or reading token ids would get other tokens on that "
                f"arm; serve the new vocabulary under a new deployment"
            )


def _require_rollout(deployment: Deployment, action: str) -> None:
    if deployment.canary_artifact_id is None:
        raise InvalidState(
            f"deployment {deployment.name!r} has no rollout in progress: {action} needs one; "
            f"start one first (`qctl rollout start`, Admin.StartRollout)"
        )


def _find(session: Session, name: str) -> Deployment | None:
    check_key("deployment name", name)
    return session.scalars(sa.select(Deployment).where(Deployment.name == name)).one_or_none()


def _lock(session: Session, name: str) -> Deployment:
    check_key("deployment name", name)
    deployment = locked(session, sa.select(Deployment).where(Deployment.name == name), Deployment)
    if deployment is None:
        raise NotFound(f"deployment {name!r} does not exist; existing deployments: {_names(session)}")
    return deployment


def _names(session: Session) -> str:
    names = list(session.scalars(sa.select(Deployment.name).order_by(Deployment.name)))
    return ", ".join(names) or "none"

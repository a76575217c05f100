"""Deployments as the gateway sees them: frozen snapshots read from the registry, cached for a short
time so that a change made anywhere (another gateway, `qctl` through another process) takes effect
within deployment_cache_s, while Generate does not query the database per request."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from google.protobuf.timestamp_pb2 import Timestamp
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from services.gateway.errors import InvalidRequest
from services.gateway.registry_threads import RegistryThreads
from shared.registry import Artifact, Deployment, Event, EventKind, NotFound, Registry, get_artifact
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)
# What CreateDeployment accepts (the gateway is what creates deployments), so every name a Generate can ask for.
DEPLOYMENT_NAME = re.compile(r"[a-z0-9._-]{1,64}")
FALLBACK_KINDS = (EventKind.FALLBACK_ON.value, EventKind.FALLBACK_OFF.value)
# The changes that start an arm's run afresh for the guard (DeploymentCache.arm_since): a new stable, a new or
# restarted canary, the fallback switched either way. A canary's percentage and the baseline are not among them.
RUN_KINDS = {
    "stable": (EventKind.DEPLOYMENT_CREATE.value, EventKind.PROMOTE.value, *FALLBACK_KINDS),
    "canary": (EventKind.ROLLOUT_START.value, EventKind.ABORT.value, EventKind.PROMOTE.value, *FALLBACK_KINDS),
}


@dataclass(frozen=True, slots=True)
class ArtifactRefView:
    artifact_id: str
    model_name: str
    model_version: str
    format: str
    gpu_target: str

    @classmethod
    def of(cls, artifact: Artifact) -> ArtifactRefView:
        version = artifact.model_version
        return cls(artifact.id, version.model.name, version.content_hash, artifact.format, artifact.gpu)

    def to_pb(self) -> common_pb2.ArtifactRef:
        return common_pb2.ArtifactRef(artifact_id=self.artifact_id, model_name=self.model_name,
                                      model_version=self.model_version, format=self.format,
                                      gpu_target=self.gpu_target)


@dataclass(frozen=True, slots=True)
class DeploymentView:
    name: str
    stable: ArtifactRefView
    canary: ArtifactRefView | None
    canary_percent: int
    baseline: ArtifactRefView | None
    fallback: bool
    fallback_reason: str
    revision: int
    created_at: datetime
    updated_at: datetime
    rollout_started_at: datetime | None  # when the canary's rollout started; None without a rollout
    # By arm ("stable", "canary"): the id and time of the last event that started its run (_runs).
    runs: dict[str, tuple[int, datetime]]

    def to_pb(self) -> gateway_pb2.Deployment:
        pb = gateway_pb2.Deployment(name=self.name, stable=self.stable.to_pb(), canary_percent=self.canary_percent,
                                    fallback=self.fallback, fallback_reason=self.fallback_reason,
                                    created_at=timestamp(self.created_at), updated_at=timestamp(self.updated_at))
        if self.canary is not None:
            pb.canary.CopyFrom(self.canary.to_pb())
        if self.baseline is not None:
            pb.baseline.CopyFrom(self.baseline.to_pb())
        return pb


def timestamp(at: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(at)
    return ts


def view_of(session: Session, deployment: Deployment) -> DeploymentView:
    def ref(artifact_id: str | None) -> ArtifactRefView | None:
        return None if artifact_id is None else ArtifactRefView.of(get_artifact(session, artifact_id))

    last_switch = _last_event(session, deployment, FALLBACK_KINDS)
    rollout_started_at = None
    if deployment.canary_artifact_id is not None:
        started = _last_event(session, deployment, (EventKind.ROLLOUT_START.value,))
        rollout_started_at = None if started is None else started.at
    reason = ""
    if last_switch is not None:  # the detail column is the text of a JSON object
        reason = str(json.loads(last_switch.detail).get("reason", ""))
    return DeploymentView(
        name=deployment.name, stable=ref(deployment.stable_artifact_id), canary=ref(deployment.canary_artifact_id),
        canary_percent=deployment.canary_percent, baseline=ref(deployment.baseline_artifact_id),
        fallback=deployment.fallback, fallback_reason=reason, revision=deployment.revision,
        created_at=deployment.created_at, updated_at=deployment.updated_at, rollout_started_at=rollout_started_at,
        runs=_runs(session, deployment),
    )


def _runs(session: Session, deployment: Deployment) -> dict[str, tuple[int, datetime]]:
    """By arm, the id and time of the last event that started its run (RUN_KINDS); (0, the deployment's creation)
    for none."""
    last_ids = (sa.select(sa.func.max(Event.id))
                .where(Event.deployment_id == deployment.id,
                       Event.kind.in_({k for kinds in RUN_KINDS.values() for k in kinds}))
                .group_by(Event.kind))
    last = {kind: (id_, at) for id_, kind, at in session.execute(
        sa.select(Event.id, Event.kind, Event.at).where(Event.id.in_(last_ids)))}
    none = (0, deployment.created_at)
    return {arm: max((last.get(kind, none) for kind in kinds), default=none) for arm, kinds in RUN_KINDS.items()}


def _last_event(session: Session, deployment: Deployment, kinds: tuple[str, ...]) -> Event | None:
    return session.scalars(
        sa.select(Event).where(Event.deployment_id == deployment.id, Event.kind.in_(kinds))
        .order_by(Event.id.desc()).limit(1)
    ).first()


def check_deployment_name(name: str) -> None:
    """InvalidRequest unless `name` is one CreateDeployment accepts (the message shows at most 64 characters)."""
    if not DEPLOYMENT_NAME.fullmatch(name):
        shown = repr(name[:64]) + ("..." if len(name) > 64 else "")
        raise InvalidRequest(f"deployment name {shown} is not accepted: use 1-64 characters of a-z, 0-9, '.', '_' "
                             f"and '-'")


def deployment_names(registry: Registry) -> set[str]:
    with registry.sessions() as session:
        return set(session.scalars(sa.select(Deployment.name)))


def read_deployments(registry: Registry, names: list[str]) -> dict[str, DeploymentView | None]:
    """Snapshots of these deployments, read in one session that takes no write lock (on SQLite a
    transaction() waits out any writer: every request's routing would); None for a name that does not exist."""
    with registry.sessions() as session:
        rows = session.scalars(sa.select(Deployment).where(Deployment.name.in_(names)))
        found = {row.name: view_of(session, row) for row in rows}
    return {name: found.get(name) for name in names}


class DeploymentCache:
    """name -> (snapshot or None for "no such deployment", time read).

    A request reads the registry only for a name it is the first to ask about (concurrent callers
    share that read); after that, refresh() re-reads every name used in the last IDLE_S seconds
    twice per max_age_s, so requests never wait on the database and a change made anywhere is
    seen within max_age_s. A change made through this gateway is put in at once. A name the registry
    does not hold is answered from the list of deployment names, read again at most once per max_age_s:
    a client sending random names (no API key needed by default) cost one database read each (3,000 in 4 s)
    and an entry each."""

    IDLE_S = 60.0  # a deployment nobody asked for this long is no longer refreshed
    OUTAGE_LOG_S = 30.0  # while the registry is down, how often each deployment's stale routing is logged
    # How long a request waits for a re-read of a deployment it has a view of; past it the registry counts as
    # down (for_routing): one that answers slowly (a lock behind a migration) held every request to its deadline.
    ROUTING_READ_WAIT_S = 2.0

    def __init__(self, registry: Registry, max_age_s: float, threads: RegistryThreads | None = None):
        self.registry = registry
        self.max_age_s = max_age_s
        self.threads = threads or RegistryThreads("deployment-reads")
        self._entries: dict[str, tuple[DeploymentView | None, float]] = {}
        self._names: set[str] = set()  # the registry's deployment names, as last read (or put)
        self._names_read_at = -math.inf
        self._names_read: asyncio.Future | None = None
        self._used: dict[str, float] = {}  # name -> when a request last asked for it
        self._reads: dict[str, asyncio.Task] = {}
        self._outage_logged: dict[str, float] = {}  # name -> when routing on a stale view was last logged
        # (name, arm) -> (the event id of the arm's run, wall time this replica first saw it; 0 for a run seen in
        # the first view it read of the deployment): arm_since
        self._runs_seen: dict[tuple[str, str], tuple[int, float]] = {}

    async def get(self, name: str) -> DeploymentView:
        entry = self._entries.get(name)
        if (entry is None or entry[0] is None) and not await self._may_exist(name):
            raise NotFound(f"deployment {name!r} does not exist; `qctl deploy create` creates one")
        now = time.monotonic()
        self._used[name] = now
        if entry is None or now - entry[1] > self.max_age_s:
            read = self._reads.get(name)
            if read is None:  # concurrent callers share one read
                read = asyncio.ensure_future(self._read([name]))
                self._reads[name] = read
                read.add_done_callback(lambda _: self._reads.pop(name, None))
            view = (await asyncio.shield(read))[name]
        else:
            view = entry[0]
        if view is None:
            raise NotFound(f"deployment {name!r} does not exist; `qctl deploy create` creates one")
        return view

    async def for_routing(self, name: str) -> DeploymentView:
        """get(), except through a registry outage: the last view read, without its canary. Traffic keeps
        flowing on what was vetted, while the guard could not abort a bad canary (nor a change made
        elsewhere be seen); a name never read still fails UNAVAILABLE. A re-read that takes longer than
        ROUTING_READ_WAIT_S counts as an outage (it goes on, and its answer is kept when it comes)."""
        entry = self._entries.get(name)
        try:
            if entry is None or entry[0] is None:
                return await self.get(name)
            return await asyncio.wait_for(self.get(name), self.ROUTING_READ_WAIT_S)
        except (OperationalError, asyncio.TimeoutError) as exc:  # asyncio.TimeoutError: not builtins before 3.11
            entry = self._entries.get(name)
            if entry is None or entry[0] is None:
                raise
            view, read_at = entry
            now = time.monotonic()
            if now - self._outage_logged.get(name, -self.OUTAGE_LOG_S) >= self.OUTAGE_LOG_S:
                self._outage_logged[name] = now
                slow = isinstance(exc, asyncio.TimeoutError)
                why = f"no answer within {self.ROUTING_READ_WAIT_S:.0f} s" if slow else "unreachable"
                log.warning("registry %s: routing deployment %s on its view of %.0f s ago, without its canary", why,
                            name, now - read_at, exc_info=not slow)
            return dataclasses.replace(view, canary=None, canary_percent=0) if view.canary is not None else view

    def put(self, view: DeploymentView) -> None:
        self._names.add(view.name)
        self._store(view.name, view, time.monotonic())

    async def _may_exist(self, name: str) -> bool:
        """Whether the registry's list of names holds `name`, the list read again when older than max_age_s
        (concurrent callers share that read)."""
        if name in self._names:
            return True
        if time.monotonic() - self._names_read_at < self.max_age_s:
            return False
        if self._names_read is None:
            self._names_read = asyncio.ensure_future(self._read_names())
            self._names_read.add_done_callback(lambda _: setattr(self, "_names_read", None))
        await asyncio.shield(self._names_read)
        return name in self._names

    async def _read_names(self) -> None:
        started = time.monotonic()
        names = await self.threads.call(deployment_names, self.registry)
        put_meanwhile = {name for name, (view, read_at) in self._entries.items()
                         if view is not None and read_at > started}
        self._names, self._names_read_at = names | put_meanwhile, started

    def arm_since(self, view: DeploymentView, arm: str) -> float:
        """When the arm's ("stable" or "canary") current run began (wall time): the changes of RUN_KINDS start
        a new one; others (the canary's percentage, the baseline) do not. Every change reset both arms' guard
        window: a canary ramped faster than it gathered --fallback-min-requests reached 100% failing every
        request. The time is the run's event's, written with the clock of the replica that made the change
        (a replica started mid-rollout dated the run from the last change of any kind, a ramp, and never
        judged the failures before it), but no earlier than when this replica first saw the run: one whose
        clock runs behind cannot date a change before what this one measured before it."""
        run, began = view.runs[arm]
        known = self._runs_seen.get((view.name, arm))
        seen = known[1] if known is not None and known[0] == run else time.time()
        return max(began.timestamp(), seen)

    def _store(self, name: str, view: DeploymentView | None, read_at: float) -> None:
        self._entries[name] = (view, read_at)
        if view is None:
            return
        for arm, (run, _) in view.runs.items():
            known = self._runs_seen.get((name, arm))
            if known is None:  # nothing was routed, so nothing measured, on an earlier run here
                self._runs_seen[(name, arm)] = (run, 0.0)
            elif known[0] != run:
                self._runs_seen[(name, arm)] = (run, time.time())

    def names(self) -> list[str]:
        return [name for name, (view, _) in self._entries.items() if view is not None]

    async def refresh(self) -> None:
        """Runs until cancelled: keeps the entries of recently used deployments fresh."""
        while True:
            await asyncio.sleep(self.max_age_s / 2)
            now = time.monotonic()
            for name in [n for n, used in self._used.items() if now - used > self.IDLE_S]:
                del self._used[name]
                entry = self._entries.get(name)
                if entry is not None and entry[0] is None:  # an unknown name nobody asks for any more
                    del self._entries[name]
            # Names the registry said do not exist are not re-read in the background: a client sending
            # random names would have grown every refresh's query with them (for IDLE_S each). A request
            # for one reads it again itself once its entry is max_age_s old, so a deployment created
            # meanwhile is still found.
            known = [name for name in self._used if (entry := self._entries.get(name)) is None or entry[0] is not None]
            if known:
                try:
                    await self._read(known)
                except Exception:  # a registry outage: requests read it themselves (for_routing)
                    log.warning("refreshing deployments from the registry failed", exc_info=True)

    async def _read(self, names: list[str]) -> dict[str, DeploymentView | None]:
        started = time.monotonic()
        views = await self.threads.call(read_deployments, self.registry, names)
        for name, view in views.items():
            entry = self._entries.get(name)
            if entry is None or entry[1] <= started:  # a put() made meanwhile is newer than this read
                self._store(name, view, started)
        return views

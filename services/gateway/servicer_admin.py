"""The Admin service: worker announcements and deployment changes. Thin: auth -> from_pb -> a
registry transaction on a thread of its own pool (the registry blocks; registry_threads.py) -> to_pb; every
change goes into the deployment cache at once so this gateway acts on it without waiting for the cache to age.

A change is made within the client's deadline or not at all: its lock wait is bounded by the time left, and
past the deadline it rolls back instead of committing (a change answered DEADLINE_EXCEEDED and applied seconds
later made the client's retry a second change)."""

from __future__ import annotations

import contextvars
import functools
import logging
import time
from datetime import datetime, timezone

import grpc
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from services.gateway.auth import AdminAuth
from services.gateway.deployments import (
    ArtifactRefView,
    DeploymentCache,
    DeploymentView,
    check_deployment_name,
    timestamp,
    view_of,
)
from services.gateway.fallback import ACTOR as GUARD_ACTOR
from services.gateway.errors import (MAPPED, DeadlinePassed, InvalidRequest, NoWorker, Precondition, details_of,
                                     status_of)
from services.gateway.fleet import FleetView, with_others
from services.gateway.metrics import ArmStats, GatewayMetrics, Outcome, stats_of
from services.gateway.pool import WorkerPool
from services.gateway.registry_threads import RegistryThreads
from shared import registry as reg
from shared.registry import ArmTotals, ArtifactState, Deployment, Event, Registry
from shared.rpc.address import is_host_port
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.rpc.tls import CLIENT_FLAGS, mismatch_hint

log = logging.getLogger(__name__)
# Named so in a registration's refusal: the worker reads it, and has settings of the same names itself.
_GATEWAY_TLS_FLAGS = tuple(f"the gateway's {flag}" for flag in CLIENT_FLAGS)
DEFAULT_EVENTS, MAX_EVENTS = 100, 1000
# How early before the client's deadline a lock wait that ran out counts as the deadline passing (_change).
LOCK_WAIT_SLACK_S = 0.15
# The monotonic time the running rpc's client stops waiting (None: no deadline); set by _admin, read by _change
# on a registry thread (RegistryThreads.call passes context variables on).
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("admin_deadline", default=None)


def _admin(method):
    """Checks the bearer token for this rpc, passes its name as the actor, maps errors to statuses."""

    @functools.wraps(method)
    async def wrapper(self: AdminServicer, request, context: grpc.aio.ServicerContext):
        try:
            actor = self.auth.actor(context.invocation_metadata(), method.__name__)
            remaining = context.time_remaining()
            _deadline.set(None if remaining is None else time.monotonic() + remaining)
            return await method(self, request, actor)
        except MAPPED as exc:
            await context.abort(status_of(exc), details_of(exc))

    return wrapper


def _required(field: str, value: str) -> str:
    if not value:
        raise InvalidRequest(f"{field} is required")
    return value


def _since(at: Timestamp) -> datetime:
    try:
        return at.ToDatetime(tzinfo=timezone.utc)
    except ValueError:  # out of the calendar's range: the client's input, not the gateway's failure
        raise InvalidRequest(f"since ({at.seconds} s, {at.nanos} ns after 1970-01-01 UTC) is not a valid time: "
                             f"give one between 0001-01-01 and 9999-12-31 UTC, or leave it unset") from None


def _refuse_restart_of_auto_aborted(session, deployment, canary: str) -> None:
    # This canary's last rollout event, not the deployment's: another rollout started and aborted by hand in
    # between let the guard-aborted canary back without force.
    last = reg.last_rollout_event(session, deployment, canary=canary)
    if last is not None and last.kind is reg.EventKind.ABORT and last.actor == GUARD_ACTOR \
            and last.detail.get("canary") == canary and last.detail.get("judged", True):
        raise Precondition(
            f"canary {canary} of deployment {deployment.name!r} was aborted by the automatic guard at "
            f"{last.at:%Y-%m-%d %H:%M:%S} UTC ({last.detail.get('reason') or 'over budget'}); it is not "
            f"started again without force (qctl rollout start --force) once you have looked at why"
        )


def _seconds(value: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(value * 1e9))
    return d


class AdminServicer(gateway_pb2_grpc.AdminServicer):
    def __init__(self, registry: Registry, pool: WorkerPool, deployments: DeploymentCache, metrics: GatewayMetrics,
                 auth: AdminAuth, heartbeat_interval_s: float, worker_info_timeout_s: float, started_at: datetime,
                 fleet: FleetView | None = None, threads: RegistryThreads | None = None):
        self.registry = registry
        self.threads = threads or RegistryThreads("registry-admin")
        self.fleet = fleet  # the other gateway replicas' reports (RolloutStatus' fleet counts)
        self.pool = pool
        self.deployments = deployments
        self.metrics = metrics
        self.auth = auth
        self.heartbeat_interval_s = heartbeat_interval_s
        self.worker_info_timeout_s = worker_info_timeout_s
        self.started_at = started_at

    # ---------------------------------------------------------------- workers

    @_admin
    async def RegisterWorker(self, request: gateway_pb2.RegisterWorkerRequest, actor: str):
        if not is_host_port(request.address):
            raise InvalidRequest(f"worker address {request.address!r} is not host:port (e.g. 10.0.0.7:50071)")
        artifact_id = _required("artifact_id", request.artifact_id)
        info = await self._worker_info(request.address)
        # Whether or not this registration is accepted: a refused one must not leave the old entry routing
        # the old artifact's requests to the new process at that address.
        gone = await self.pool.forget_replaced(request.address, info.artifact.artifact_id)
        if gone is not None:
            log.warning("worker %s (%s) registered for artifact %s, but %s now serves %s: removed", gone.worker_id,
                        request.address, gone.artifact.artifact_id, request.address, info.artifact.artifact_id)
        artifact, published_manifest = await self.threads.call(self._servable_artifact, artifact_id)
        if info.artifact.artifact_id != artifact_id:
            raise Precondition(f"the worker at {request.address} serves artifact {info.artifact.artifact_id!r}, "
                               f"not {artifact_id!r}: register it with the artifact it loaded")
        _check_published_manifest(request.address, artifact_id, info.artifact.manifest_sha256, published_manifest)
        capacity = request.capacity or max(1, info.max_running_sequences + info.max_waiting_requests)
        worker = await self.pool.add(request.address, artifact, capacity, info.max_context_tokens,
                                     info.probe_error if info.HasField("probe_error") else None)
        return gateway_pb2.RegisterWorkerResponse(worker_id=worker.worker_id,
                                                  heartbeat_interval=_seconds(self.heartbeat_interval_s))

    def _servable_artifact(self, artifact_id: str) -> tuple[ArtifactRefView, str | None]:
        """The READY artifact, and the sha256 of its published manifest.json (None where not recorded)."""
        with self.registry.transaction() as session:
            artifact = reg.get_artifact(session, artifact_id)
            if artifact.state != ArtifactState.READY:
                raise Precondition(f"artifact {artifact_id} is {artifact.state.value}: only a READY artifact "
                                   f"can be served")
            return ArtifactRefView.of(artifact), artifact.manifest_sha256

    async def _worker_info(self, address: str) -> worker_pb2.WorkerInfo:
        async with self.pool.dial(address) as channel:
            try:
                return await worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(),
                                                                      timeout=self.worker_info_timeout_s)
            except grpc.aio.AioRpcError as err:
                # A TLS mismatch between the gateway and the worker fails here, as any other connection does.
                hint = mismatch_hint(err.details() or "", self.pool.worker_tls is not None, _GATEWAY_TLS_FLAGS)
                raise NoWorker(f"cannot reach the worker at {address}: Info failed with {err.code().name} "
                               f"({err.details()}){hint}") from None

    @_admin
    async def Heartbeat(self, request: gateway_pb2.HeartbeatRequest, actor: str):
        self.pool.heartbeat(request.worker_id, request.running_requests, request.waiting_requests,
                            request.kv_blocks_free, request.draining, request.stalled)
        return gateway_pb2.HeartbeatResponse()

    @_admin
    async def DeregisterWorker(self, request: gateway_pb2.DeregisterWorkerRequest, actor: str):
        await self.pool.remove(request.worker_id)
        return gateway_pb2.DeregisterWorkerResponse()

    @_admin
    async def ListWorkers(self, request: gateway_pb2.ListWorkersRequest, actor: str):
        workers = sorted(self.pool.workers.values(), key=lambda w: w.worker_id)
        return gateway_pb2.ListWorkersResponse(workers=[
            w.to_pb() for w in workers if not request.artifact_id or w.artifact.artifact_id == request.artifact_id
        ])

    # ---------------------------------------------------------------- deployments

    @_admin
    async def CreateDeployment(self, request: gateway_pb2.CreateDeploymentRequest, actor: str):
        check_deployment_name(request.name)
        stable = _required("stable_artifact_id", request.stable_artifact_id)
        baseline = _required("baseline_artifact_id", request.baseline_artifact_id)

        def create(session):
            stable_ref = ArtifactRefView.of(reg.get_artifact(session, stable))
            baseline_ref = ArtifactRefView.of(reg.get_artifact(session, baseline))
            if baseline_ref.format != "fp16":
                raise Precondition(f"baseline artifact {baseline} has format {baseline_ref.format!r}; the "
                                   f"baseline must be an \"fp16\" artifact (the unquantized fallback)")
            if baseline_ref.model_name != stable_ref.model_name:
                raise Precondition(f"stable artifact {stable} is of model {stable_ref.model_name!r} but baseline "
                                   f"{baseline} is of {baseline_ref.model_name!r}: both must be of one model")
            return reg.create_deployment(session, request.name, stable_artifact_id=stable,
                                         baseline_artifact_id=baseline, actor=actor)

        return (await self._change(create)).to_pb()

    @_admin
    async def GetDeployment(self, request: gateway_pb2.GetDeploymentRequest, actor: str):
        return (await self._read(_required("deployment", request.deployment))).to_pb()

    @_admin
    async def ListDeployments(self, request: gateway_pb2.ListDeploymentsRequest, actor: str):
        def read():
            with self.registry.transaction() as session:
                return [view_of(session, d) for d in reg.list_deployments(session)]

        views = await self.threads.call(read)
        for view in views:
            self.deployments.put(view)
        return gateway_pb2.ListDeploymentsResponse(deployments=[v.to_pb() for v in views])

    @_admin
    async def StartRollout(self, request: gateway_pb2.StartRolloutRequest, actor: str):
        name = _required("deployment", request.deployment)
        canary = _required("canary_artifact_id", request.canary_artifact_id)
        percent = request.canary_percent
        if not 1 <= percent <= 100:
            raise InvalidRequest(f"canary_percent {percent} is not accepted: use 1..100")

        def start(session):
            deployment = reg.get_deployment(session, name, for_update=True)
            if deployment.canary_artifact_id == canary:  # the same canary again: a new percentage
                return reg.set_canary_percent(session, name, percent, actor=actor)
            if deployment.canary_artifact_id is None and not request.force:
                _refuse_restart_of_auto_aborted(session, deployment, canary)
            canary_model = reg.get_artifact(session, canary).model_version.model.name
            stable_model = reg.get_artifact(session, deployment.stable_artifact_id).model_version.model.name
            if canary_model != stable_model:
                raise Precondition(f"canary {canary} is of model {canary_model!r}, the stable of deployment "
                                   f"{name!r} is of {stable_model!r}: a canary must be of the stable's model")
            return reg.start_rollout(session, name, canary_artifact_id=canary, percent=percent, actor=actor)

        return (await self._change(start)).to_pb()

    @_admin
    async def PromoteRollout(self, request: gateway_pb2.PromoteRolloutRequest, actor: str):
        name = _required("deployment", request.deployment)
        expected = request.canary_artifact_id or None
        if not request.force:
            view = await self._read(name)
            canary = view.canary.artifact_id if view.canary is not None else None
            if canary is not None and expected in (None, canary):
                self._require_workers(canary, f"promoted, it would take all of the traffic of deployment {name!r} "
                                              f"(served by the baseline, if any, or refused)",
                                      "start its workers first, or promote with force")
                await self._require_served(view)
                expected = canary  # the promote is of the canary just checked, not of one started since
        return (await self._change(
            lambda session: reg.promote(session, name, actor=actor, expected_canary=expected))).to_pb()

    async def _require_served(self, view: DeploymentView) -> None:
        """Refuses to promote a canary that has served no request since its rollout started, across the fleet:
        nothing vouches for it (a canary at 1% that got none yet, or one answering every request "full", which
        the guard does not count as an error, went to 100% at once)."""
        since = self._window_start(view).timestamp()
        _, served = await self._arm_record(view, view.canary, since, time.time())
        if served.requests - served.errors < 1:
            raise Precondition(
                f"canary {view.canary.artifact_id} has served no request since its rollout started "
                f"({served.errors} failed): nothing vouches for it yet; give it traffic first (a higher "
                f"percentage, and see `qctl rollout status`), or promote with force")

    async def _arm_record(self, view: DeploymentView, ref: ArtifactRefView, since: float,
                          now: float) -> tuple[list[Outcome], ArmStats]:
        """The arm's requests at this replica in [since, now], and the stats of the fleet's (what the automatic
        guard judges: these and the other replicas' reports)."""
        outcomes = self.metrics.window(view.name, ref.artifact_id, since, now)
        others = (await self.fleet.others(view.name, ref.artifact_id, since, now)
                  if self.fleet is not None else ArmTotals())
        return outcomes, with_others(outcomes, others)

    @_admin
    async def AbortRollout(self, request: gateway_pb2.AbortRolloutRequest, actor: str):
        name = _required("deployment", request.deployment)
        expected = request.canary_artifact_id or None
        return (await self._change(lambda session: reg.abort_rollout(
            session, name, actor=actor, reason=request.reason, expected_canary=expected))).to_pb()

    @_admin
    async def SetFallback(self, request: gateway_pb2.SetFallbackRequest, actor: str):
        name = _required("deployment", request.deployment)
        if request.enabled and not request.force:
            view = await self._read(name)
            if view.baseline is not None and not view.fallback:
                self._require_workers(view.baseline.artifact_id, f"with fallback on, every request to deployment "
                                      f"{name!r} would go to it and be refused",
                                      "start its workers first, abort the rollout instead, or turn fallback on "
                                      "with force")
        return (await self._change(lambda session: reg.set_fallback(
            session, name, request.enabled, actor=actor, reason=request.reason))).to_pb()

    def _require_workers(self, artifact_id: str, consequence: str, remedy: str) -> None:
        """Refuses a change that would send traffic to an artifact no healthy worker of this gateway serves."""
        if not self.pool.healthy(artifact_id):
            raise Precondition(f"no healthy worker serves artifact {artifact_id} at this gateway: {consequence}; "
                               f"{remedy}")

    @_admin
    async def RolloutStatus(self, request: gateway_pb2.RolloutStatusRequest, actor: str):
        view = await self._read(_required("deployment", request.deployment))
        since = self._window_start(view)
        response = gateway_pb2.RolloutStatusResponse(deployment=view.to_pb(), window_start=timestamp(since))
        arms = (("stable", view.stable), ("canary", view.canary), ("baseline", view.baseline))
        now = time.time()
        for field, ref in arms:
            if ref is None:
                continue
            outcomes, fleet = await self._arm_record(view, ref, since.timestamp(), now)
            metrics = self._arm_pb(ref, stats_of(outcomes))
            metrics.fleet_requests, metrics.fleet_errors = fleet.requests, fleet.errors
            metrics.fleet_tpot_p95.CopyFrom(_seconds(fleet.tpot_p95_s))
            metrics.fleet_ttft_p95.CopyFrom(_seconds(fleet.ttft_p95_s))
            getattr(response, field).CopyFrom(metrics)
        return response

    def _window_start(self, view: DeploymentView) -> datetime:
        if view.canary is not None and view.rollout_started_at is not None:
            return view.rollout_started_at
        return max(self.started_at, view.updated_at)

    def _arm_pb(self, ref: ArtifactRefView, stats: ArmStats) -> gateway_pb2.ArmMetrics:
        return gateway_pb2.ArmMetrics(
            artifact=ref.to_pb(), healthy_workers=len(self.pool.healthy(ref.artifact_id)), requests=stats.requests,
            errors=stats.errors, error_rate=stats.error_rate, ttft_p50=_seconds(stats.ttft_p50_s),
            ttft_p95=_seconds(stats.ttft_p95_s), tpot_p50=_seconds(stats.tpot_p50_s),
            tpot_p95=_seconds(stats.tpot_p95_s), generated_tokens=stats.generated_tokens,
        )

    # ---------------------------------------------------------------- events

    @_admin
    async def ListEvents(self, request: gateway_pb2.ListEventsRequest, actor: str):
        limit = request.limit or DEFAULT_EVENTS
        if limit > MAX_EVENTS:
            raise InvalidRequest(f"limit {limit} is not accepted: use 1..{MAX_EVENTS} (0 = {DEFAULT_EVENTS})")
        since = _since(request.since) if request.HasField("since") else None

        def read():
            stmt = (sa.select(Event, Deployment.name).outerjoin(Deployment, Event.deployment_id == Deployment.id)
                    .order_by(Event.id.desc()).limit(limit))
            if request.deployment:
                stmt = stmt.where(Deployment.name == request.deployment)
            if since is not None:
                stmt = stmt.where(Event.at >= since)
            with self.registry.transaction() as session:
                if request.deployment:  # a misspelt name is NOT_FOUND, not an empty history
                    reg.get_deployment(session, request.deployment)
                return [gateway_pb2.Event(event_id=e.id, time=timestamp(e.at), deployment=name or "", kind=e.kind,
                                          detail=e.detail, actor=e.actor, artifact_id=e.artifact_id or "")
                        for e, name in session.execute(stmt)]

        return gateway_pb2.ListEventsResponse(events=await self.threads.call(read))

    # ---------------------------------------------------------------- helpers

    async def _change(self, change) -> DeploymentView:
        """Runs change(session) -> Deployment in one transaction, within the client's deadline (or rolled back);
        the new snapshot goes into the cache."""

        def run() -> DeploymentView:
            deadline = _deadline.get()
            lock_wait_s = None if deadline is None else max(0.001, deadline - time.monotonic())
            try:
                with self.registry.transaction(lock_wait_s=lock_wait_s) as session:
                    view = view_of(session, change(session))
                    if deadline is not None and time.monotonic() >= deadline:
                        raise DeadlinePassed("the deadline passed before the change was committed; it was not made")
                    return view
            except OperationalError:
                # The lock wait ran out with the deadline: SQLite's busy handler gives up up to 100 ms before its
                # timeout, and the client read a lock held to its deadline as the registry unreachable.
                if deadline is not None and time.monotonic() >= deadline - LOCK_WAIT_SLACK_S:
                    raise DeadlinePassed("the registry stayed locked until the deadline; the change was not made") \
                        from None
                raise

        view = await self.threads.call(run)
        self.deployments.put(view)
        return view

    async def _read(self, name: str) -> DeploymentView:
        def run() -> DeploymentView:
            with self.registry.transaction() as session:
                return view_of(session, reg.get_deployment(session, name))

        view = await self.threads.call(run)
        self.deployments.put(view)
        return view


def _check_published_manifest(address: str, artifact_id: str, loaded: str, published: str | None) -> None:
    """Refuses a worker whose manifest.json (which lists every file's sha256) is not the one published for the
    artifact: a copy changed after publishing and signed again, or a local folder given a published id, served
    under the vetted artifact's name. A worker that does not report it (older than this gateway) is let in."""
    if published is None:
        return
    if not loaded:
        log.warning("worker %s does not report the sha256 of the manifest it loaded for artifact %s (a worker "
                    "older than this gateway): registered unchecked", address, artifact_id)
        return
    if loaded != published:
        raise Precondition(f"the worker at {address} loaded a manifest.json for artifact {artifact_id} with sha256 "
                           f"{loaded[:12]}..., not the published one ({published[:12]}...): its files are not the "
                           f"published artifact's (a changed copy, or a local folder reusing the id); serve the "
                           f"published artifact, or publish these files as an artifact of their own")


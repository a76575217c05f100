"""The worker pool: workers announced through Admin.RegisterWorker, their health (heartbeats, failed
requests, the connection to each) and the gateway's own count of open streams on each, which routing
balances.

A worker is known by its address, but the process behind an address can change: a worker that crashed
(no DeregisterWorker) and another that starts there serving another artifact. gRPC reconnects a channel
silently, so a request routed on the old entry would be served by the new process with the wrong
model. The pool therefore watches each worker's connection: once the connection that was up drops, the
worker gets no requests until it proves it is the same process, alive: its next heartbeat (a new
process has no worker_id; it registers anew, which replaces the entry).

A worker that will not finish the streams open on it has them ended at once, rather than left waiting
for their clients' deadlines: one whose heartbeat says its engine stalled (a hung device: the process
and its heartbeats carry on), and one whose heartbeats stopped. Each open stream registers a callback
with acquire() (removed by release()), which the pool calls then; the stream's owner cancels its worker
call, and retries the request elsewhere when it can (servicer_gateway). A draining worker's streams are
left alone: they are moving, and finishing them is the point of a drain. Nor will a worker finish a stream it
knows nothing of: one whose request, or whose connection, was lost on the way while its heartbeats (on another
connection) carry on. Streams that have had no reply across two heartbeats in a row that said the worker has
nothing running or waiting are ended the same way (_end_unheard), whatever the worker's health.

A failed request marks its worker unhealthy until its next heartbeat (the last healthy worker of its artifact
excepted: see _quarantine). A worker that fails request after
request while its heartbeats carry on (a GPU with ECC errors producing non-finite logits, a broken local
cache) would so get traffic back every heartbeat interval, forever. The pool counts each worker's failed
requests in a row (mark_failed; one it finishes, mark_succeeded, clears the count) and, at
Quarantine.after_failures, quarantines it: its heartbeats leave it unhealthy for Quarantine.first_s, each
further quarantine of the same run twice as long (at most max_s). Once the time is over its next heartbeat
makes it healthy on probation: one more failure quarantines it again, one finished request clears its record.
Only a worker with a healthy peer serving its artifact is quarantined (see _quarantine for why).

A request with a session key goes to the same worker of its artifact while that worker is not much busier
than the least loaded one (rendezvous hashing of the key over the workers' addresses, the same on every
gateway replica): a conversation's next turn starts with the previous ones, whose K/V that worker's prefix
cache still holds. Past AFFINITY_SLACK of capacity above the least loaded, load wins."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone

import grpc

from services.gateway.config import Quarantine
from services.gateway.deployments import ArtifactRefView, timestamp
from services.gateway.errors import AdmissionFull, NoWorker, UnknownName
from shared.rpc.qserve.v1 import gateway_pb2, worker_pb2_grpc
from shared.rpc.tls import ClientTls, ReloadingClientTls, aio_channel

log = logging.getLogger(__name__)
# gRPC drops an idle connection after 30 min by default; the pool would read that as a worker gone.
# Keepalive pings find a connection whose peer vanished without a word (a dead host, NAT or conntrack state
# lost): the gateway sends nothing on a stream it reads, so without them nothing ever notices, and the streams
# on it wait for ever. Every 5 min and no sooner: a worker's gRPC server (default settings) takes pings more
# frequent than that, while it sends nothing, as abuse and closes the connection (GOAWAY too_many_pings) with
# every stream on it. Sent only while calls are open; a stream silent from its start is the first-reply
# timeout's (servicer_gateway) to end sooner.
KEEPALIVE_TIME_MS = 300_000
_CHANNEL_OPTIONS = (("grpc.client_idle_timeout_ms", 2**31 - 1), ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                    ("grpc.keepalive_timeout_ms", 20_000))


# Why a stalled worker gets no requests and loses its open streams (ListWorkers, the streams' failure).
STALLED_REASON = "its engine stalled (no progress with requests in flight)"
# Why a stream the worker knows nothing of is ended (WorkerPool._end_unheard).
UNHEARD_REASON = ("no reply, and two heartbeats in a row report nothing running or waiting (the request or the "
                  "connection was lost on the way)")


# How much busier (open streams over capacity) a session's own worker may be than the least loaded one and still
# get the session's request: its cached prefix saves the prompt's recomputation, but not at any queueing cost.
AFFINITY_SLACK = 0.25


class Health(enum.Enum):
    HEALTHY = gateway_pb2.WORKER_HEALTH_HEALTHY
    UNHEALTHY = gateway_pb2.WORKER_HEALTH_UNHEALTHY
    DRAINING = gateway_pb2.WORKER_HEALTH_DRAINING
    # Its heartbeat says its engine has stopped moving with requests in flight: no new requests, and its
    # open streams are ended (see the module docstring). WorkerHealth has no such value, so ListWorkers
    # shows it UNHEALTHY: it gets no new requests and, unlike a DRAINING one, finishes nothing in flight.
    STALLED = "stalled"

    def to_pb(self) -> int:
        return gateway_pb2.WORKER_HEALTH_UNHEALTHY if self is Health.STALLED else self.value


@dataclass(slots=True, eq=False)
class PooledWorker:
    worker_id: str
    address: str
    artifact: ArtifactRefView
    capacity: int
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    registered_at: datetime
    last_heartbeat: datetime
    last_heartbeat_mono: float
    health: Health = Health.HEALTHY
    failed_reason: str = ""  # why it was marked unhealthy by a failed request; cleared by a heartbeat
    # Its record of failures (WorkerPool.mark_failed / mark_succeeded), clean for a new registration:
    failure_streak: int = 0  # failed requests in a row, none finished in between
    quarantines: int = 0  # quarantines since the streak began; the next one lasts twice as long as the last
    quarantined_until: float = 0.0  # time.monotonic(); 0 = not quarantined
    quarantine_reason: str = ""  # its failed_reason while quarantined
    quarantine_declined: bool = False  # logged once per streak that it was not quarantined: no healthy peer
    in_flight: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    kv_blocks_free: int = 0
    max_context_tokens: int = 0  # from its Info at registration; 0 when unknown
    probe_error: float | None = None  # its start-up probe's, from its Info at registration; None when unchecked
    watcher: asyncio.Task | None = None  # watches the connection (WorkerPool._watch)
    tls_generation: int = 0  # of the pool's client TLS files when its channel was dialled
    # Channels replaced after a TLS rotation while streams were open on them, each with how many still are:
    # closed once none is (a closed channel ends its calls). Counted per channel: closed when the worker had no
    # stream at all, under steady load none ever closed, one more connection kept per worker at each rotation.
    retired_channels: dict[grpc.aio.Channel, int] = field(default_factory=dict)
    channel_streams: int = 0  # streams open on `channel`
    # One callback per open stream that asked to be ended should the worker be unable to finish it
    # (WorkerPool.acquire); called with the reason, and removed, by WorkerPool._end_streams.
    stream_enders: set[Callable[[str], None]] = field(default_factory=set)
    # Those of them whose stream has had no reply from the worker yet (WorkerPool.heard_from), and those that
    # had none at its last heartbeat, if that heartbeat said it has nothing running or waiting (_end_unheard).
    silent_streams: set[Callable[[str], None]] = field(default_factory=set)
    silent_at_idle_beat: set[Callable[[str], None]] = field(default_factory=set)

    def health_label(self) -> str:
        """Its health for the workers gauge (GatewayMetrics.watch_workers): a quarantined worker apart from
        other unhealthy ones, so that an alert can tell a bad GPU among peers from a lost worker (one that has
        also stopped heartbeating is lost: WorkerPool.expire gives it that reason)."""
        if (self.health is Health.UNHEALTHY and self.quarantined_until > time.monotonic()
                and self.failed_reason == self.quarantine_reason):
            return "quarantined"
        return self.health.name.lower()

    def health_reason(self) -> str:
        """Why it gets no requests ('' when healthy or draining): what ListWorkers and qctl show."""
        if self.health is Health.STALLED:
            return STALLED_REASON
        return self.failed_reason if self.health is Health.UNHEALTHY else ""

    def to_pb(self) -> gateway_pb2.WorkerStatus:
        return gateway_pb2.WorkerStatus(
            worker_id=self.worker_id, address=self.address, artifact=self.artifact.to_pb(), capacity=self.capacity,
            health=self.health.to_pb(), health_reason=self.health_reason(), in_flight=self.in_flight,
            running_requests=self.running_requests,
            waiting_requests=self.waiting_requests, kv_blocks_free=self.kv_blocks_free,
            last_heartbeat=timestamp(self.last_heartbeat), registered_at=timestamp(self.registered_at),
            max_context_tokens=self.max_context_tokens, probe_error=self.probe_error,
        )


@dataclass(slots=True)
class WorkerPool:
    heartbeat_timeout_s: float
    # Silent this long, a worker is removed: workers that went away for good (replaced at new addresses)
    # must not pile up in ListWorkers with their channels open. One that comes back registers again.
    forget_after_s: float = 300.0
    worker_tls: ClientTls | None = None  # the gateway's --tls-ca (and client certificate); None = plaintext
    quarantine: Quarantine = field(default_factory=Quarantine)
    workers: dict[str, PooledWorker] = field(default_factory=dict)  # by worker_id
    _tls: ReloadingClientTls = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._tls = ReloadingClientTls(self.worker_tls)

    async def add(self, address: str, artifact: ArtifactRefView, capacity: int,
                  max_context_tokens: int = 0, probe_error: float | None = None) -> PooledWorker:
        """Registers a worker, or refreshes the one already at this address (keeping its worker_id)."""
        now, mono = datetime.now(timezone.utc), time.monotonic()
        await self.forget_replaced(address, artifact.artifact_id)
        existing = self.by_address(address)
        if existing is not None:
            # Registering again is a new process at the address (a worker that heartbeats does not
            # register): the old one's failures, and any quarantine, are not its own.
            if existing.quarantined_until:
                log.warning("worker %s (%s) registered again (a new process): its quarantine is lifted",
                            existing.worker_id, address)
            existing.capacity, existing.health, existing.failed_reason = capacity, Health.HEALTHY, ""
            existing.max_context_tokens, existing.probe_error = max_context_tokens, probe_error
            existing.last_heartbeat, existing.last_heartbeat_mono = now, mono
            _clear_record(existing)
            return existing
        channel = self.dial(address, _CHANNEL_OPTIONS)
        worker = PooledWorker(
            worker_id=uuid.uuid4().hex[:16], address=address, artifact=artifact, capacity=capacity, channel=channel,
            stub=worker_pb2_grpc.WorkerStub(channel), registered_at=now, last_heartbeat=now, last_heartbeat_mono=mono,
            tls_generation=self._tls.generation, max_context_tokens=max_context_tokens, probe_error=probe_error,
        )
        worker.watcher = asyncio.create_task(self._watch(worker), name=f"worker-connection-{address}")
        self.workers[worker.worker_id] = worker
        return worker

    def dial(self, address: str, options: tuple[tuple[str, object], ...] = ()) -> grpc.aio.Channel:
        """A channel to the worker at address: TLS (with the client files as they are now) or plaintext, as the
        gateway is configured to dial workers."""
        return aio_channel(address, self._tls.current(), options)

    async def dial_again_if_tls_renewed(self) -> list[PooledWorker]:
        """Gives every worker a new channel once the client TLS files changed (shared.rpc.tls: an open channel
        reconnects with the files it was dialled with); returns those re-dialled. Streams open on an old
        channel finish on it; it is closed with the last of them."""
        self._tls.current()
        generation = self._tls.generation
        renewed = []
        for worker in [w for w in self.workers.values() if w.tls_generation != generation]:
            await _stop_watching(worker)
            if self.workers.get(worker.worker_id) is not worker:
                continue  # removed meanwhile (during the await): its channel is closed, or will be with its streams
            old = worker.channel
            worker.channel = self.dial(worker.address, _CHANNEL_OPTIONS)
            worker.stub = worker_pb2_grpc.WorkerStub(worker.channel)
            worker.tls_generation = generation
            worker.watcher = asyncio.create_task(self._watch(worker), name=f"worker-connection-{worker.address}")
            if worker.channel_streams:
                worker.retired_channels[old] = worker.channel_streams
                worker.channel_streams = 0
            else:
                await old.close()
            renewed.append(worker)
        return renewed

    async def _watch(self, worker: PooledWorker) -> None:
        """Connects at once (so that a worker that never got a request is watched too) and marks the
        worker unhealthy whenever its connection drops (see the module docstring)."""
        channel = worker.channel
        state = channel.get_state(try_to_connect=True)
        while True:
            await channel.wait_for_state_change(state)
            previous, state = state, channel.get_state()
            if previous is grpc.ChannelConnectivity.READY and state is not grpc.ChannelConnectivity.READY:
                self.connection_lost(worker)

    def connection_lost(self, worker: PooledWorker) -> None:
        if worker.health is not Health.UNHEALTHY:
            worker.health = Health.UNHEALTHY
            worker.failed_reason = "connection lost; waiting for its heartbeat (or a new registration)"
            log.warning("worker %s (%s): connection lost; no requests until it heartbeats or registers again",
                        worker.worker_id, worker.address)

    async def forget_replaced(self, address: str, artifact_id: str) -> PooledWorker | None:
        """The worker registered at this address for another artifact than `artifact_id`, which the
        process there now serves: a new worker is behind the address. Removed and returned (else None)."""
        existing = self.by_address(address)
        if existing is None or existing.artifact.artifact_id == artifact_id:
            return None
        await self.remove(existing.worker_id)
        return existing

    def by_address(self, address: str) -> PooledWorker | None:
        return next((w for w in self.workers.values() if w.address == address), None)

    def get(self, worker_id: str) -> PooledWorker:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownName(f"worker {worker_id!r} is not registered (the gateway may have restarted): "
                              f"register again with RegisterWorker")
        return worker

    def heartbeat(self, worker_id: str, running: int, waiting: int, kv_blocks_free: int, draining: bool,
                  stalled: bool = False) -> None:
        """stalled wins over draining (a stalled worker reports both, for gateways that predate stalled)."""
        worker = self.get(worker_id)
        worker.running_requests, worker.waiting_requests, worker.kv_blocks_free = running, waiting, kv_blocks_free
        worker.last_heartbeat, worker.last_heartbeat_mono = datetime.now(timezone.utc), time.monotonic()
        was_stalled = worker.health is Health.STALLED
        worker.health = Health.STALLED if stalled else Health.DRAINING if draining else Health.HEALTHY
        worker.failed_reason = ""
        if worker.health is Health.HEALTHY and worker.quarantined_until and self._still_quarantined(worker):
            worker.health, worker.failed_reason = Health.UNHEALTHY, worker.quarantine_reason
        if stalled:
            if not was_stalled:
                log.warning("worker %s (%s) reports its engine stalled: no new requests, ending its %d open "
                            "stream(s)", worker.worker_id, worker.address, len(worker.stream_enders))
            # Every heartbeat while stalled, not only the first: cheap (usually none left), and sure.
            self._end_streams(worker, STALLED_REASON)
        elif was_stalled:
            log.warning("worker %s (%s): its engine moves again; taking requests", worker.worker_id, worker.address)
        self._end_unheard(worker, idle=running + waiting == 0)

    def _end_unheard(self, worker: PooledWorker, idle: bool) -> None:
        """Ends the streams that had no reply across two heartbeats in a row that both said the worker has nothing
        running or waiting: it does not know of them (see the module docstring), so nothing would ever answer.
        Two, not one: a heartbeat taken just before a request reached the worker says nothing runs as well."""
        if not idle:
            worker.silent_at_idle_beat = set()
            return
        lost = worker.silent_at_idle_beat & worker.silent_streams
        worker.silent_at_idle_beat = worker.silent_streams - lost
        if lost:
            log.warning("worker %s (%s) reports nothing running or waiting two heartbeats in a row, yet %d stream(s) "
                        "open on it have had no reply: ending them", worker.worker_id, worker.address, len(lost))
        for end in lost:
            worker.stream_enders.discard(end)
            worker.silent_streams.discard(end)
            end(UNHEARD_REASON)

    async def remove(self, worker_id: str) -> PooledWorker:
        """No new requests; the channel stays open while streams are in flight (release closes it)."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            raise UnknownName(f"worker {worker_id!r} is not registered; ListWorkers shows the registered ones")
        await _stop_watching(worker)
        if worker.in_flight == 0:
            await _close_retired(worker)
            await worker.channel.close()
        return worker

    def acquire(self, worker: PooledWorker, end: Callable[[str], None] | None = None) -> grpc.aio.Channel:
        """A stream opened on the worker, on the channel returned (the worker's now: give it to release). end(reason),
        when given, is called (once, at most) if the worker turns out unable to finish it: stalled, its heartbeats
        stopped, or it knows nothing of the stream (_end_unheard; heard_from says the stream had a reply). release()
        with the same end unregisters it."""
        worker.in_flight += 1
        worker.channel_streams += 1
        if end is not None:
            worker.stream_enders.add(end)
            worker.silent_streams.add(end)
        return worker.channel

    def heard_from(self, worker: PooledWorker, end: Callable[[str], None]) -> None:
        """The stream acquired with `end` got its first reply: the worker knows of it (see _end_unheard)."""
        worker.silent_streams.discard(end)

    async def release(self, worker: PooledWorker, end: Callable[[str], None] | None = None,
                      channel: grpc.aio.Channel | None = None) -> None:
        """The stream acquired (on `channel`; None: the worker's channel now) has ended."""
        worker.in_flight -= 1
        if channel is None or channel is worker.channel:
            worker.channel_streams -= 1
        elif channel in worker.retired_channels:
            worker.retired_channels[channel] -= 1
            if not worker.retired_channels[channel]:
                del worker.retired_channels[channel]
                await channel.close()
        worker.stream_enders.discard(end)  # already gone if the pool ended the stream
        worker.silent_streams.discard(end)
        if worker.in_flight == 0:
            await _close_retired(worker)
            if self.workers.get(worker.worker_id) is not worker:
                await worker.channel.close()  # removed while streams were open: the last one closes it

    def mark_failed(self, worker: PooledWorker, reason: str) -> None:
        """A request failed on the worker (not one it refused as full: a full worker is busy, not failing).
        Unhealthy until its next heartbeat, unless it is its artifact's last healthy worker; quarantined once it
        has failed too many in a row (the same exception, _quarantine)."""
        worker.failure_streak += 1
        if worker.health is Health.HEALTHY and self._healthy_peers(worker):
            worker.health, worker.failed_reason = Health.UNHEALTHY, reason
        # The last healthy worker of an artifact keeps its requests, as _quarantine says why: taken out until its
        # next heartbeat, a one-worker canary failing every request sent its share to the stable between beats,
        # showed the guard one failure per heartbeat (15 in a 30 s window) and was never judged (20 needed).
        if self.quarantine.enabled and worker.failure_streak >= self.quarantine.after_failures:
            self._quarantine(worker, reason)

    def mark_draining(self, worker: PooledWorker) -> None:
        """The worker refused a request because it drains: no new requests until a heartbeat says otherwise
        (a worker that is unhealthy or quarantined stays so)."""
        if worker.health is Health.HEALTHY:
            worker.health = Health.DRAINING

    def mark_succeeded(self, worker: PooledWorker) -> None:
        """The worker finished a request (its final message): whatever failed before, it serves. Its record
        is cleared, a quarantine included (it takes requests again from its next heartbeat)."""
        if worker.quarantined_until:
            log.warning("worker %s (%s) finished a request: its quarantine is lifted, requests again from its "
                        "next heartbeat", worker.worker_id, worker.address)
        _clear_record(worker)

    def _quarantine(self, worker: PooledWorker, reason: str) -> None:
        """Quarantines the worker, whose streak of failures has reached the threshold, unless it is already
        quarantined (its requests still in flight failing too) or no other healthy worker serves its artifact.

        That last condition is the point of this design. A quarantine hides one bad worker among good peers;
        it must not hide a bad artifact. The canary guard (fallback.AutoFallback) judges an artifact by the
        failures of its requests: quarantining the only workers of a bad canary would send its traffic to the
        stable (router.fallback_routes), the canary would stop failing, and the guard would never gather the
        errors it needs to abort it; a bad stable without peers would get no traffic at all, where today its
        failures move requests to the baseline and trip the fallback budget. So the last healthy worker of an
        artifact keeps failing in the open, back on each heartbeat as without quarantine."""
        if worker.quarantined_until and time.monotonic() < worker.quarantined_until:
            return
        if self.workers.get(worker.worker_id) is not worker:
            return  # removed meanwhile (its last stream failing): it gets no requests anyway
        if not self._healthy_peers(worker):
            if not worker.quarantine_declined:
                worker.quarantine_declined = True
                log.warning("worker %s (%s) failed %d requests in a row but is the last healthy worker of artifact "
                            "%s: not quarantined, so that the artifact's failures stay visible to the canary guard "
                            "and the fallback budget; last failure: %r", worker.worker_id, worker.address,
                            worker.failure_streak, worker.artifact.artifact_id, reason)
            return
        policy = self.quarantine
        seconds = min(policy.first_s * 2 ** min(worker.quarantines, 64), policy.max_s)
        worker.quarantines += 1
        worker.quarantined_until = time.monotonic() + seconds
        worker.quarantine_reason = (f"quarantined for {seconds:g} s after {worker.failure_streak} consecutive "
                                    f"failed requests: {reason}")
        worker.quarantine_declined = False
        if worker.health is Health.UNHEALTHY:
            worker.failed_reason = worker.quarantine_reason
        # %r: the worker's error text (a CUDA error spans lines) stays one line
        log.warning("worker %s (%s) quarantined for %g s after %d consecutive failed requests (another healthy worker "
                    "serves artifact %s): no requests until then, heartbeats or not; last failure: %r",
                    worker.worker_id, worker.address, seconds, worker.failure_streak, worker.artifact.artifact_id,
                    reason)

    def _still_quarantined(self, worker: PooledWorker) -> bool:
        """For a heartbeat of a quarantined worker: whether the quarantine holds, else it is lifted (its
        time is over, or it has become the last healthy worker of its artifact: see _quarantine)."""
        if time.monotonic() < worker.quarantined_until and self._healthy_peers(worker):
            return True
        why = ("its quarantine is over" if time.monotonic() >= worker.quarantined_until else
               f"no other healthy worker serves artifact {worker.artifact.artifact_id}: quarantine lifted early")
        worker.quarantined_until, worker.quarantine_reason = 0.0, ""
        log.warning("worker %s (%s): %s; taking requests on probation (failing one before it finishes one "
                    "quarantines it again, for longer, while another worker serves its artifact)", worker.worker_id,
                    worker.address, why)
        return False

    def _healthy_peers(self, worker: PooledWorker) -> list[PooledWorker]:
        return [w for w in self.healthy(worker.artifact.artifact_id) if w is not worker]

    def expire(self) -> list[PooledWorker]:
        """Marks unhealthy every worker whose heartbeat is overdue, and ends the streams open on it;
        returns those newly marked."""
        now = time.monotonic()
        overdue = [w for w in self.workers.values() if now - w.last_heartbeat_mono > self.heartbeat_timeout_s]
        expired = [w for w in overdue if w.health is not Health.UNHEALTHY]
        # A quarantined worker that stops heartbeating too is lost, not only quarantined: shown "quarantined"
        # until its quarantine ended (up to max_s), it could be forgotten without ever showing as unhealthy.
        lost = [w for w in overdue if w.quarantined_until and w.failed_reason == w.quarantine_reason]
        for worker in expired + lost:
            worker.health = Health.UNHEALTHY
            worker.failed_reason = f"no heartbeat for {now - worker.last_heartbeat_mono:.1f} s"
        # Every overdue worker, not only those newly marked: one already unhealthy for another reason (a
        # failed request, a lost connection) that has also stopped heartbeating will not finish them either.
        for worker in overdue:
            self._end_streams(worker, f"no heartbeat for {now - worker.last_heartbeat_mono:.1f} s")
        return expired

    def excuse(self, seconds: float) -> None:
        """Moves every worker's heartbeat clock on by `seconds` (never past now): time in which the gateway
        itself was not running, and so could not have heard a heartbeat."""
        now = time.monotonic()
        for worker in self.workers.values():
            worker.last_heartbeat_mono = min(now, worker.last_heartbeat_mono + seconds)

    def _end_streams(self, worker: PooledWorker, reason: str) -> None:
        """Calls, and unregisters, the enders of the streams open on the worker. Each is removed before it
        is called, so a stream is ended once whatever triggers follow (a stalled worker's heartbeats, then
        their expiry)."""
        worker.silent_streams.clear()
        while worker.stream_enders:
            worker.stream_enders.pop()(reason)

    async def forget(self) -> list[PooledWorker]:
        """Removes every worker whose last heartbeat is older than forget_after_s; returns them."""
        now = time.monotonic()
        gone = [w for w in self.workers.values() if now - w.last_heartbeat_mono > self.forget_after_s]
        removed = []
        for worker in gone:
            # Each removal waits for its connection watcher to stop; a worker found silent may meanwhile
            # have deregistered (or registered anew), and is no longer this pool's to remove.
            if self.workers.get(worker.worker_id) is worker:
                removed.append(await self.remove(worker.worker_id))
        return removed

    def healthy(self, artifact_id: str) -> list[PooledWorker]:
        return [w for w in self.workers.values() if w.artifact.artifact_id == artifact_id and w.health is Health.HEALTHY]

    def pick(self, artifact_id: str, exclude: set[str] = frozenset(), session_key: str = "") -> PooledWorker:
        """The least-loaded healthy worker that holds the artifact (open streams over capacity, then its
        last reported queue), ties broken at random so equal workers share the load; with a session key,
        the session's own worker unless it is AFFINITY_SLACK busier (see the module docstring)."""
        candidates = [w for w in self.healthy(artifact_id) if w.worker_id not in exclude]
        if not candidates:
            raise NoWorker(f"no healthy worker serves artifact {artifact_id}")
        open_ = [w for w in candidates if w.in_flight < w.capacity]
        if not open_:
            raise AdmissionFull(f"every worker serving artifact {artifact_id} is at capacity "
                                f"({', '.join(f'{w.address} {w.in_flight}/{w.capacity}' for w in candidates)}); "
                                f"retry later")
        def load(w: PooledWorker) -> float:
            return w.in_flight / w.capacity

        least = min(open_, key=lambda w: (load(w), w.waiting_requests + w.running_requests, random.random()))
        if session_key:
            own = max(open_, key=lambda w: hashlib.blake2b(f"{session_key}\x00{w.address}".encode(),
                                                           digest_size=8).digest())
            if load(own) <= load(least) + AFFINITY_SLACK:
                return own
        return least

    async def close(self) -> None:
        for worker in list(self.workers.values()):
            await _stop_watching(worker)
            await _close_retired(worker)
            await worker.channel.close()
        self.workers.clear()


def _clear_record(worker: PooledWorker) -> None:
    worker.failure_streak = worker.quarantines = 0
    worker.quarantined_until, worker.quarantine_reason, worker.quarantine_declined = 0.0, "", False


async def _close_retired(worker: PooledWorker) -> None:
    while worker.retired_channels:
        channel = next(iter(worker.retired_channels))
        del worker.retired_channels[channel]
        await channel.close()


async def _stop_watching(worker: PooledWorker) -> None:
    if worker.watcher is not None:
        worker.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker.watcher
        worker.watcher = None

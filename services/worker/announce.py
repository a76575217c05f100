"""Announces the worker to a gateway: RegisterWorker, Heartbeat at the interval the gateway returns,
register again when the gateway forgot it (NOT_FOUND), DeregisterWorker on drain or stop.

An unreachable or failing gateway is logged and retried with exponential backoff, never waiting longer
than the heartbeat interval the gateway gave (a restarted gateway gets the worker back at once); it
never stops the worker (which keeps serving direct callers).

Several gateway replicas each keep their own in-memory worker pool, so the worker announces itself to
every replica (GatewayAnnouncers): one GatewayAnnouncer each, with its own channel and task, so that a
replica that is down or hangs delays neither registration with, heartbeats to, nor deregistration from
the others. (Behind one load-balanced address, heartbeats would reach replicas that never saw the
registration, each answering NOT_FOUND and causing a registration again.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from services.worker.engine.outputs import EngineStats
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc
from shared.rpc.tls import ClientTls, ReloadingClientTls, aio_channel, mismatch_hint

log = logging.getLogger(__name__)

RPC_TIMEOUT_S = 10.0
DEREGISTER_TIMEOUT_S = 5.0
# A failed DeregisterWorker (a reset connection) is tried again for this long: a gateway that is gone (refusing
# connections) has forgotten the worker anyway, and must not hold a drain for long.
DEREGISTER_RETRIES_S = 1.0
# gRPC's own reconnection backoff (1 s growing to 120 s) answers every call with the last connection
# failure until its next attempt, so a gateway back up waited for it on top of this loop's backoff. Capped
# at this, each retry of the loop finds the gateway as it is now.
MAX_RECONNECT_BACKOFF_S = 1.0


class GatewayAnnouncer:
    def __init__(
        self,
        gateway_address: str,
        token: str,
        worker_address: str,
        artifact_id: str,
        load: Callable[[], tuple[EngineStats, bool]],  # (engine stats, draining) now
        *,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        tls: ClientTls | None = None,  # the worker's --tls-ca (and client certificate); None = plaintext
        # Whether the engine is stalled now (HeartbeatRequest.stalled: the gateways end the streams open on
        # this worker, as they must not for a drain); None = never.
        stalled: Callable[[], bool] | None = None,
    ):
        self.gateway_address = gateway_address
        self._tls = ReloadingClientTls(tls)
        self._channel_generation = 0  # of self._tls when the channel was dialled
        self.worker_address = worker_address
        self.artifact_id = artifact_id
        self._load = load
        self._stalled = stalled or (lambda: False)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self.worker_id: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._heartbeat_in_flight = False  # stop() cuts a heartbeat short, never a registration
        self._leaving: asyncio.Task | None = None  # after a failed deregistration, until close() (see stop)
        self._interval_s = max_backoff_s  # the heartbeat interval the gateway gave, once registered

    def start(self) -> None:
        self._dial()
        self._task = asyncio.create_task(self._run(), name=f"gateway-announcer-{self.gateway_address}")

    def _dial(self) -> None:
        reconnect_ms = int(1000 * min(self._min_backoff_s, MAX_RECONNECT_BACKOFF_S))
        self._channel = aio_channel(self.gateway_address, self._tls.current(), options=(
            ("grpc.initial_reconnect_backoff_ms", reconnect_ms),
            ("grpc.max_reconnect_backoff_ms", int(1000 * MAX_RECONNECT_BACKOFF_S)),
        ))
        self._channel_generation = self._tls.generation
        self._stub = gateway_pb2_grpc.AdminStub(self._channel)

    async def _dial_again_if_tls_renewed(self) -> None:
        """A new channel once the TLS files changed: the open one would reconnect with the old ones."""
        self._tls.current()
        if self._tls.generation != self._channel_generation:
            old = self._channel
            self._dial()
            log.info("gateway %s: dialled again with the renewed TLS files", self.gateway_address)
            await old.close()

    async def stop(self) -> None:
        """Stops heartbeating and deregisters (best effort: the gateway may be gone). Takes at most
        RPC_TIMEOUT_S (a registration in flight is let finish: its reply carries the id to deregister;
        a heartbeat in flight is cut short: a hung gateway must not hold a drain, and a lost heartbeat
        costs nothing) plus DEREGISTER_RETRIES_S and DEREGISTER_TIMEOUT_S."""
        if self._task is None:
            return
        self._stop.set()
        if self._heartbeat_in_flight:
            self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            if not self._task.cancelled():  # stop() itself was cancelled
                raise
        except Exception:  # the loop died of a bug: still deregister and close below
            log.exception("the announcement to gateway %s failed", self.gateway_address)
        self._task = None
        if self.worker_id is not None and not await self._deregister():
            # Still registered: with its heartbeats stopped the gateway would take the worker for lost after
            # its heartbeat timeout and end the streams a drain lets finish. Until close(), it keeps trying to
            # deregister, and says it is draining in between.
            self._leaving = asyncio.create_task(self._leave_later(), name=f"gateway-leaving-{self.gateway_address}")
            return
        await self.close()

    async def close(self) -> None:
        """Ends stop()'s later deregistration attempts (the drain is over) and closes the channel."""
        if self._leaving is not None:
            self._leaving.cancel()
            try:
                await self._leaving
            except asyncio.CancelledError:
                if not self._leaving.cancelled():
                    raise
            self._leaving = None
        self.worker_id = None
        if self._channel is not None:
            await self._channel.close()

    async def _leave_later(self) -> None:
        log.warning("gateway %s: trying to deregister again until the drain ends, heartbeating as draining "
                    "meanwhile", self.gateway_address)
        pause = min(self._interval_s, 1.0)
        while True:
            await asyncio.sleep(pause)
            if await self._deregister(retry_s=0.0, quiet=True):
                self.worker_id = None
                return
            try:
                await self._heartbeat(draining=True)
            except grpc.aio.AioRpcError as exc:
                log.info("draining heartbeat to gateway %s failed: %s %s", self.gateway_address, exc.code().name,
                         exc.details())
            pause = min(2 * pause, self._interval_s)

    async def _deregister(self, retry_s: float = DEREGISTER_RETRIES_S, quiet: bool = False) -> bool:
        """DeregisterWorker, tried again after a quick failure (a reset connection) for retry_s; whether the
        gateway no longer has the worker. One failed call was the end of it: heartbeats stopped, the gateway took
        the worker for lost after its heartbeat timeout (6 s) and ended every stream still finishing on it,
        cutting a drain's grace short."""
        retry_until = time.monotonic() + retry_s
        pause = 0.1
        while True:
            try:
                await self._stub.DeregisterWorker(
                    gateway_pb2.DeregisterWorkerRequest(worker_id=self.worker_id),
                    metadata=self._metadata, timeout=DEREGISTER_TIMEOUT_S,
                )
                log.info("deregistered worker %s from gateway %s", self.worker_id, self.gateway_address)
                return True
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:  # the gateway has forgotten it already (restarted)
                    return True
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() + pause >= retry_until:
                    (log.debug if quiet else log.warning)(
                        "could not deregister from gateway %s: %s %s", self.gateway_address, exc.code().name,
                        exc.details())
                    return False
                log.info("deregistration from gateway %s failed (%s %s); trying again", self.gateway_address,
                         exc.code().name, exc.details())
            await asyncio.sleep(pause)
            pause *= 2

    async def _run(self) -> None:
        backoff = self._min_backoff_s
        interval = 0.0
        failures = 0  # in a row
        while not self._stop.is_set():
            try:
                await self._dial_again_if_tls_renewed()  # between calls: none is in flight on the old channel
                if self.worker_id is None:
                    interval = await self._register()
                else:
                    await self._heartbeat()
                backoff, failures = self._min_backoff_s, 0
                wait = interval
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND and self.worker_id is not None:
                    log.info("gateway %s no longer knows worker %s; registering again", self.gateway_address,
                             self.worker_id)
                    self.worker_id = None
                    continue
                failure = (f"{exc.code().name} {exc.details()}"
                           f"{mismatch_hint(exc.details() or '', self._tls.current() is not None)}")
                wait, backoff, failures = self._after_failure(failure, backoff, interval, failures + 1)
            except Exception as exc:  # a bug here (e.g. reading the engine's load) must not silently take
                # the worker out of the gateway's pool for good: logged with its traceback, and retried
                wait, backoff, failures = self._after_failure(f"{type(exc).__name__}: {exc}", backoff, interval,
                                                              failures + 1, exc_info=True)
            try:
                await asyncio.wait_for(self._stop.wait(), wait)
            except asyncio.TimeoutError:
                pass

    def _after_failure(self, failure: str, backoff: float, interval: float, failures: int,
                       exc_info: bool = False) -> tuple[float, float, int]:
        """How long to wait before the next try, the next backoff, and the failures in a row (logged)."""
        # Once a gateway has said how often it wants to hear from this worker, no wait is longer: a
        # gateway that restarted has forgotten every worker and serves no traffic until each registers
        # again; the backoff alone (up to max_backoff_s) kept it empty that long after it came back.
        wait = min(backoff, interval) if interval else backoff
        if failures & (failures - 1) == 0:  # the 1st, 2nd, 4th...: a gateway down for long, retried every
            # heartbeat interval, must not flood the log
            log.warning("gateway %s: %s; retrying in %.1f s (%d failed attempt%s in a row)", self.gateway_address,
                        failure, wait, failures, "" if failures == 1 else "s", exc_info=exc_info)
        return wait, min(backoff * 2, self._max_backoff_s), failures

    async def _register(self) -> float:
        response = await self._stub.RegisterWorker(
            gateway_pb2.RegisterWorkerRequest(address=self.worker_address, artifact_id=self.artifact_id),
            metadata=self._metadata, timeout=RPC_TIMEOUT_S,
        )
        self.worker_id = response.worker_id
        interval = response.heartbeat_interval.ToTimedelta().total_seconds() or self._max_backoff_s
        self._interval_s = interval
        log.info("registered with gateway %s as %s (heartbeat every %.1f s)", self.gateway_address,
                 self.worker_id, interval)
        return interval

    async def _heartbeat(self, draining: bool = False) -> None:
        stats, now_draining = self._load()
        draining = draining or now_draining
        stalled = self._stalled()
        self._heartbeat_in_flight = True
        try:
            await self._stub.Heartbeat(
                gateway_pb2.HeartbeatRequest(
                    worker_id=self.worker_id, running_requests=stats.running, waiting_requests=stats.waiting,
                    kv_blocks_free=stats.kv_blocks_free, draining=draining, stalled=stalled,
                ),
                metadata=self._metadata, timeout=RPC_TIMEOUT_S,
            )
        finally:
            self._heartbeat_in_flight = False


class GatewayAnnouncers:
    """The worker announced to each of several gateways (replicas), each by its own GatewayAnnouncer."""

    def __init__(
        self,
        gateway_addresses: Sequence[str],
        token: str,
        worker_address: str,
        artifact_id: str,
        load: Callable[[], tuple[EngineStats, bool]],
        tls: ClientTls | None = None,  # the same for every gateway
        stalled: Callable[[], bool] | None = None,
        **backoff: float,  # min_backoff_s / max_backoff_s of each GatewayAnnouncer
    ):
        self.announcers = tuple(GatewayAnnouncer(address, token, worker_address, artifact_id, load, tls=tls,
                                                 stalled=stalled, **backoff)
                                for address in gateway_addresses)

    def start(self) -> None:
        for announcer in self.announcers:
            announcer.start()

    async def stop(self) -> None:
        """Deregisters from every gateway at once, so a drain waits for the slowest gateway (each
        bounded as GatewayAnnouncer.stop says), not for their sum. One announcer failing in an
        unforeseen way is logged: the others still deregister, and the drain goes on."""
        await self._each("stopping the announcement to", lambda announcer: announcer.stop())

    async def close(self) -> None:
        """At the end of a drain: ends the deregistration attempts stop() left going (see GatewayAnnouncer)."""
        await self._each("closing the connection to", lambda announcer: announcer.close())

    async def _each(self, what: str, call) -> None:
        results = await asyncio.gather(*(call(a) for a in self.announcers), return_exceptions=True)
        for announcer, result in zip(self.announcers, results):
            if isinstance(result, BaseException):
                log.error("%s gateway %s failed", what, announcer.gateway_address, exc_info=result)

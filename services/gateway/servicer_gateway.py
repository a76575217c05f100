"""The Gateway service: Generate picks the arm and the least-loaded worker, relays the worker's
stream and rewrites the final timings as the gateway saw them.

Failure rules: a worker that fails before any token reached the client is marked unhealthy and the
request moves to another worker (same artifact, else a canary's request to the stable, else the
baseline); once tokens were delivered the stream ends UNAVAILABLE with the count, because replaying on
another worker would repeat them. A failed attempt that another attempt follows is counted as an error
of its own arm and artifact (the request's final outcome is counted where it ended): otherwise a canary
whose workers fail every request before the first token would show no errors, only traffic moved
elsewhere, and the automatic guard would never take it out. A client that cancels has its worker call
cancelled and an explicit Worker.Abort sent, so the worker frees the KV blocks even if the cancellation
is lost on the way. A worker that will not finish a stream (its heartbeat says its engine stalled, or its
heartbeats stopped: WorkerPool) has it ended the same way and counted as a failed attempt, under the
rules above: without that the client would wait for its deadline. A draining worker's are left to finish.
A stream on which the worker has sent nothing for --first-reply-timeout-s (a worker that took the request and
hung, or a connection to it that dropped without a word while its heartbeats, on another connection, carry on)
is ended the same way, draining or not, as is one the pool finds the worker knows nothing of
(WorkerPool._end_unheard).

A client that leaves (its cancel, its deadline) before its first token is recorded as having waited that long
for it: a lower bound on its TTFT, which the TTFT budget sees. Counted as a plain success with no TTFT instead,
a canary whose workers take requests but never answer would show no errors and no TTFT, and the guard would
never take it out. It counts as an error of its arm only when it waited past --first-reply-timeout-s: a client
with a short deadline on a healthy but busy worker must not abort a canary.

Each failed attempt also counts towards its worker's quarantine (WorkerPool.mark_failed), and each request
a worker finishes clears that count (mark_succeeded). A worker that answered full (RESOURCE_EXHAUSTED), that
refused the request because it has begun to drain (before its heartbeat said so), or that refused it for the
client's reason does neither, and its refusal is not counted as a failed attempt: it is busy, leaving, or it
validated the request and said no, which shows nothing about whether it can generate (see _relay).

A canary's refusal for the client's reason is put to the stable before the client gets it: a canary whose
workers take less than the stable's (a shorter context window, a stricter check) would otherwise fail its
share of those requests as the clients' fault, where the guard never looks. When the stable serves the
request, the canary's refusal counts as an error of the canary arm; when the stable refuses it too (or has no
worker), the client gets the refusal and nothing is counted. For the same reason a canary's generation that ends
at its context window (LENGTH before the client's max_new_tokens) where the stable's workers have a longer one
counts as an error of the canary arm; the client keeps the tokens it got."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from google.protobuf.duration_pb2 import Duration

from services.gateway import router
from services.gateway.auth import ApiKeys
from services.gateway.config import ApiKey
from services.gateway.deployments import DeploymentCache, DeploymentView, check_deployment_name
from services.gateway.errors import MAPPED, AdmissionFull, InvalidRequest, NoWorker, details_of, status_of
from services.gateway.metrics import GatewayMetrics, Outcome, client_label
from services.gateway.pool import PooledWorker, WorkerPool
from services.gateway.router import Arm, Route
from shared.rpc.qserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from shared.rpc.refusal import refused_for_draining

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0
# A client's request_id is echoed in every message of its stream and in log lines, and its session_key is
# hashed once per candidate worker (pool.pick): both bounded, or one request could make the gateway send
# megabytes per token. The worker takes request ids of up to 256 characters; the gateway adds a suffix.
MAX_REQUEST_ID_CHARS = 128
MAX_SESSION_KEY_CHARS = 256
# Workers take messages of up to gRPC's default 4 MiB, and a worker's request is the client's less its deployment
# and session key plus a request id of the gateway's: a larger one would be refused by every worker in turn, each
# refusal (RESOURCE_EXHAUSTED) read as a full worker, and the client told to retry a request that cannot pass.
MAX_REQUEST_BYTES = 4 * 1024 * 1024 - 1024
# Worker answers that are about the request itself: the client gets them as they are, no retry.
_FULL = "admission full: "  # marks the failure of a worker that answered RESOURCE_EXHAUSTED
_DRAINING = "draining: "  # marks the refusal of a worker that has begun to drain (shared.rpc.refusal)
_CLIENT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS})


class WorkerRejected(Exception):
    """The worker refused the request for a reason that is the client's (passed through as it is)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


@dataclass(slots=True)
class Attempt:
    worker: PooledWorker
    finished: bool = False  # the worker ended the request (a final message, or a refusal for the client)
    failure: str = ""  # why the worker failed it, naming the worker
    lost: str = ""  # why the pool ended it: the worker will not finish it (stalled, or no heartbeats)


@dataclass(slots=True)
class Trace:
    """One request's progress, for timings and metrics."""

    arrival: float
    route: Route
    session_key: str = ""  # the client's: its requests go to the same worker while it has room (pool.pick)
    worker_started: float | None = None
    first_token_at: float | None = None
    delivered: int = 0  # tokens sent to the client
    generated: int | None = None  # from the worker's final message
    finish: common_pb2.Finish | None = None  # the worker's final message
    server_error: bool = False
    left_at: float | None = None  # when the client went away before its first token (client_left)
    # When the arm that serves now took the request: the arrival, or the move from another arm. Its time to the
    # first token counts from there: a canary slow to fail would otherwise put its own delay on the stable's
    # TTFT, and the guard (which judges the stable first) fall back a healthy stable for the canary's fault.
    arm_since: float | None = None

    def move_to(self, route: Route) -> None:
        if route.arm is not self.route.arm:
            self.arm_since = time.monotonic()
        self.route = route

    def waiting_since(self) -> float:
        """When the arm that serves now took the request: its TTFT counts from there."""
        return self.arrival if self.arm_since is None else self.arm_since

    def client_left(self, first_reply_timeout_s: float) -> None:
        """The client went away (its cancel, its deadline, or the gateway stopping). Before its first token, the
        time it waited is its TTFT sample, a lower bound (see the module docstring), and past the first-reply
        timeout (0: off) a failure of its arm: the gateway's own timer would have failed that wait."""
        if self.first_token_at is not None:
            return
        self.left_at = time.monotonic()
        if first_reply_timeout_s and self.left_at - self.waiting_since() > first_reply_timeout_s:
            self.server_error = True

    def outcome(self) -> Outcome:
        now = time.monotonic()
        start = self.waiting_since()
        first = self.first_token_at if self.first_token_at is not None else self.left_at
        ttft = None if first is None else first - start
        tokens = self.delivered if self.generated is None else self.generated
        tpot = (now - self.first_token_at) / (tokens - 1) if self.first_token_at is not None and tokens > 1 else None
        return Outcome(at=time.time(), server_error=self.server_error, ttft_s=ttft, tpot_s=tpot, tokens=self.delivered)


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(max(0, int(seconds * 1e9)))
    return d


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, pool: WorkerPool, deployments: DeploymentCache, metrics: GatewayMetrics, api_keys: ApiKeys,
                 max_concurrent_streams: int, max_streams_per_client: int = 0, first_reply_timeout_s: float = 0.0,
                 stream_stall_timeout_s: float = 0.0):
        self.pool = pool
        self.deployments = deployments
        self.metrics = metrics
        self.api_keys = api_keys
        self.max_concurrent_streams = max_concurrent_streams
        self.max_streams_per_client = max_streams_per_client  # 0 = none
        # A worker that sends nothing for this long after taking a request has failed it (0 = no limit; see _relay)
        self.first_reply_timeout_s = first_reply_timeout_s
        # A stream without progress for this long after the first reply is ended (0 = no limit): the worker's wait
        # between replies (_relay) and the client's, when its buffers are full and a reply cannot be sent (Generate).
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.open_streams = 0
        self._no_streams = asyncio.Event()  # set while open_streams is 0 (see finish_aborts)
        self._no_streams.set()
        self.open_by_client: collections.Counter[ApiKey] = collections.Counter()
        self._aborts: set[asyncio.Task] = set()  # Worker.Abort calls in flight (kept so they are not collected)

    async def Generate(self, request: gateway_pb2.GatewayGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[gateway_pb2.GatewayGenerateResponse]:
        arrival = time.monotonic()
        client = None
        try:
            client = self.api_keys.check(context.invocation_metadata())
            _validate(request)
            if self.open_streams >= self.max_concurrent_streams:
                raise AdmissionFull(f"the gateway has {self.open_streams} streams open, its limit "
                                    f"(max_concurrent_streams) is {self.max_concurrent_streams}; retry later")
            if client is not None and self.max_streams_per_client and \
                    self.open_by_client[client] >= self.max_streams_per_client:
                self.metrics.client_limited.labels(client_label(client)).inc()
                raise AdmissionFull(f"{client.describe()} has {self.open_by_client[client]} streams open, its limit "
                                    f"(max_streams_per_client) is {self.max_streams_per_client}; retry later")
        except MAPPED as exc:
            await self._reject(context, status_of(exc), details_of(exc))
        self.open_streams += 1
        self._no_streams.clear()
        self.metrics.open_streams.inc()
        client_tokens = None  # the client's token counter, looked up once per stream rather than per message
        if client is not None:
            self.open_by_client[client] += 1
            self.metrics.client_requests.labels(client_label(client)).inc()
            client_tokens = self.metrics.client_tokens.labels(client_label(client))
        try:
            # aclosing: a client gone while this generator waits at a yield closes it, and the inner ones
            # must run their finally (worker call cancelled, Worker.Abort, pool slot released) then, not
            # whenever the garbage collector reaches them.
            async with contextlib.aclosing(self._generate(request, arrival, _cache_scope(client))) as replies:
                async for reply in replies:
                    if client_tokens is not None:
                        client_tokens.inc(len(reply.token_ids))
                    # A client that reads nothing (alive, not cancelling) held its worker's slot for good once the
                    # ~4 MB of buffers on the way filled: a reply not taken within the limit ends the stream as a
                    # client gone does (the handler cancelled: worker call cancelled, Worker.Abort, slot freed).
                    stalled = self._stall_timer(asyncio.current_task().cancel)
                    try:
                        yield reply
                    finally:
                        if stalled is not None:
                            stalled.cancel()
        except WorkerRejected as exc:
            await self._reject(context, exc.code, str(exc))
        except MAPPED as exc:
            await self._reject(context, status_of(exc), details_of(exc))
        finally:
            self.open_streams -= 1
            if not self.open_streams:
                self._no_streams.set()
            self.metrics.open_streams.dec()
            if client is not None:
                self.open_by_client[client] -= 1
                if not self.open_by_client[client]:
                    del self.open_by_client[client]

    async def _reject(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
        self.metrics.rejected.labels(code.name).inc()
        await context.abort(code, details)

    async def _generate(self, request: gateway_pb2.GatewayGenerateRequest, arrival: float, cache_scope: str = ""
                        ) -> AsyncIterator[gateway_pb2.GatewayGenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        # The worker-side id must be unique even when clients reuse request ids: a worker refuses a
        # duplicate (ALREADY_EXISTS), and Worker.Abort by id would stop another client's generation.
        # _validate bounds request_id (MAX_REQUEST_ID_CHARS): with the suffix it stays within the worker's limit.
        worker_key = f"{request_id}.{uuid.uuid4().hex[:16]}"
        deployment = await self.deployments.for_routing(request.deployment)
        trace = Trace(arrival=arrival, route=router.choose(deployment, request.session_key),
                      session_key=request.session_key)
        tried: set[str] = set()
        failures: list[str] = []
        failed_route: Route | None = None  # the route of a failed attempt, counted once another one starts
        # A canary's refusal for the client's reason, retried on the stable: (its route, the refusal).
        refused_on_canary: tuple[Route, WorkerRejected] | None = None
        counted = True  # a request turned away by admission (load shedding, not a failure) is not counted
        try:
            while True:
                try:
                    # After a canary's refusal only the stable may judge the request: overflowing to the
                    # baseline (the stable full or without workers) charged a canary as strict as the stable.
                    attempt = Attempt(self._pick(deployment, trace, tried, failures,
                                                 overflow=refused_on_canary is None))
                except (NoWorker, AdmissionFull) as exc:
                    if refused_on_canary is not None:  # no stable worker judged it: the canary's answer stands
                        if failed_route is not None:  # a stable worker that failed it did fail
                            self._record_failed_attempt(deployment, failed_route)
                            failed_route = None
                        trace.move_to(refused_on_canary[0])  # the request is the canary's, refused, uncharged
                        raise refused_on_canary[1] from None
                    if isinstance(exc, AdmissionFull):
                        raise
                    busy = [f for f in failures if not f.startswith(_DRAINING)]
                    if busy and all(f.startswith(_FULL) for f in busy):  # alive, only busy
                        raise AdmissionFull(f"every worker tried is at its admission limit; retry later "
                                            f"({'; '.join(f.removeprefix(_FULL) for f in failures)})") from exc
                    raise
                if failed_route is not None:
                    self._record_failed_attempt(deployment, failed_route)
                    failed_route = None
                tried.add(attempt.worker.worker_id)
                worker_request = _worker_request(request, f"{worker_key}.{len(tried)}", cache_scope)
                try:
                    async with contextlib.aclosing(self._relay(attempt, worker_request, request_id, trace)) as replies:
                        async for reply in replies:
                            yield reply
                except WorkerRejected as exc:
                    if trace.route.arm is not Arm.CANARY or trace.delivered:
                        raise
                    # A canary whose workers take less (a shorter context window, a stricter check) would fail
                    # its share of such requests as the client's fault, unseen by the guard: the stable decides.
                    log.warning("deployment %s: the canary's worker %s refused request %r (%s: %s); trying the "
                                "stable", deployment.name, attempt.worker.address, request_id, exc.code.name, exc)
                    refused_on_canary = (trace.route, exc)
                    trace.move_to(Route(Arm.STABLE, deployment.stable))
                    continue
                if attempt.finished:
                    # The stable served what the canary refused: the canary's error. A stable worker that
                    # failed, was full or draining never judged the request: the canary is not charged (and
                    # when no stable worker is left to ask, its refusal goes to the client).
                    if refused_on_canary is not None:
                        self._record_failed_attempt(deployment, refused_on_canary[0])
                        refused_on_canary = None
                    cut_short = self._cut_short_by_canary(deployment, request, trace, attempt.worker)
                    if cut_short:
                        log.warning("deployment %s: request %r %s; counted as an error of the canary arm",
                                    deployment.name, request_id, cut_short)
                        trace.server_error = True
                    return
                failures.append(attempt.failure)
                if not _routine(attempt.failure):
                    failed_route = trace.route
                if trace.delivered:
                    raise NoWorker(
                        f"worker {attempt.worker.address} failed after {trace.delivered} tokens were delivered "
                        f"({attempt.failure}); the stream ends here because another worker would repeat them: "
                        f"retry the request, or continue from the tokens received"
                    )
        except NoWorker:
            trace.server_error = True
            raise
        except (asyncio.CancelledError, GeneratorExit):
            trace.client_left(self.first_reply_timeout_s)
            raise
        except AdmissionFull:
            counted = False
            # The request is shed, but a worker that failed it before the others turned out full did fail:
            # uncounted, a canary failing under load would stay hidden from the guard.
            if failed_route is not None:
                self._record_failed_attempt(deployment, failed_route)
            raise
        finally:
            if counted:
                self.metrics.record(deployment.name, trace.route.arm.label, trace.route.artifact.artifact_id,
                                    trace.outcome())

    def _cut_short_by_canary(self, deployment: DeploymentView, request: gateway_pb2.GatewayGenerateRequest,
                             trace: Trace, worker: PooledWorker) -> str:
        """Why a canary's finished generation stopped at its context window where the stable's workers would
        have gone on ('' when it did not). The client keeps what it got (the tokens are delivered), but a
        canary whose workers have a shorter window would otherwise cut long generations short unseen by the
        guard, as a refusal of long prompts would be (see _generate)."""
        finish = trace.finish
        if trace.route.arm is not Arm.CANARY or finish is None or finish.reason != common_pb2.FINISH_REASON_LENGTH:
            return ""
        asked = request.sampling.max_new_tokens
        if asked and finish.generated_tokens >= asked:
            return ""  # the client's own limit
        used = finish.prompt_tokens + finish.generated_tokens
        if not worker.max_context_tokens or used < worker.max_context_tokens:
            return ""  # not its window (a worker that did not tell it is not judged)
        stable_window = max((w.max_context_tokens for w in self.pool.healthy(deployment.stable.artifact_id)),
                            default=0)  # 0: no healthy stable worker, or none told its window
        if stable_window <= used:
            return ""
        return (f"ended at the canary's context window ({finish.prompt_tokens} prompt + {finish.generated_tokens} "
                f"generated tokens) where the stable's workers take {stable_window}")

    def _record_failed_attempt(self, deployment: DeploymentView, route: Route) -> None:
        self.metrics.record(deployment.name, route.arm.label, route.artifact.artifact_id,
                            Outcome(at=time.time(), server_error=True, ttft_s=None, tpot_s=None, tokens=0))

    def _pick(self, deployment: DeploymentView, trace: Trace, tried: set[str], failures: list[str],
              overflow: bool = True) -> PooledWorker:
        """A worker for the request's arm, else (overflow) for the next of its fallback routes (router.fallback_routes).
        An arm whose workers are all at capacity (by this gateway's count) overflows like one without workers,
        as it does when its workers answer full themselves (see _generate); AdmissionFull (shed: retry later)
        only when no route has a worker with room."""
        chosen = trace.route
        full: AdmissionFull | None = None
        try:
            return self.pool.pick(chosen.artifact.artifact_id, exclude=tried, session_key=trace.session_key)
        except NoWorker:
            pass
        except AdmissionFull as exc:
            full = exc
        fallbacks = router.fallback_routes(deployment, chosen) if overflow else []
        for route in fallbacks:
            try:
                worker = self.pool.pick(route.artifact.artifact_id, exclude=tried, session_key=trace.session_key)
            except NoWorker:
                continue
            except AdmissionFull as exc:
                full = full or exc
                continue
            trace.move_to(route)
            log.warning("deployment %s: no healthy worker%s for the %s arm (%s), sending to the %s arm (%s)",
                        deployment.name, " with room" if full is not None else "", chosen.arm.label,
                        chosen.artifact.artifact_id, route.arm.label, route.artifact.artifact_id)
            return worker
        if full is not None:
            raise full
        # counted against the arm that was chosen: it is the one without workers
        raise NoWorker(_unavailable(deployment, chosen, fallbacks, failures))

    async def _relay(self, attempt: Attempt, worker_request: worker_pb2.GenerateRequest, request_id: str,
                     trace: Trace) -> AsyncIterator[gateway_pb2.GatewayGenerateResponse]:
        """Streams one attempt; sets attempt.finished, or attempt.failure when the worker failed. Raises
        WorkerRejected for a refusal that is the client's to fix."""
        worker = attempt.worker
        call = worker.stub.Generate(worker_request)

        def lose(reason: str) -> None:
            # Called by the pool when the worker will not finish this stream. Cancelling the call ends the
            # read below at once, whether it is waiting on the worker or resumes after a yield: no polling.
            attempt.lost = reason
            call.cancel()

        channel = self.pool.acquire(worker, lose)
        trace.worker_started = time.monotonic()
        timer = self._first_reply_timer(lose)
        silent = True  # nothing received from the worker yet
        artifact_id, arm = trace.route.artifact.artifact_id, trace.route.arm.value
        stall_reason = f"sent nothing for the stream-stall timeout of {self.stream_stall_timeout_s:g} s mid-stream"
        try:
            async for reply in call:
                if silent:  # it answers: neither the timer nor the pool's check for unheard streams applies now
                    silent = False
                    self.pool.heard_from(worker, lose)
                if timer is not None:  # the first-reply timer, or the stall timer armed after the last reply
                    timer.cancel()
                    timer = None
                if reply.token_ids and trace.first_token_at is None:
                    trace.first_token_at = time.monotonic()
                trace.delivered += len(reply.token_ids)
                out = gateway_pb2.GatewayGenerateResponse(request_id=request_id, token_ids=reply.token_ids,
                                                          text=reply.text, artifact_id=artifact_id, arm=arm)
                if reply.HasField("finish") and reply.finish.reason == common_pb2.FINISH_REASON_ABORT:
                    # The worker gave the request up itself: its drain's grace ran out or its engine stops (the
                    # gateway's own aborts cancel the call first, so their final message is never read here).
                    # Not a finished request: retried elsewhere when nothing was delivered, else it ends as any
                    # failed attempt does; what the worker still sent with it goes out first.
                    if trace.delivered and (reply.token_ids or reply.text):
                        yield out
                    self.pool.mark_draining(worker)
                    attempt.failure = f"{_DRAINING}{worker.address}: the worker aborted the request itself " \
                                      f"(draining or stopping)"
                    log.warning("request %r on worker %s: %s after %d tokens", request_id, worker.address,
                                attempt.failure, trace.delivered)
                    return
                if reply.HasField("finish"):
                    attempt.finished = True
                    self.pool.mark_succeeded(worker)
                    trace.generated, trace.finish = reply.finish.generated_tokens, reply.finish
                    out.finish.CopyFrom(self._finish(reply.finish, trace))
                    yield out
                    return
                yield out
                # Armed while this waits on the worker for the next reply, not while the yield above waited on the
                # client: a worker that hangs one stream while its engine moves (heartbeats healthy) kept the
                # client waiting for ever.
                timer = self._stall_timer(lambda: lose(stall_reason))
            attempt.failure = f"{worker.address}: the stream ended without a final message"
        except asyncio.CancelledError:
            # grpc.aio ends the read of a call cancelled locally (by lose()) with CancelledError too; only
            # this task's own cancellation (the client went away, the gateway is stopping) goes on as one.
            if not attempt.lost or _cancelling(asyncio.current_task()):
                raise
            attempt.failure = f"{worker.address}: {attempt.lost}"
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code in _CLIENT_CODES:
                # Neither a failure of the worker nor proof that it works: no mark_failed, no mark_succeeded.
                # A worker refuses such requests while validating them, before its engine runs; a worker whose
                # generation is broken (non-finite logits on a faulty GPU) refuses them just as well, and a
                # client sending bad requests must not keep clearing its record and so its quarantine.
                attempt.finished = True
                raise WorkerRejected(code, err.details() or code.name) from None
            if refused_for_draining(err):
                # Asked in the moment between the start of its drain and the heartbeat that says so.
                self.pool.mark_draining(worker)
                attempt.failure = f"{_DRAINING}{worker.address}: {err.details()}"
            else:
                attempt.failure = (_FULL if code is grpc.StatusCode.RESOURCE_EXHAUSTED else "") + \
                    f"{worker.address}: {code.name}: {err.details()}"
        finally:
            if timer is not None:
                timer.cancel()
            if not attempt.finished and (attempt.lost or not attempt.failure):
                # The client went away (or the gateway is stopping), or the pool gave up on the worker: stop
                # the worker's work now (a worker that merely stalled frees the request's KV blocks).
                call.cancel()
                self._send_abort(worker, worker_request.request_id)
            await self.pool.release(worker, lose, channel)
        if not _routine(attempt.failure):
            self.pool.mark_failed(worker, attempt.failure)
        # %r: the client's request id and the worker's error text (a CUDA error spans lines) stay one line.
        log.warning("request %r on worker %s failed after %d tokens: %r", request_id, worker.address,
                    trace.delivered, attempt.failure)

    def _stall_timer(self, on_stall: Callable[[], None]) -> asyncio.TimerHandle | None:
        """on_stall() after stream_stall_timeout_s unless cancelled first; None when the limit is off."""
        if not self.stream_stall_timeout_s:
            return None
        return asyncio.get_running_loop().call_later(self.stream_stall_timeout_s, on_stall)

    def _first_reply_timer(self, lose: Callable[[str], None]) -> asyncio.TimerHandle | None:
        """Fails the attempt (lose) when the worker has sent nothing within first_reply_timeout_s; None when off.
        Neither the connection's state nor the heartbeats (on another connection) show a stream that a worker
        took and hung on, or one lost with a connection that dropped without a word: its client would wait for
        its deadline, or for ever, while a healthy peer could serve it. Lost, it is retried like any failure
        before the first token, and counts towards the worker's quarantine."""
        if not self.first_reply_timeout_s:
            return None
        reason = f"sent nothing within the first-reply timeout of {self.first_reply_timeout_s:g} s"
        return asyncio.get_running_loop().call_later(self.first_reply_timeout_s, lose, reason)

    def _send_abort(self, worker: PooledWorker, worker_request_id: str) -> None:
        async def abort() -> None:
            try:
                await worker_pb2_grpc.WorkerStub(channel).Abort(worker_pb2.AbortRequest(request_id=worker_request_id),
                                                                timeout=ABORT_TIMEOUT_S)
            except Exception as err:  # the cancelled call alone still frees the blocks; nothing left unretrieved
                why = err.code().name if isinstance(err, grpc.aio.AioRpcError) else repr(err)
                log.info("Abort of %s on %s failed: %s", worker_request_id, worker.address, why)
            finally:
                await self.pool.release(worker, channel=channel)

        # The Abort holds the worker as a stream does: the stream's own release follows at once, and the last
        # release closes the channel of a worker removed meanwhile (draining), which the Abort still needs. The
        # worker holds the request until the Abort (or the cancel) reaches it, so it is rightly counted busy.
        channel = self.pool.acquire(worker)
        task = asyncio.ensure_future(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def finish_aborts(self, timeout_s: float = ABORT_TIMEOUT_S) -> None:
        """At gateway stop, once the server has stopped and before the pool closes the channels: the streams it
        cancelled end (on the next turns of the loop: each sends its Worker.Abort then) and the Aborts in flight
        finish, within timeout_s in all; the Aborts still running then are cancelled."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)
        pending = set(self._aborts)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)

    def _finish(self, finish: common_pb2.Finish, trace: Trace) -> common_pb2.Finish:
        now = time.monotonic()
        total = now - trace.arrival
        routed = (trace.worker_started or now) - trace.arrival
        ttft = (trace.first_token_at - trace.arrival) if trace.first_token_at is not None else 0.0
        generated = finish.generated_tokens
        tpot = (total - ttft) / (generated - 1) if generated > 1 and trace.first_token_at is not None else 0.0
        queue = routed + finish.timings.queue.ToTimedelta().total_seconds()
        return common_pb2.Finish(
            reason=finish.reason, prompt_tokens=finish.prompt_tokens, generated_tokens=generated,
            timings=common_pb2.Timings(queue=_duration(queue), time_to_first_token=_duration(ttft),
                                       time_per_output_token=_duration(tpot), total=_duration(total)),
        )


def _routine(failure: str) -> bool:
    """A full worker is busy and a draining one is leaving; neither is broken: no mark_failed, and the
    attempt is not counted as a failure of its arm."""
    return failure.startswith((_FULL, _DRAINING))


def _cancelling(task: asyncio.Task) -> bool:
    """Whether the task itself is being cancelled. Python 3.10 (pyproject allows it) has no Task.cancelling():
    there a cancelled read with attempt.lost set is taken for a lost stream, so a client that leaves at that
    very moment may have its request tried once more elsewhere, for nobody (rare, and only on 3.10)."""
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False


def _unavailable(deployment: DeploymentView, chosen: Route, fallbacks: list[Route], failures: list[str]) -> str:
    where = f"artifact {chosen.artifact.artifact_id} ({chosen.arm.label} arm)"
    for route in fallbacks:
        where += f" nor its {route.arm.label} {route.artifact.artifact_id}"
    tried = f"; tried: {'; '.join(failures)}" if failures else ""
    return f"deployment {deployment.name!r}: no healthy worker serves {where}{tried}; retry later"


def _validate(request: gateway_pb2.GatewayGenerateRequest) -> None:
    if not request.deployment:
        raise InvalidRequest("deployment is required: the name of a deployment (`qctl deploy create` makes one)")
    check_deployment_name(request.deployment)  # before the name reaches the deployment cache or the registry
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:  # worded as the worker words it (worker/requests.py)
        raise InvalidRequest(f"request_id has {len(request.request_id)} characters; at most {MAX_REQUEST_ID_CHARS}")
    if len(request.session_key) > MAX_SESSION_KEY_CHARS:
        raise InvalidRequest(f"session_key has {len(request.session_key)} characters; at most "
                             f"{MAX_SESSION_KEY_CHARS}")
    if request.ByteSize() > MAX_REQUEST_BYTES:
        raise InvalidRequest(f"the request is {request.ByteSize()} bytes; at most {MAX_REQUEST_BYTES} (a worker's "
                             f"message limit)")
    which = request.WhichOneof("prompt")
    if which is None or (which == "text" and not request.text) or (which == "token_ids" and not request.token_ids.ids):
        raise InvalidRequest("prompt is required: give a non-empty text or a non-empty token_ids list")


def _cache_scope(client: ApiKey | None) -> str:
    """Each API key's own prefix-cache scope on the workers: shared, a client could time whether another's prompt
    prefix (a system prompt, a document) was cached. A digest, not the key nor its name (two keys may share a
    name, and a worker need not know the key)."""
    if client is None:
        return ""
    return hashlib.sha256(b"qserve cache scope\0" + client.key.encode()).hexdigest()[:32]


def _worker_request(request: gateway_pb2.GatewayGenerateRequest, worker_request_id: str,
                    cache_scope: str = "") -> worker_pb2.GenerateRequest:
    out = worker_pb2.GenerateRequest(request_id=worker_request_id, sampling=request.sampling, cache_scope=cache_scope)
    if request.WhichOneof("prompt") == "text":
        out.text = request.text
    else:
        out.token_ids.CopyFrom(request.token_ids)
    return out

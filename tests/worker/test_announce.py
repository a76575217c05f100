"""The gateway announcement against fake Admin services: register, heartbeat with the load,
register again on NOT_FOUND, retry an unreachable gateway with backoff, deregister on stop/drain;
with several gateways, each on its own: one that hangs delays none of the others; a drain cuts a hung
heartbeat short, and deregisters even after the loop died."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
from google.protobuf import duration_pb2

from services.worker import announce
from services.worker.announce import GatewayAnnouncer, GatewayAnnouncers
from services.worker.config import WorkerConfig
from services.worker.engine.outputs import EngineStats
from services.worker.server import WorkerServer
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc

TOKEN = "admin-token"


class FakeAdmin(gateway_pb2_grpc.AdminServicer):
    def __init__(self):
        self.calls: list[tuple] = []
        self.known: set[str] = set()
        self.auth: set[str | None] = set()
        self.stalled: list[bool] = []  # HeartbeatRequest.stalled of each heartbeat
        self._n = 0

    async def RegisterWorker(self, request, context):
        self.auth.add(dict(context.invocation_metadata()).get("authorization"))
        self._n += 1
        worker_id = f"w{self._n}"
        self.known.add(worker_id)
        self.calls.append(("register", request.address, request.artifact_id))
        return gateway_pb2.RegisterWorkerResponse(worker_id=worker_id,
                                                  heartbeat_interval=duration_pb2.Duration(nanos=50_000_000))

    async def Heartbeat(self, request, context):
        self.auth.add(dict(context.invocation_metadata()).get("authorization"))
        if request.worker_id not in self.known:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {request.worker_id}")
        self.calls.append(("heartbeat", request.worker_id, request.running_requests, request.kv_blocks_free,
                           request.draining))
        self.stalled.append(request.stalled)
        return gateway_pb2.HeartbeatResponse()

    async def DeregisterWorker(self, request, context):
        self.known.discard(request.worker_id)
        self.calls.append(("deregister", request.worker_id))
        return gateway_pb2.DeregisterWorkerResponse()


class HungAdmin(FakeAdmin):
    """A gateway that accepts connections but never answers a registration (overloaded, half up)."""

    async def RegisterWorker(self, request, context):
        self.calls.append(("register", request.address, request.artifact_id))
        await asyncio.Event().wait()


class SlowDeregistrationAdmin(FakeAdmin):
    """Records whether the worker was already refusing requests when it was deregistered."""

    def __init__(self, latency_s: float, draining):
        super().__init__()
        self.latency_s, self.draining, self.draining_at_deregistration = latency_s, draining, []

    async def DeregisterWorker(self, request, context):
        self.draining_at_deregistration.append(self.draining())
        await asyncio.sleep(self.latency_s)
        return await super().DeregisterWorker(request, context)


async def _fake_gateway(port: int = 0,
                        admin: FakeAdmin | None = None) -> tuple[grpc.aio.Server, FakeAdmin, int]:
    admin = admin or FakeAdmin()
    server = grpc.aio.server()
    gateway_pb2_grpc.add_AdminServicer_to_server(admin, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, admin, port


async def _until(predicate, timeout_s=10.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _load():
    return EngineStats(running=3, waiting=1, kv_blocks_total=10, kv_blocks_free=7, kv_blocks_used=3, preemptions=0), False


def test_register_heartbeat_reregister_and_deregister():
    async def scenario():
        server, admin, port = await _fake_gateway()
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, _load)
        announcer.start()
        await _until(lambda: sum(c[0] == "heartbeat" for c in admin.calls) >= 2)
        assert admin.calls[0] == ("register", "127.0.0.1:1234", "a" * 32)
        assert ("heartbeat", "w1", 3, 7, False) in admin.calls
        admin.known.clear()  # the gateway restarted and forgot the worker
        await _until(lambda: ("heartbeat", "w2", 3, 7, False) in admin.calls)
        await announcer.stop()
        assert admin.calls[-1] == ("deregister", "w2")
        assert admin.auth == {f"Bearer {TOKEN}"}
        await server.stop(0)

    asyncio.run(scenario())


def test_heartbeats_say_whether_the_engine_is_stalled():
    """Separate from draining: a gateway ends a stalled worker's streams, and leaves a draining one's."""
    stalled = False

    async def scenario():
        nonlocal stalled
        server, admin, port = await _fake_gateway()
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, _load,
                                     stalled=lambda: stalled)
        announcer.start()
        await _until(lambda: admin.stalled)
        stalled = True
        await _until(lambda: admin.stalled[-1])
        stalled = False
        await _until(lambda: not admin.stalled[-1])
        assert admin.stalled[0] is False and True in admin.stalled
        await announcer.stop()
        await server.stop(0)

    asyncio.run(scenario())


def test_an_unreachable_gateway_is_retried_until_it_answers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def scenario():
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "b" * 32, _load,
                                     min_backoff_s=0.05, max_backoff_s=0.2)
        announcer.start()
        await asyncio.sleep(0.5)  # several failed attempts, logged, nothing raised
        assert announcer.worker_id is None and not announcer._task.done()
        server, admin, _ = await _fake_gateway(port)
        await _until(lambda: any(c[0] == "heartbeat" for c in admin.calls))
        await announcer.stop()
        assert admin.calls[-1][0] == "deregister"
        await server.stop(0)

    asyncio.run(scenario())


def test_a_worker_announces_itself_and_deregisters_when_draining(artifacts):
    async def scenario():
        server, admin, port = await _fake_gateway()
        worker = WorkerServer(WorkerConfig(artifact=str(artifacts["fp16"]), port=0, metrics_port=None, kv_blocks=16,
                                           gateway_addresses=(f"127.0.0.1:{port}",), gateway_token=TOKEN))
        worker_port = await worker.start()
        await _until(lambda: any(c[0] == "heartbeat" for c in admin.calls))
        manifest = worker.served.artifact.reader.manifest
        assert admin.calls[0] == ("register", f"127.0.0.1:{worker_port}", manifest.artifact_id)
        assert ("heartbeat", "w1", 0, 16, False) in admin.calls
        await worker.stop(grace_s=0)
        assert admin.calls[-1] == ("deregister", "w1")
        await server.stop(0)

    asyncio.run(scenario())


def test_a_worker_on_a_wildcard_host_without_an_advertised_address_says_the_gateways_cannot_dial_it(artifacts, caplog):
    """--host 0.0.0.0 and no --advertise-address: the worker announced 0.0.0.0:port, which only a gateway on
    the same host can dial; every other gateway marked it broken with no hint why."""
    async def scenario():
        server, admin, port = await _fake_gateway()
        worker = WorkerServer(WorkerConfig(artifact=str(artifacts["fp16"]), host="0.0.0.0", port=0, metrics_port=None,
                                           kv_blocks=16, gateway_addresses=(f"127.0.0.1:{port}",), gateway_token=TOKEN))
        with caplog.at_level("WARNING", logger="services.worker.server"):
            await worker.start()
        await worker.stop(grace_s=0)
        await server.stop(0)

    asyncio.run(scenario())
    assert any("--advertise-address" in r.getMessage() for r in caplog.records)


def _heartbeats(admin: FakeAdmin) -> int:
    return sum(c[0] == "heartbeat" for c in admin.calls)


def test_a_hung_gateway_delays_neither_registration_with_nor_heartbeats_to_the_other(monkeypatch):
    monkeypatch.setattr(announce, "RPC_TIMEOUT_S", 2.0)

    async def scenario():
        hung_server, hung, hung_port = await _fake_gateway(admin=HungAdmin())
        server, admin, port = await _fake_gateway()
        announcers = GatewayAnnouncers((f"127.0.0.1:{hung_port}", f"127.0.0.1:{port}"), TOKEN, "127.0.0.1:1234",
                                       "c" * 32, _load)
        started = time.monotonic()
        announcers.start()
        await _until(lambda: _heartbeats(admin) >= 3, timeout_s=announce.RPC_TIMEOUT_S)
        assert time.monotonic() - started < announce.RPC_TIMEOUT_S  # long before the hung call gives up
        assert hung.calls == [("register", "127.0.0.1:1234", "c" * 32)]
        # The hung registration ends at its deadline and is retried; stop waits at most for that deadline.
        await announcers.stop()
        assert admin.calls[-1] == ("deregister", "w1")
        await server.stop(0)
        await hung_server.stop(0)

    asyncio.run(scenario())


def test_a_draining_worker_deregisters_from_every_gateway_at_once_before_refusing_requests(artifacts):
    latency_s = 0.5

    async def scenario():
        worker = None
        admins = [SlowDeregistrationAdmin(latency_s, lambda: worker.servicer.draining) for _ in range(2)]
        gateways = [await _fake_gateway(admin=admin) for admin in admins]
        worker = WorkerServer(WorkerConfig(
            artifact=str(artifacts["fp16"]), port=0, metrics_port=None, kv_blocks=16, gateway_token=TOKEN,
            gateway_addresses=tuple(f"127.0.0.1:{port}" for _, _, port in gateways)))
        worker_port = await worker.start()
        await _until(lambda: all(_heartbeats(admin) for admin in admins))
        for admin in admins:
            assert admin.calls[0] == ("register", f"127.0.0.1:{worker_port}", worker.served.artifact.artifact_id)
        started = time.monotonic()
        await worker.drain(grace_s=0)
        elapsed = time.monotonic() - started
        assert worker.servicer.draining
        await worker.stop(grace_s=0)
        assert [admin.calls[-1] for admin in admins] == [("deregister", "w1")] * 2
        assert [admin.draining_at_deregistration for admin in admins] == [[False]] * 2
        assert elapsed < 1.8 * latency_s, f"drain took {elapsed:.2f} s: one gateway after the other?"
        for server, _, _ in gateways:
            await server.stop(0)

    asyncio.run(scenario())


class HungHeartbeatAdmin(FakeAdmin):
    """Registers, then never answers a heartbeat (a gateway overloaded or half up)."""

    def __init__(self):
        super().__init__()
        self.heartbeat_waiting = asyncio.Event()

    async def Heartbeat(self, request, context):
        self.heartbeat_waiting.set()
        await asyncio.Event().wait()


def test_a_drain_cuts_a_hung_heartbeat_short_and_still_deregisters():
    """A heartbeat in flight to a hung gateway held a drain for its whole 10 s timeout."""
    async def scenario():
        server, admin, port = await _fake_gateway(admin=HungHeartbeatAdmin())
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, _load)
        announcer.start()
        await asyncio.wait_for(admin.heartbeat_waiting.wait(), 10)
        started = time.monotonic()
        await announcer.stop()
        assert time.monotonic() - started < 2.0
        assert admin.calls[-1] == ("deregister", "w1")
        await server.stop(0)

    asyncio.run(scenario())


class FlakyDeregistrationAdmin(FakeAdmin):
    """Its first DeregisterWorker fails (a connection reset, a replica restarting)."""

    async def DeregisterWorker(self, request, context):
        if not any(call[0] == "deregister-failed" for call in self.calls):
            self.calls.append(("deregister-failed", request.worker_id))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "transient: connection reset")
        return await super().DeregisterWorker(request, context)


def test_a_failed_deregistration_is_tried_again():
    """One failed call was the end of it: the gateway kept the worker until its heartbeat timeout, then ended
    every stream still finishing on it, cutting the drain's grace short."""
    async def scenario():
        server, admin, port = await _fake_gateway(admin=FlakyDeregistrationAdmin())
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, _load)
        announcer.start()
        await _until(lambda: any(c[0] == "heartbeat" for c in admin.calls))
        started = time.monotonic()
        await announcer.stop()
        assert time.monotonic() - started < 2.0
        assert admin.calls[-2:] == [("deregister-failed", "w1"), ("deregister", "w1")]
        assert admin.known == set()
        await server.stop(0)

    asyncio.run(scenario())


class DeregistrationDownForAWhile(FakeAdmin):
    """DeregisterWorker fails for down_s from the first attempt (a replica overloaded past the worker's retries)."""

    def __init__(self, down_s: float):
        super().__init__()
        self.down_s, self.first_at = down_s, None

    async def DeregisterWorker(self, request, context):
        self.first_at = self.first_at or time.monotonic()
        if time.monotonic() - self.first_at < self.down_s:
            self.calls.append(("deregister-failed", request.worker_id))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded")
        return await super().DeregisterWorker(request, context)


def test_a_deregistration_failing_past_its_retries_keeps_the_worker_heartbeating_as_draining():
    """Deregistration failing for longer than its quick retries (1 s) was given up, and the heartbeats had
    stopped: the gateway took the worker for lost after its heartbeat timeout and ended the streams the drain
    was letting finish. Until the drain ends it tries again, heartbeating as draining in between."""
    async def scenario():
        server, admin, port = await _fake_gateway(admin=DeregistrationDownForAWhile(down_s=1.6))
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, _load)
        announcer.start()
        await _until(lambda: any(c[0] == "heartbeat" for c in admin.calls))
        started = time.monotonic()
        await announcer.stop()
        assert time.monotonic() - started < 2.0  # the drain goes on meanwhile
        await _until(lambda: ("deregister", "w1") in admin.calls)
        after_stop = admin.calls[admin.calls.index(("deregister-failed", "w1")):]
        assert any(c[0] == "heartbeat" and c[-1] is True for c in after_stop)  # draining, between the attempts
        assert admin.known == set()
        await announcer.close()
        await server.stop(0)

    asyncio.run(scenario())


def test_an_error_in_the_loop_is_retried_and_the_worker_stays_announced():
    """A bug in the loop (here: reading the engine's load raises, twice) ended the announcer's task: the
    worker stopped heartbeating and left the gateway's pool for good, silently. It is logged and retried;
    stop still deregisters."""
    failures = []

    def flaky_load():
        if len(failures) < 2:
            failures.append(True)
            raise RuntimeError("engine stats unavailable")
        return _load()

    async def scenario():
        server, admin, port = await _fake_gateway()
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, flaky_load,
                                     min_backoff_s=0.05)
        announcer.start()
        await _until(lambda: _heartbeats(admin) >= 2)
        assert not announcer._task.done() and len(failures) == 2
        await announcer.stop()
        assert admin.calls[0] == ("register", "127.0.0.1:1234", "a" * 32) and admin.calls[-1] == ("deregister", "w1")
        await server.stop(0)

    asyncio.run(scenario())


def test_a_gateway_back_from_a_restart_gets_the_worker_again_within_a_heartbeat_interval(monkeypatch):
    """A restarted gateway has forgotten every worker and routes nothing until they register again. The
    worker retried with a backoff grown while the gateway was down (and gRPC's own reconnection backoff
    on top): a 10 s restart left the gateway empty ~20 s more. The gateway's heartbeat interval
    (50 ms here) now bounds each wait, and the channel's reconnection backoff is capped."""
    monkeypatch.setattr(announce, "MAX_RECONNECT_BACKOFF_S", 0.1)
    down_s = 3.5  # the backoff from 0.05 s has grown past 3 s by then: its next try would be at ~6.3 s

    async def scenario():
        server, admin, port = await _fake_gateway()
        announcer = GatewayAnnouncer(f"127.0.0.1:{port}", TOKEN, "127.0.0.1:1234", "a" * 32, _load,
                                     min_backoff_s=0.05, max_backoff_s=30.0)
        announcer.start()
        await _until(lambda: _heartbeats(admin) >= 1)
        await server.stop(0)
        await asyncio.sleep(down_s)
        server, admin, _ = await _fake_gateway(port)
        back = time.monotonic()
        await _until(lambda: _heartbeats(admin) >= 1)  # NOT_FOUND, registered again, heartbeating
        assert time.monotonic() - back < 1.5, "the worker waited out its backoff after the gateway came back"
        assert admin.calls[0] == ("register", "127.0.0.1:1234", "a" * 32)
        await announcer.stop()
        await server.stop(0)

    asyncio.run(scenario())


def test_requests_being_tokenized_count_as_waiting_in_the_heartbeat():
    """Not yet in the engine while their prompt is tokenized (off the event loop): a heartbeat saying nothing runs
    or waits twice in a row while a gateway's stream has had no reply makes that gateway end the stream."""
    from types import SimpleNamespace

    from services.worker.engine.engine import EngineStats
    from services.worker.server import WorkerServer
    from services.worker.servicer import WorkerServicer

    stats = EngineStats(running=1, waiting=2, kv_blocks_total=8, kv_blocks_free=4, kv_blocks_used=4, preemptions=0)
    servicer = SimpleNamespace(engine=SimpleNamespace(stats=lambda: stats), admitting=3, draining=False, stalled=False)
    servicer.stats = lambda: WorkerServicer.stats(servicer)
    worker = SimpleNamespace(servicer=servicer)
    reported, draining = WorkerServer._load(worker)
    assert (reported.running, reported.waiting, draining) == (1, 5, False)

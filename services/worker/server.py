"""The worker's grpc.aio server: the Worker service, the standard health service, reflection,
Prometheus metrics, and the announcement to each gateway replica.

    python -m services.worker.server --artifact /artifacts/tiny-w4a8 --device cpu --port 50071
    python -m services.worker.server --artifact 3f2c... --store 's3://artifacts?endpoint=http://minio:9000' \\
        --device cuda --gpu-memory-budget 48GiB --gateway-address gateway-a:50051,gateway-b:50051

SIGTERM or SIGINT drains it: every gateway is told (DeregisterWorker), then health turns NOT_SERVING and
new Generate calls get UNAVAILABLE; in-flight requests get --drain-grace-seconds to finish and are
aborted after that.

Embedding (`qctl up`, tests): `server = WorkerServer(config); port = await server.start(); ...;
await server.stop()`, or BackgroundWorker(config) from synchronous code.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence

import grpc
import torch
from sqlalchemy.exc import SQLAlchemyError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.worker.announce import GatewayAnnouncers
from services.worker.config import ConfigError, WorkerConfig
from services.worker.engine.capacity import CapacityError
from services.worker.errors import WorkerError
from services.worker.metrics import WorkerMetrics
from services.worker.servicer import WorkerServicer
from services.worker.serving import ServedModel, load_served_model
from shared.config import fail, require_visible_device
from shared.registry import RegistryError
from shared.rpc.address import is_loopback
from shared.rpc.qserve.v1 import worker_pb2, worker_pb2_grpc
from shared.rpc.cert_expiry import CertificateExpiry
from shared.rpc.serving import BackgroundLoop, grpc_server, in_daemon_thread, listen, wait_for_stop_signal
from shared.rpc.tls import certificate_files
from shared.storage import StorageError

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name  # qserve.v1.Worker
DRAIN_POLL_S = 0.02


class WorkerServer:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.served: ServedModel | None = None
        self.servicer: WorkerServicer | None = None
        self.announcers: GatewayAnnouncers | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics: WorkerMetrics | None = None
        self._stopped = False
        self._engine_watch: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> int:
        """Loads and checks the artifact (raises ArtifactRefused and friends), starts the engine and
        serves; returns the bound gRPC port."""
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        # Not asyncio.to_thread: a process stopped during the load (minutes on a GPU) would wait for it at exit.
        served = await in_daemon_thread(load_served_model, self.config)
        served.engine.start()
        # Read through the servicer, made next (it needs the metrics): its stats count prompts being tokenized.
        metrics = WorkerMetrics(lambda: servicer.stats(), served.probe_error)
        metrics.registry.register(
            CertificateExpiry("worker", certificate_files(self.config.tls, self.config.gateway_tls)))
        server = grpc_server()
        servicer = WorkerServicer(served, metrics)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            # The metrics port first: gRPC listens on its port as soon as it is bound, and a server that
            # never started does not let it go (stop() and garbage collection leave it bound). Bound last,
            # it is bound only when everything else opened.
            if self.config.metrics_port is not None:
                self.metrics_port = metrics.serve(self.config.host, self.config.metrics_port)
            port = listen(server, f"{self.config.host}:{self.config.port}", "--host / --port", ConfigError,
                          self.config.tls)
            await server.start()
        except BaseException:  # e.g. a port is taken
            metrics.close()
            await asyncio.to_thread(served.engine.stop)
            raise
        self.served, self.servicer, self._server, self._health, self._metrics = (
            served, servicer, server, health_servicer, metrics)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        if self.config.gateway_addresses:
            if self.config.advertise_address is None and self.config.host in WILDCARD_HOSTS:
                log.warning("announcing %s to the gateways: a wildcard address only a gateway on this host can "
                            "dial; set --advertise-address to the host:port the gateways reach this worker at",
                            self.address)
            self.announcers = GatewayAnnouncers(
                self.config.gateway_addresses, self.config.gateway_token, self.config.advertise_address or self.address,
                served.artifact.artifact_id, self._load, tls=self.config.gateway_tls,
                stalled=lambda: self.servicer.stalled,
            )
            self.announcers.start()
        if self.config.stall_timeout_s:
            self._engine_watch = asyncio.create_task(self._watch_engine(), name="worker-engine-watch")
        log.info("worker serving %s on port %d%s (metrics port %s)", served.artifact.artifact_id,
                 port, " over TLS" if self.config.tls else "", self.metrics_port)
        if not is_loopback(f"{self.config.host}:{port}") and not (self.config.tls and self.config.tls.client_ca):
            # API keys, per-client stream limits and cache scopes are the gateway's: a client that reaches this
            # port directly has none of them.
            log.warning("listening on %s:%d without --tls-client-ca: anyone who can reach this port can generate, "
                        "past the gateway's API keys and limits; keep it on a private network, or require the "
                        "gateways' certificates", self.config.host, port)
        return port

    def _load(self):
        # A stalled worker reports itself draining: the gateways route nothing new to it, and take it back
        # as soon as its engine moves again (it is not deregistered). It reports stalled as well
        # (GatewayAnnouncer's `stalled`): a gateway that knows the field ends the streams open on it, which
        # would otherwise wait for their clients' deadlines; draining is kept for gateways that do not.
        # Requests still being tokenized count as waiting (WorkerServicer.stats), or a gateway seeing nothing
        # running or waiting twice while its stream has had no reply would end it (pool._end_unheard).
        return self.servicer.stats(), self.servicer.draining or self.servicer.stalled

    async def _watch_engine(self) -> None:
        """Marks the worker stalled while requests are in flight and no engine step has completed for
        stall_timeout_s (a hung GPU: the process, its heartbeats and its health answers carry on), and
        well again once one does."""
        timeout = self.config.stall_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            stalled_s = self.served.engine.stalled_s()
            stalled = stalled_s >= timeout
            if stalled == self.servicer.stalled:
                continue
            self.servicer.stalled = stalled
            if stalled:
                log.error("the engine has made no progress for %.0f s with %d request(s) in flight (a hung device?): "
                          "taking no new requests, reported as stalled to the gateways and NOT_SERVING to health "
                          "checks until it moves again", stalled_s, self.served.engine.num_in_flight)
            else:
                log.warning("the engine is moving again: taking requests")
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING if stalled
                                   else health_pb2.HealthCheckResponse.SERVING)

    async def _set_health(self, status) -> None:
        """The server as a whole and the Worker service; ignored once a drain has begun."""
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def drain(self, grace_s: float | None = None) -> None:
        """Stops taking work (deregistered, then UNAVAILABLE and health NOT_SERVING), lets in-flight
        requests finish for grace_s, then aborts what is left."""
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        # Deregistered first: until a gateway has removed this worker it keeps routing requests here;
        # those are served like the ones in flight rather than refused and retried. A request picked before
        # the deregistration that arrives after it is refused marked as draining (shared.rpc.refusal): the
        # gateway sends it elsewhere and counts no failure. Every gateway at once: the wait is the slowest one's.
        if self.announcers is not None:
            await self.announcers.stop()
        self.servicer.draining = True
        await self._health.enter_graceful_shutdown()
        engine = self.served.engine
        deadline = time.monotonic() + grace
        # Requests still tokenizing were accepted before the drain began: they are in flight too.
        while (engine.num_in_flight or self.servicer.admitting) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self.servicer.closing = True
        left = engine.in_flight()
        if left:
            log.warning("drain grace of %.1f s is over; aborting %d request(s)", grace, len(left))
            for request_id in left:
                engine.abort(request_id)
        if self.announcers is not None:
            await self.announcers.close()  # ends the attempts of a deregistration that failed at first

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains (see drain), then stops the server, the engine and the metrics endpoint."""
        if self._stopped or self._server is None:
            return
        self._stopped = True
        if self._engine_watch is not None:
            self._engine_watch.cancel()
        await self.drain(grace_s)
        await self._server.stop(1.0)  # every stream has ended; let the last messages go out
        await asyncio.to_thread(self.served.engine.stop)
        self._metrics.close()


async def serve(config: WorkerConfig) -> None:
    """Runs until SIGTERM or SIGINT, then drains and stops."""
    server = WorkerServer(config)
    await server.start()
    await wait_for_stop_signal()
    log.info("draining (grace %.0f s)", config.drain_grace_s)
    await server.stop()


class BackgroundWorker:
    """A WorkerServer on its own event loop in a daemon thread, for synchronous embedders and tests:
    BackgroundWorker(config).address ... .stop()."""

    def __init__(self, config: WorkerConfig, timeout_s: float = 300.0):
        self._loop = BackgroundLoop("worker-loop")
        self.server = WorkerServer(config)
        self.port = self._loop.start_server(self.server.start, timeout_s)
        self.address = self.server.address

    def call(self, coro, timeout_s: float = 300.0):
        """Runs a coroutine on the worker's loop and returns its result."""
        return self._loop.call(coro, timeout_s)

    def stop(self, grace_s: float | None = None, timeout_s: float = 300.0) -> None:
        self._loop.stop_server(lambda: self.server.stop(grace_s), timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = WorkerConfig.from_args(argv)
        require_visible_device(config.device, ConfigError)
        asyncio.run(serve(config))
    # The registry (--registry-url) is opened while the artifact is looked up; OSError: a cache folder or
    # registry file that cannot be created.
    except (ConfigError, CapacityError, StorageError, WorkerError, RegistryError, SQLAlchemyError, OSError) as exc:
        code = getattr(exc, "code", None)
        return fail(exc, f"error ({code.name}): " if isinstance(code, grpc.StatusCode) else "error: ")
    except torch.OutOfMemoryError as exc:  # the plan did not fit what the device really had (e.g. --kv-blocks)
        print(f"error: out of device memory while starting: {str(exc).splitlines()[0]}; lower --gpu-memory-budget "
              f"or --kv-blocks", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        if "DefaultCPUAllocator" not in str(exc):  # the same on the CPU: the host's memory
            raise
        print(f"error: out of host memory while starting: {str(exc).splitlines()[0]}; lower --kv-blocks",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

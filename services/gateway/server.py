"""The gateway's grpc.aio server: Gateway and Admin on one port, the standard health service,
reflection, and Prometheus metrics on their own HTTP port.

    QSERVE_ADMIN_TOKENS=ops=s3cret:admin,workers=w0rk:worker \\
    python -m services.gateway.server --registry-url sqlite:///var/qserve/registry.db --listen 0.0.0.0:50051 \\
        --metrics-port 9100

Embedded (`qctl up`, tests): `gateway = GatewayServer(config); port = await gateway.start(); ...;
await gateway.stop(grace)` on a running event loop, or BackgroundGateway(config) from synchronous code. SIGTERM or SIGINT stops the CLI gracefully."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy.exc import SQLAlchemyError

from services.gateway.auth import AdminAuth, ApiKeys
from services.gateway.config import ConfigError, GatewayConfig
from services.gateway.deployments import DeploymentCache
from services.gateway.fallback import AutoFallback
from services.gateway.fleet import FleetView
from services.gateway.metrics import GatewayMetrics
from services.gateway.pool import WorkerPool
from services.gateway.servicer_admin import AdminServicer
from services.gateway.servicer_gateway import GatewayServicer
from shared.config import fail
from shared.registry import Registry, RegistryError, create_registry
from shared.rpc.cert_expiry import CertificateExpiry
from shared.rpc.serving import BackgroundLoop, grpc_server, listen, serve_metrics, wait_for_stop_signal
from shared.rpc.tls import certificate_files
from shared.rpc.qserve.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name  # qserve.v1.Gateway
ADMIN_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Admin"].full_name  # qserve.v1.Admin


class GatewayServer:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.metrics = GatewayMetrics()
        self.pool = WorkerPool(heartbeat_timeout_s=config.heartbeat_timeout_s, forget_after_s=config.worker_forget_s,
                               worker_tls=config.worker_tls, quarantine=config.quarantine)
        # The scrape runs on the metrics server's thread: list() copies the pool's dict in one step.
        self.metrics.watch_workers(lambda: [w.health_label() for w in list(self.pool.workers.values())])
        self.metrics.registry.register(
            CertificateExpiry("gateway", certificate_files(config.tls, config.worker_tls)))
        self.registry: Registry | None = None
        self.deployments: DeploymentCache | None = None
        self.fallback: AutoFallback | None = None
        self.fleet: FleetView | None = None
        self.gateway: GatewayServicer | None = None
        self.admin: AdminServicer | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._metrics_http = None
        self._tasks: list[asyncio.Task] = []

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> int:
        """Opens the registry (migrating it to head), starts serving; returns the gRPC port."""
        config = self.config
        self.registry = await asyncio.to_thread(create_registry, config.registry_url)
        self.deployments = DeploymentCache(self.registry, config.deployment_cache_s)
        self.fleet = FleetView(self.registry, self.metrics)
        self.fallback = AutoFallback(self.registry, self.deployments, self.metrics, config.budget, self.pool,
                                     self.fleet)
        self.gateway = GatewayServicer(self.pool, self.deployments, self.metrics, ApiKeys(config.api_keys),
                                       config.max_concurrent_streams, config.max_streams_per_client,
                                       config.first_reply_timeout_s, config.stream_stall_timeout_s)
        self.admin = admin = AdminServicer(
            self.registry, self.pool, self.deployments, self.metrics, AdminAuth(config.admin_tokens),
            config.heartbeat_interval_s, config.worker_info_timeout_s, datetime.now(timezone.utc), self.fleet)
        server = grpc_server()
        gateway_pb2_grpc.add_GatewayServicer_to_server(self.gateway, server)
        gateway_pb2_grpc.add_AdminServicer_to_server(admin, server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((GATEWAY_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME,
                                             reflection.SERVICE_NAME), server)
        try:
            self.port = listen(server, config.listen, "--listen", ConfigError, config.tls)
            await server.start()
            if config.metrics_port is not None:
                self._metrics_http = serve_metrics(self.metrics.registry, config.metrics_host, config.metrics_port,
                                                   "--metrics-port", ConfigError)
                self.metrics_port = self._metrics_http.server_port
        except BaseException:  # e.g. a port is taken
            await server.stop(None)
            self.registry.close()
            raise
        self._server = server
        for name in ("", GATEWAY_SERVICE, ADMIN_SERVICE):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._tasks = [asyncio.create_task(self._expire_workers(), name="gateway-heartbeats")]
        if config.deployment_cache_s > 0:
            self._tasks.append(asyncio.create_task(self.deployments.refresh(), name="gateway-deployments"))
        self._tasks.append(asyncio.create_task(self.fleet.run(config.fallback_check_s), name="gateway-arm-reports"))
        if config.budget.enabled:
            self._tasks.append(asyncio.create_task(self.fallback.run(config.fallback_check_s), name="gateway-fallback"))
        log.info("gateway serving on port %d%s%s", self.port, " over TLS" if config.tls else "",
                 f", metrics on port {self.metrics_port}" if self.metrics_port is not None else "")
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Health turns NOT_SERVING, new calls are refused, open streams get `grace_s` to finish."""
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.stop(self.config.grace_s if grace_s is None else grace_s)
        self._server = None
        # The streams just ended sent Worker.Abort for their requests; closing the channels now would lose them.
        await self.gateway.finish_aborts()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        await self.pool.close()
        await self.admin.threads.close()
        await self.deployments.threads.close()
        self.registry.close()

    async def _expire_workers(self) -> None:
        interval = min(self.config.heartbeat_interval_s, self.config.heartbeat_timeout_s / 4)
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            late = loop.time() - due
            try:
                if late > interval:
                    # This gateway was not running (a pause of its process, a starved host): heartbeats that
                    # arrived meanwhile are still queued behind this wake-up. Its own pause is not the
                    # workers' silence: without the credit every worker would expire, and the streams open
                    # on them be ended, because the gateway stopped listening.
                    log.warning("the gateway's event loop was held up %.1f s; the workers' heartbeat clocks are "
                                "moved on by as much", late)
                    self.pool.excuse(late)
                await self._expire_workers_once()
            except Exception:  # the loop must outlive any one pass: without it a hung worker keeps its traffic
                log.exception("checking the workers' heartbeats failed; checking again in %.1f s", interval)

    async def _expire_workers_once(self) -> None:
        for worker in await self.pool.dial_again_if_tls_renewed():
            log.info("worker %s (%s): dialled again with the renewed TLS client files", worker.worker_id,
                     worker.address)
        for worker in self.pool.expire():
            log.warning("worker %s (%s) marked unhealthy: %s", worker.worker_id, worker.address,
                        worker.failed_reason)
        for worker in await self.pool.forget():
            log.warning("worker %s (%s) removed from the pool: no heartbeat for %.0f s", worker.worker_id,
                        worker.address, time.monotonic() - worker.last_heartbeat_mono)
        self.metrics.forget_idle()


class BackgroundGateway:
    """A gateway on its own event loop in a daemon thread, for synchronous embedders (`qctl up`, CLI
    tests): BackgroundGateway(config).address ... .stop()."""

    def __init__(self, config: GatewayConfig, timeout_s: float = 60.0):
        self._loop = BackgroundLoop("gateway-loop")
        self.server = GatewayServer(config)
        self.port = self._loop.start_server(self.server.start, timeout_s)
        self.address = self.server.address

    def call(self, coro, timeout_s: float = 60.0):
        """Runs a coroutine on the gateway's loop (e.g. to start fake workers beside it)."""
        return self._loop.call(coro, timeout_s)

    def stop(self, grace_s: float | None = None, timeout_s: float = 60.0) -> None:
        self._loop.stop_server(lambda: self.server.stop(grace_s), timeout_s)


async def serve(config: GatewayConfig) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    gateway = GatewayServer(config)
    await gateway.start()
    await wait_for_stop_signal()
    log.info("stopping (grace %.0f s)", config.grace_s)
    await gateway.stop()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = GatewayConfig.from_args(argv)
        asyncio.run(serve(config))
    # OSError: a registry folder that cannot be created.
    except (ConfigError, RegistryError, SQLAlchemyError, OSError) as exc:
        return fail(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

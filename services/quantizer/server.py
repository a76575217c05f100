"""The quantizer's grpc.aio server: the Quantizer service, the standard health service, reflection.

    python -m services.quantizer.server --registry-url sqlite:///var/qserve/registry.db \\
        --store 's3://artifacts?endpoint=http://127.0.0.1:9000' --eval-data /data/eval.txt

S3 credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. SIGTERM or SIGINT stops it
gracefully: health turns NOT_SERVING, running jobs end FAILED ("the quantizer is stopping").
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch
from sqlalchemy.exc import SQLAlchemyError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.quantizer.config import TOKENS_ENV, ConfigError, QuantizerConfig
from services.quantizer.evaluate import Fp16PerplexityCache
from services.quantizer.jobs import JobRunner
from services.quantizer.leftovers import purge_stale_staging
from services.quantizer.pipeline import Services
from services.quantizer.servicer import QuantizerServicer
from shared.config import fail, require_visible_device
from shared.rpc.address import is_loopback
from shared.registry import Registry, RegistryError, create_registry
from shared.rpc.serving import BackgroundLoop, grpc_server, listen, wait_for_stop_signal
from shared.rpc.qserve.v1 import quantizer_pb2, quantizer_pb2_grpc
from shared.storage import StorageError, open_store

log = logging.getLogger(__name__)

SERVICE_NAME = quantizer_pb2.DESCRIPTOR.services_by_name["Quantizer"].full_name  # qserve.v1.Quantizer


@dataclass(slots=True)
class RunningQuantizer:
    server: grpc.aio.Server
    runner: JobRunner
    health: health.aio.HealthServicer
    registry: Registry
    port: int
    grace_s: float

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking work, fails running jobs at their next progress report, lets rpcs finish."""
        await self.health.enter_graceful_shutdown()
        jobs_stopped = asyncio.create_task(asyncio.to_thread(self.runner.stop))
        await self.server.stop(self.grace_s if grace_s is None else grace_s)
        await jobs_stopped
        self.registry.close()


async def start(config: QuantizerConfig) -> RunningQuantizer:
    """Opens the registry and the store, fails orphaned jobs, and starts serving on config.listen."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    registry = await asyncio.to_thread(create_registry, config.registry_url)
    try:
        store = await asyncio.to_thread(open_store, config.store, create=config.create_bucket)
        await asyncio.to_thread(purge_stale_staging, store)
        config.work_dir.mkdir(parents=True, exist_ok=True)
        services = Services(config, registry, store, Fp16PerplexityCache(config.work_dir / "fp16-perplexity.json"))
        runner = JobRunner(services)
        orphans = await asyncio.to_thread(runner.start)
    except BaseException:
        registry.close()
        raise
    if orphans:
        log.warning("failed %d job(s) left running by a stopped quantizer: %s", len(orphans), ", ".join(orphans))

    server = grpc_server()
    quantizer_pb2_grpc.add_QuantizerServicer_to_server(QuantizerServicer(runner), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = listen(server, config.listen, "--listen", ConfigError, config.tls)
        await server.start()
    except BaseException:  # e.g. the port is taken
        await asyncio.to_thread(runner.stop)
        registry.close()
        raise
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("quantizer %s serving on port %d%s (store %s)", config.owner, port, " over TLS" if config.tls else "",
             store.uri())
    if config.tokens:
        log.info("caller tokens required: %d configured (%s)", len(config.tokens), TOKENS_ENV)
    elif not is_loopback(config.listen):
        who = ("any client with a certificate signed by --tls-client-ca" if config.tls and config.tls.client_ca
               else "anyone who can reach this port")
        log.warning("no caller tokens (%s unset) while listening on %s: %s can publish models and cancel jobs; "
                    "set %s=name=token:scope,... (scopes publish, read)", TOKENS_ENV, config.listen, who, TOKENS_ENV)
    return RunningQuantizer(server, runner, health_servicer, registry, port, config.grace_s)


async def serve(config: QuantizerConfig) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    running = await start(config)
    await wait_for_stop_signal()
    log.info("stopping (grace %.0f s)", config.grace_s)
    await running.stop()


class BackgroundQuantizer:
    """A quantizer on its own event loop in a daemon thread, for embedding (`qctl up`, tests):
    BackgroundQuantizer(config).address ... .stop()."""

    def __init__(self, config: QuantizerConfig, timeout_s: float = 120.0):
        self._loop = BackgroundLoop("quantizer-loop")
        self.running = self._loop.start_server(lambda: start(config), timeout_s)
        self.address = self.running.address

    def stop(self, grace_s: float | None = None, timeout_s: float = 300.0) -> None:
        self._loop.stop_server(lambda: self.running.stop(grace_s), timeout_s)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = QuantizerConfig.from_args(argv)
        require_visible_device(config.device, ConfigError)
        asyncio.run(serve(config))
    # OSError: a registry or work folder that cannot be created.
    except (ConfigError, StorageError, RegistryError, SQLAlchemyError, OSError) as exc:
        return fail(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())

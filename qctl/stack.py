"""The whole stack in one process on loopback (for `qctl up`): a quantizer, the gateway and workers,
each on its own event loop thread, sharing a SQLite registry and a local-folder object store.

They still talk to each other only over gRPC (and through the registry and the store), exactly as
separate processes would; this module only starts and stops them.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.config import AdminToken, GatewayConfig
from services.gateway.server import BackgroundGateway
from services.quantizer.config import QuantizerConfig, QuantizerToken
from services.quantizer.server import BackgroundQuantizer
from services.worker.config import WorkerConfig
from services.worker.server import BackgroundWorker
from shared.registry import sqlite_url
from shared.storage import StorageConfig

LOOPBACK = "127.0.0.1"


@dataclass(slots=True)
class LocalStack:
    """Paths and secrets of one local stack; `start_*` bring its services up, `stop` takes them down."""

    workdir: Path
    device: str  # "cpu" (torch reference backend) or "cuda"
    admin_token: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    worker_token: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)
    quantizer_token: str = field(default_factory=lambda: secrets.token_urlsafe(16), repr=False)  # scope publish
    quantizer: BackgroundQuantizer | None = None
    gateway: BackgroundGateway | None = None
    workers: list[BackgroundWorker] = field(default_factory=list)

    @property
    def registry_url(self) -> str:
        return sqlite_url(self.workdir / "registry.db")

    @property
    def store(self) -> StorageConfig:
        return StorageConfig.from_url(str(self.workdir / "store"))

    def start_quantizer(self, eval_data: Path) -> str:
        self.quantizer = BackgroundQuantizer(QuantizerConfig(
            registry_url=self.registry_url, store=self.store, create_bucket=True,
            work_dir=self.workdir / "quantizer", listen=f"{LOOPBACK}:0", default_eval_data=str(eval_data),
            device=self.device, orphan_after_s=0, tokens={"operator": QuantizerToken(self.quantizer_token, "publish")},
        ))
        return self.quantizer.address

    def start_gateway(self) -> str:
        self.gateway = BackgroundGateway(GatewayConfig(
            registry_url=self.registry_url, listen=f"{LOOPBACK}:0",
            admin_tokens={"operator": AdminToken(self.admin_token, "admin"),
                          "workers": AdminToken(self.worker_token, "worker")},
        ))
        return self.gateway.address

    def start_worker(self, artifact_id: str, memory_budget: int | None = None, timeout_s: float = 300.0) -> str:
        """A worker for one artifact (fetched from the store), announcing itself to the gateway; waits
        up to timeout_s for it to load (concurrent.futures.TimeoutError after that)."""
        worker = BackgroundWorker(WorkerConfig(
            artifact=artifact_id, store=self.store, registry_url=self.registry_url,
            cache_dir=self.workdir / "worker-cache", device=self.device, gpu_memory_budget=memory_budget,
            host=LOOPBACK, port=0, metrics_port=None,
            gateway_addresses=(self.gateway.address,), gateway_token=self.worker_token,
        ), timeout_s=timeout_s)
        self.workers.append(worker)
        return worker.address

    def stop(self) -> None:
        """Workers first (they drain and deregister), then the gateway, then the quantizer."""
        for worker in reversed(self.workers):
            worker.stop(grace_s=5.0)
        self.workers.clear()
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        if self.quantizer is not None:
            self.quantizer.stop()
            self.quantizer = None

"""The worker's settings, parsed once (command line plus an explicit token variable) and passed down."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import (ServiceArgumentParser, add_registry_argument, add_store_arguments, check_device,
                           add_tls_client_arguments, add_tls_server_arguments, client_tls_from_args, nonempty,
                           nonempty_path, server_tls_from_args, store_from_args)
from shared.formats.spec import FORMATS
from shared.rpc.address import is_host_port
from shared.rpc.tls import ClientTls, ServerTls
from shared.storage import StorageConfig

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50071
DEFAULT_METRICS_PORT = 9471
DEVICES = ("cpu", "cuda")
CPU_DEFAULT_BUDGET = 2 * 2**30  # a CPU host's RAM is shared with everything else: a modest default
GPU_DEFAULT_FRACTION = 0.9  # of the device's free memory at start-up, when no budget is given
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


class ConfigError(ValueError):
    """A worker setting that cannot work; the message names it and what is accepted."""


def parse_bytes(text: str) -> int:
    """'48GiB', '512MiB', '2.5GB', '1000000' -> bytes."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"memory size {text!r} is not understood; write e.g. 48GiB, 512MiB, 2GB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


# Tokens per engine step by default. Kernel by kernel, a 512-token step of a 7B model took 40-90 ms of
# host time for 11.5 ms of kernels (H100, session 32), so 4096 became the default. Steps with prompt tokens
# now replay piecewise CUDA graphs (engine/step_graphs.py), and 4096 still gives the most throughput: H200,
# g128, 64 requests of 1024 + 64 tokens: 2688 tokens/s at 4096, 2150 at 1024, 1646 at 512 (mean TPOT
# 14.0 / 10.9 / 10.5 ms; bench/results/h200/e2e_prefill_*_graphs.json). A lower budget trades prompt
# throughput for steadier decoding streams. On the CPU backend a step's time grows with its tokens: the
# smaller budget keeps decoding streams moving between prompt chunks.
GPU_MAX_BATCH_TOKENS = 4096
CPU_MAX_BATCH_TOKENS = 512

# The probe's refusal threshold: the mean relative L2 error of its logits rows. Equivalent arithmetic already
# differs on a W4A8KV4 model (an int8 or 4-bit code flipped by a rounding difference carries through the layers,
# more the deeper the model): the Triton runner on an H100 reads 0.06 on the tiny fixture's QoQ artifacts (6
# layers) and 0.20-0.21 on a random-weight Llama-2-7B (32 layers), about 2.4x what the reference forward itself
# moves with fp64 instead of fp32 attention (0.026, 0.08-0.09); fp16 reads 0.002 (bench/results/h100/probe.json).
# A kernel bug hits every layer of its shape: the fixture with every down_proj's output channels swapped in pairs
# reads 1.14, shuffled 0.98; one layer of six swapped reads 0.35 and passes. A tighter limit suits a model whose
# gauge (qserve_worker_probe_relative_error) has been watched.
DEFAULT_PROBE_MAX_ERROR = 0.5

@dataclass(slots=True)
class WorkerConfig:
    artifact: str  # a local artifact folder, or an artifact id to fetch from `store`
    store: StorageConfig | None = None  # where artifact ids are fetched from
    # optional: the registry gives an artifact id's object prefix; out of repr: a URL may carry a password
    registry_url: str | None = field(default=None, repr=False)
    cache_dir: Path = Path("/tmp/qserve-worker")  # downloaded artifacts, one folder per id
    device: str = "cpu"  # cpu, cuda or cuda:N
    format: str | None = None  # the format this worker must serve; None = whatever the artifact is
    gpu_memory_budget: int | None = None  # bytes for weights + activations + KV; None = device default
    kv_blocks: int | None = None  # a fixed KV block count instead of the budget's
    block_size: int = 16  # token slots per KV block
    max_running_sequences: int = 32
    max_waiting_requests: int = 128
    # Tokens per step (the chunked-prefill budget); None = GPU_MAX_BATCH_TOKENS on a GPU, CPU_MAX_BATCH_TOKENS on cpu.
    max_batch_tokens: int | None = None
    max_context_tokens: int | None = None  # None = the model's max_position_embeddings
    overlap_steps: bool | None = None  # launch step N + 1 before reading back N's tokens; None = on a GPU only
    # Prompts sharing leading blocks of tokens (a system prompt, the conversation so far) reuse their cached K/V.
    prefix_caching: bool = True
    # Compile and capture every CUDA graph (decode batches, step token counts) before serving, so no
    # request's step pays a first-use capture; off: each graph is captured at its first use.
    capture_graphs: bool = True
    # The start-up probe (shared.formats.probe): the mean relative L2 error of this worker's logits against the
    # artifact's reference logits that it serves with; above it the artifact is refused. 0 = no probe.
    probe_max_error: float = DEFAULT_PROBE_MAX_ERROR
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0 picks a free port
    advertise_address: str | None = None  # host:port the gateway dials; default host:<bound port>
    metrics_port: int | None = DEFAULT_METRICS_PORT  # Prometheus /metrics; 0 picks a free port; None = off
    drain_grace_s: float = 30.0  # on SIGTERM / stop: how long in-flight requests may finish
    # Requests in flight and no engine step for this long (a hung device): the worker reports itself
    # draining to the gateways and NOT_SERVING to health checks until a step completes. 0 = never.
    stall_timeout_s: float = 60.0
    # Announce to each of these gateways' Admin service (one per gateway replica: each keeps its own
    # worker pool); empty = announce to none. All take the one worker-scope token.
    gateway_addresses: tuple[str, ...] = ()
    gateway_token: str | None = field(default=None, repr=False)
    torch_threads: int = 0  # 0 = torch's default
    tls: ServerTls | None = None  # serve over TLS (clients may have to present a certificate); None = plaintext
    gateway_tls: ClientTls | None = None  # dial the gateways over TLS; None = plaintext

    def __post_init__(self) -> None:
        self.cache_dir = Path(self.cache_dir)
        if not self.artifact:
            raise ConfigError("artifact is required: a local artifact folder or an artifact id")
        check_device(self.device, DEVICES, ConfigError)
        if self.format is not None and self.format not in FORMATS:
            raise ConfigError(f"format {self.format!r} is unknown; accepted: {', '.join(FORMATS)}")
        if self.gpu_memory_budget is not None and self.gpu_memory_budget <= 0:
            raise ConfigError(f"gpu_memory_budget={self.gpu_memory_budget} must be a positive number of bytes")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError(f"kv_blocks={self.kv_blocks} must be at least 1")
        if self.max_batch_tokens is None:
            self.max_batch_tokens = CPU_MAX_BATCH_TOKENS if self.device == "cpu" else GPU_MAX_BATCH_TOKENS
        for name in ("block_size", "max_running_sequences", "max_waiting_requests", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        if self.max_batch_tokens < self.max_running_sequences:
            # Decodes are served in admission order within the step's token budget: the later sequences would get
            # no token until earlier ones finish (correct tokens, a stalled stream each).
            log.warning("max_batch_tokens=%d is below max_running_sequences=%d: a step decodes at most %d sequences "
                        "and the others wait for earlier ones to finish; raise max_batch_tokens",
                        self.max_batch_tokens, self.max_running_sequences, self.max_batch_tokens)
        if self.device != "cpu" and self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a power of two on {self.device} (the GPU kernels' pages)")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ConfigError(f"max_context_tokens={self.max_context_tokens} must be at least 2")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError(f"{name}={value} must be a port number 0-65535 (0 picks a free one)")
        if not (math.isfinite(self.probe_max_error) and self.probe_max_error >= 0):
            raise ConfigError(f"probe_max_error={self.probe_max_error} must be a finite number >= 0 (0 = no probe)")
        for name, zero in (("drain_grace_s", ""), ("stall_timeout_s", " (0 = never)")):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name}={value} must be a finite number of seconds >= 0{zero}")
        if self.advertise_address is not None and not is_host_port(self.advertise_address):
            raise ConfigError(f"advertise_address {self.advertise_address!r} is not host:port")
        self.gateway_addresses = _checked_gateways(self.gateway_addresses)
        if self.gateway_addresses and not self.gateway_token:
            raise ConfigError("a gateway address needs a gateway token: set QSERVE_GATEWAY_TOKEN")
        if self.torch_threads < 0:
            raise ConfigError(f"torch_threads={self.torch_threads} must be >= 0 (0 = torch's default)")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
        """Settings from the command line; S3 credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and
        the gateway token from QSERVE_GATEWAY_TOKEN (read here, once: secrets never go on a command line)."""
        env = os.environ if environ is None else environ
        args = _parser().parse_args(argv)
        store = store_from_args(args, env, ConfigError) if args.store is not None else None
        return cls(
            artifact=args.artifact,
            store=store,
            registry_url=args.registry_url,
            cache_dir=args.cache_dir,
            device=args.device,
            format=args.format,
            gpu_memory_budget=parse_bytes(args.gpu_memory_budget) if args.gpu_memory_budget is not None else None,
            kv_blocks=args.kv_blocks,
            block_size=args.block_size,
            max_running_sequences=args.max_running_sequences,
            max_waiting_requests=args.max_waiting_requests,
            max_batch_tokens=args.max_batch_tokens,
            max_context_tokens=args.max_context_tokens,
            overlap_steps=args.overlap_steps,
            prefix_caching=args.prefix_caching,
            capture_graphs=args.capture_graphs,
            probe_max_error=args.probe_max_error,
            host=args.host,
            port=args.port,
            advertise_address=args.advertise_address,
            metrics_port=None if args.metrics_port == -1 else args.metrics_port,
            drain_grace_s=args.drain_grace_seconds,
            stall_timeout_s=args.stall_timeout_seconds,
            gateway_addresses=_split_gateways(args.gateway_addresses or ()),
            gateway_token=env.get("QSERVE_GATEWAY_TOKEN"),
            torch_threads=args.torch_threads,
            tls=server_tls_from_args(args, ConfigError),
            gateway_tls=client_tls_from_args(args, ConfigError),
        )


def _split_gateways(values: Sequence[str]) -> tuple[str, ...]:
    """Each --gateway-address value may list several, comma-separated (one flag from a templated
    setting, e.g. a compose variable); an empty item is kept so that validation names it."""
    return tuple(item.strip() for value in values for item in value.split(","))


def _checked_gateways(addresses: Sequence[str]) -> tuple[str, ...]:
    # A lone string would be taken letter by letter: the old single-address field took one.
    if isinstance(addresses, str):
        raise ConfigError(f"gateway_addresses takes a sequence of host:port, not the string {addresses!r}")
    seen: set[str] = set()
    for address in addresses:
        if not is_host_port(address):
            raise ConfigError(f"gateway address {address!r} is not host:port")
        # Host names are case-insensitive; a gateway listed twice would get two registrations of one worker.
        if address.lower() in seen:
            raise ConfigError(f"gateway address {address!r} is given twice; name each gateway replica once")
        seen.add(address.lower())
    return tuple(addresses)


def _parser() -> argparse.ArgumentParser:
    p = ServiceArgumentParser(
        prog="python -m services.worker.server",
        description="The worker: serves one artifact (quantized or the fp16 baseline) with continuous batching.",
    )
    p.add_argument("--artifact", type=nonempty, required=True, help="a local artifact folder, or an artifact id to fetch from --store")
    add_store_arguments(p, required=False)
    # Optional here: the registry only tells where an artifact id's objects are; without it the store is searched.
    add_registry_argument(p, required=False)
    p.add_argument("--cache-dir", type=nonempty_path, default=Path("/tmp/qserve-worker"), help="where fetched artifacts are kept")
    p.add_argument("--device", default="cpu", help="cpu (torch reference backend), cuda or cuda:N (Triton kernels)")
    p.add_argument("--format", default=None, help=f"refuse artifacts of any other format ({', '.join(FORMATS)})")
    p.add_argument("--gpu-memory-budget", default=None,
                   help=f"memory for weights, activations and the KV cache, e.g. 48GiB "
                        f"[default: {GPU_DEFAULT_FRACTION * 100:.0f}%% of the GPU memory free at start-up; 2GiB on cpu]")
    p.add_argument("--kv-blocks", type=int, default=None, help="a fixed number of KV blocks instead of the budget's")
    p.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    p.add_argument("--max-running-sequences", type=int, default=32, help="most sequences in one step")
    p.add_argument("--max-waiting-requests", type=int, default=128,
                   help="waiting requests before Generate answers RESOURCE_EXHAUSTED")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help=f"tokens per step (chunked-prefill budget) [default: {GPU_MAX_BATCH_TOKENS} with a GPU, "
                        f"{CPU_MAX_BATCH_TOKENS} on cpu]")
    p.add_argument("--max-context-tokens", type=int, default=None,
                   help="prompt + generated tokens of one sequence [default: the model's context window]")
    p.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous step's tokens are read back, hiding the host's "
                        "work between steps [default: on with a GPU, off on cpu]")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache blocks of prompt prefixes computed before (a shared system prompt, a "
                        "conversation's earlier turns) instead of computing them again [default: on]")
    p.add_argument("--capture-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="with a GPU: compile the kernels and capture every CUDA graph before serving (slower start, "
                        "no first-use stalls) [default: on]")
    p.add_argument("--probe-max-error", type=float, default=DEFAULT_PROBE_MAX_ERROR,
                   help="refuse the artifact when this worker's logits for its probe differ from the quantizer's "
                        "reference logits by more than this mean relative L2 error (0 = no probe) [default: 0.5]")
    p.add_argument("--host", type=nonempty, default=DEFAULT_HOST, help="address to serve gRPC on")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="gRPC port (0 picks a free one)")
    p.add_argument("--advertise-address", default=None,
                   help="host:port the gateway should dial (with --tls-cert, a host name or IP address the "
                        "certificate is issued for) [default: host:port]")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="Prometheus /metrics HTTP port (0 picks a free one, -1 turns it off)")
    p.add_argument("--drain-grace-seconds", type=float, default=30.0,
                   help="on SIGTERM: how long in-flight requests may finish before they are aborted")
    p.add_argument("--stall-timeout-seconds", type=float, default=60.0,
                   help="requests in flight and no engine step for this long (a hung GPU): report draining to the "
                        "gateways and NOT_SERVING to health checks until the engine moves again (0 = never)")
    p.add_argument("--gateway-address", action="append", dest="gateway_addresses", default=None,
                   metavar="HOST:PORT[,HOST:PORT...]",
                   help="gateway Admin host:port to register with, using the worker-scope token in "
                        "$QSERVE_GATEWAY_TOKEN (the same for every gateway). With several gateway replicas, "
                        "repeat the flag or give a comma-separated list and name each replica, not a load "
                        "balancer in front of them: each replica keeps its own worker pool, and the worker "
                        "registers with and heartbeats to every one independently")
    p.add_argument("--torch-threads", type=int, default=0, help="CPU threads for torch (0 = torch's default)")
    add_tls_server_arguments(p)
    add_tls_client_arguments(p, "gateways")
    return p

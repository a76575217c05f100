"""The quantizer's settings, parsed once (command line plus explicit credentials) and passed down."""

from __future__ import annotations

import argparse
import math
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import (ServiceArgumentParser, add_registry_argument, add_store_arguments, add_tls_server_arguments,
                           check_device,
                           nonempty, nonempty_path, server_tls_from_args, store_from_args)
from shared.registry.models import MAX_ACTOR
from shared.rpc.address import is_host_port
from shared.rpc.bearer import ScopedToken, check_scoped_tokens, parse_scoped_tokens
from shared.rpc.tls import ServerTls
from shared.storage import StorageConfig

DEFAULT_LISTEN = "127.0.0.1:50061"
DEFAULT_BUDGET = 0.05  # largest accepted perplexity_quantized / perplexity_fp16 - 1
DEVICES = ("cpu", "cuda", "auto")
TOKENS_ENV = "QSERVE_QUANTIZER_TOKENS"
# "publish": every Quantizer rpc; "read": GetJob, WatchJob, GetArtifact, ListArtifacts, ListModels, ListJobs.
SCOPES = ("publish", "read")


def over_budget(ppl_fp16: float, ppl_quantized: float, budget: float) -> bool:
    """The accuracy budget's rule (a publish's gate, the adoption of an existing artifact, `qctl up`'s check): the
    quantized perplexity more than `budget` above fp16's. A perplexity that is not a finite number (a model that
    overflows to inf or NaN) is never within it: compared, NaN reads as within any budget."""
    if not (math.isfinite(ppl_fp16) and math.isfinite(ppl_quantized)):
        return True
    return ppl_quantized > ppl_fp16 * (1 + budget)


class ConfigError(ValueError):
    """A quantizer setting that cannot work; the message names it and what is accepted."""


QuantizerToken = ScopedToken  # scope: one of SCOPES
_WHAT = f"{TOKENS_ENV}: token"  # how errors name an entry of the setting


@dataclass(slots=True)
class QuantizerConfig:
    # sqlite:///path/registry.db or postgresql+psycopg://user@host/db; out of repr: a URL may carry a password
    registry_url: str = field(repr=False)
    store: StorageConfig  # where artifacts are published; also the endpoint/credentials for s3:// sources
    work_dir: Path  # scratch space: downloaded sources, artifact folders before upload
    create_bucket: bool = False  # create the store's bucket (or folder) at start-up when it is missing
    listen: str = DEFAULT_LISTEN  # host:port; port 0 picks a free one
    default_budget: float = DEFAULT_BUDGET
    default_eval_data: str | None = None  # local path or s3:// URI used when a request names none
    default_calib_data: str | None = None  # None: the built-in calibration text (Python stdlib sources)
    workers: int = 1  # jobs that run at once
    max_queued: int = 16  # jobs waiting for a worker before Publish answers RESOURCE_EXHAUSTED
    device: str = "cpu"  # torch device for quantization and eval: cpu, cuda, or auto
    torch_threads: int = 0  # CPU threads torch uses; 0 = torch's default (one per core)
    # Measure the fp16 perplexity on a second thread while quantizing: both models in memory at once.
    # Pays on a CPU host run with torch_threads=1 (two single-threaded streams); with torch's default
    # threads the two streams oversubscribe the cores.
    overlap_eval: bool = False
    heartbeat_s: float = 10.0  # how often this process marks its jobs alive and sweeps orphans
    orphan_after_s: float = 60.0  # another owner's job with no heartbeat for this long is failed
    grace_s: float = 10.0  # graceful stop: in-flight rpcs get this long, running jobs are cancelled
    tls: ServerTls | None = None  # serve over TLS (clients may have to present a certificate); None = plaintext
    # name -> token and scope, from QSERVE_QUANTIZER_TOKENS; the name is the actor recorded for Publish and
    # CancelJob. Empty: every caller is accepted (as before tokens existed; mTLS may still guard the port).
    tokens: Mapping[str, QuantizerToken] = field(default_factory=dict)
    # Folders a request's local paths (source, calibration and eval text) must lie in; empty: any path on this
    # host but the kernel's pseudo-files (/proc, /sys, /dev: /proc/self/environ holds this process's secrets).
    local_roots: tuple[Path, ...] = ()
    owner: str = field(default_factory=lambda: f"quantizer@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir)
        self.local_roots = tuple(Path(root).expanduser().resolve() for root in self.local_roots)
        if not self.registry_url:
            raise ConfigError("registry_url is required: sqlite:///path/registry.db or postgresql+psycopg://...")
        if not is_host_port(self.listen, port_zero=True):
            raise ConfigError(f"listen address {self.listen!r} is not host:port (e.g. {DEFAULT_LISTEN}, or port 0)")
        if not (isinstance(self.default_budget, (int, float)) and math.isfinite(self.default_budget)
                and self.default_budget >= 0):
            raise ConfigError(f"default budget {self.default_budget!r} must be a finite number >= 0 (0.05 = 5%)")
        if self.torch_threads < 0:
            raise ConfigError(f"torch_threads={self.torch_threads} must be >= 0 (0 = torch's default)")
        for name in ("workers", "max_queued"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be at least 1")
        check_device(self.device, DEVICES, ConfigError)
        for name in ("heartbeat_s", "grace_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive, finite number of seconds")
        if not (math.isfinite(self.orphan_after_s) and self.orphan_after_s >= 0):
            raise ConfigError(f"orphan_after_s={self.orphan_after_s} must be a finite number of seconds >= 0")
        if 0 < self.orphan_after_s <= self.heartbeat_s:
            raise ConfigError(f"orphan_after_s={self.orphan_after_s} must exceed heartbeat_s={self.heartbeat_s} (or be 0 "
                              f"with a single quantizer): other quantizers' live jobs would be failed between beats")
        # max_name: a token's name is the actor its calls record
        check_scoped_tokens(self.tokens, _WHAT, SCOPES, ConfigError, max_name=MAX_ACTOR)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> QuantizerConfig:
        """Settings from the command line; S3 credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and
        caller tokens from the environment (read here, once: secrets never go on a command line):
            QSERVE_QUANTIZER_TOKENS  name=token:scope[,name=token:scope...]   e.g. ci=s3cret:publish,dash=abc:read"""
        env = os.environ if environ is None else environ
        args = _parser().parse_args(argv)
        store = store_from_args(args, env, ConfigError)
        return cls(
            registry_url=args.registry_url,
            store=store,
            create_bucket=args.create_bucket,
            work_dir=args.work_dir,
            listen=args.listen,
            default_budget=args.budget,
            default_eval_data=args.eval_data,
            default_calib_data=args.calib_data,
            workers=args.workers,
            max_queued=args.max_queued,
            device=args.device,
            torch_threads=args.torch_threads,
            overlap_eval=args.overlap_eval,
            heartbeat_s=args.heartbeat_s,
            orphan_after_s=args.orphan_after_s,
            grace_s=args.grace_s,
            tls=server_tls_from_args(args, ConfigError),
            tokens=parse_tokens(env.get(TOKENS_ENV, "")),
            local_roots=tuple(args.local_root),
        )


def parse_tokens(text: str) -> dict[str, QuantizerToken]:
    """`name=token:scope,...` (the gateway's QSERVE_ADMIN_TOKENS format) -> {name: QuantizerToken}; the error
    names the setting and the entry that does not parse, never the token."""
    return parse_scoped_tokens(text, _WHAT, SCOPES, ConfigError)


def _parser() -> argparse.ArgumentParser:
    p = ServiceArgumentParser(
        prog="python -m services.quantizer.server",
        description="The quantizer service: Publish checkpoints as evaluated, GPU-bound artifacts. Caller tokens "
                    "come from QSERVE_QUANTIZER_TOKENS=name=token:scope,... (scope publish: every rpc; read: the "
                    "read-only ones); unset: every caller is accepted.",
    )
    add_registry_argument(p, required=True)
    add_store_arguments(p, required=True)
    p.add_argument("--create-bucket", action="store_true", help="create the store's bucket when it does not exist")
    p.add_argument("--work-dir", type=nonempty_path, default=Path("/tmp/qserve-quantizer"), help="scratch folder")
    p.add_argument("--local-root", type=nonempty_path, action="append", default=[],
                   help="a folder a request's local paths (source, calibration and eval text) must lie in; repeat "
                        "for several; none: any path on this host but /proc, /sys and /dev")
    p.add_argument("--listen", type=nonempty, default=DEFAULT_LISTEN, help="host:port to serve gRPC on")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="default accuracy budget: largest accepted relative perplexity increase (0.05 = 5%%)")
    p.add_argument("--eval-data", type=nonempty, default=None, help="default eval text (path or s3:// URI) for requests that name none")
    p.add_argument("--calib-data", type=nonempty, default=None,
                   help="default calibration text (path or s3:// URI) [default: the Python standard library sources]")
    p.add_argument("--workers", type=int, default=1, help="jobs that run at once")
    p.add_argument("--max-queued", type=int, default=16, help="queued jobs before Publish answers RESOURCE_EXHAUSTED")
    p.add_argument("--device", type=nonempty, default="cpu", help="torch device: cpu, cuda, cuda:N or auto")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="CPU threads for torch (0 = one per core; 1 on a host shared with other heavy work)")
    p.add_argument("--overlap-eval", action=argparse.BooleanOptionalAction, default=False,
                   help="measure the fp16 perplexity while quantizing (both models in memory; "
                        "use with --torch-threads 1 on small CPU hosts)")
    p.add_argument("--heartbeat-s", type=float, default=10.0,
                   help="how often this quantizer marks its running jobs alive and looks for orphaned ones")
    p.add_argument("--orphan-after-s", type=float, default=60.0,
                   help="fail another owner's job after this long without a heartbeat (0 with a single quantizer)")
    p.add_argument("--grace-s", type=float, default=10.0, help="graceful-stop time for in-flight rpcs")
    add_tls_server_arguments(p)
    return p

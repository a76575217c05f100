"""The gateway's settings, parsed once (command line plus secrets from the environment) and passed down."""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shared.config import (ServiceArgumentParser, add_registry_argument, add_tls_client_arguments,
                           add_tls_server_arguments, client_tls_from_args, nonempty, server_tls_from_args)
from shared.registry.models import MAX_ACTOR
from shared.rpc.address import split_host_port
from shared.rpc.bearer import ScopedToken, check_scoped_tokens, parse_scoped_tokens
from shared.rpc.tls import ClientTls, ServerTls

_WHAT = "QSERVE_ADMIN_TOKENS: admin token"  # how errors name an entry of the setting

DEFAULT_LISTEN = "127.0.0.1:50051"
SCOPES = ("admin", "worker")


class ConfigError(ValueError):
    """A gateway setting that cannot work; the message names it and what is accepted."""


# "admin": every Admin rpc; "worker": RegisterWorker, Heartbeat, DeregisterWorker
AdminToken = ScopedToken
# An API key's name: the `client` label of the per-client metrics and what limits and logs call it.
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key a Generate call may present; `name` ("" when given without one) says whose it is."""

    name: str
    key: str = field(repr=False)

    def describe(self) -> str:
        return f"API key {self.name!r}" if self.name else "this API key"


def parse_api_keys(text: str) -> tuple[ApiKey, ...]:
    """`key` or `name=key`, comma-separated; the name ends at the first '='. An entry with nothing but '='
    after it has an empty key, refused by the config (`team-b=${KEY}` with KEY unset: read as a key, the
    guessable "team-b=" would be accepted), so a key that itself ends in '=' (base64) is given with a name."""
    keys = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, has_name, key = entry.partition("=")
        if not has_name:
            keys.append(ApiKey("", entry))
        else:
            keys.append(ApiKey(name.strip(), "" if not key.strip("=") else key.strip()))
    return tuple(keys)


@dataclass(frozen=True, slots=True)
class FallbackBudget:
    """When the quantized path of a deployment breaks one of these over the last window_s seconds
    (and at least min_requests finished there), the gateway turns fallback on by itself."""

    max_error_rate: float = 0.05  # server-side failures / finished requests
    max_tpot_p95_s: float = 0.5  # 95th percentile of time per output token, seconds
    # 95th percentile of time to the first token, seconds; 0 = not judged (it grows with prompt lengths and the
    # load, so only an operator who knows the traffic can set it)
    max_ttft_p95_s: float = 0.0
    window_s: float = 30.0
    min_requests: int = 20  # fewer requests than this in the window: too little evidence to act on
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class Quarantine:
    """A worker that fails after_failures requests in a row (none finished in between) gets no requests for
    first_s seconds, though it heartbeats, provided another healthy worker serves its artifact; each further
    quarantine of the same run of failures lasts twice as long, at most max_s (WorkerPool.mark_failed)."""

    after_failures: int = 3  # 0 = off: a failed worker is back on its next heartbeat, as without quarantine
    first_s: float = 5.0
    max_s: float = 300.0

    @property
    def enabled(self) -> bool:
        return self.after_failures > 0


@dataclass(slots=True)
class GatewayConfig:
    # sqlite:///path/registry.db or postgresql+psycopg://user@host/db; out of repr: a URL may carry a password
    registry_url: str = field(repr=False)
    listen: str = DEFAULT_LISTEN  # host:port; port 0 picks a free one
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; 0 = a free port; None = off
    metrics_host: str = ""  # "" = the host of `listen`, as the worker serves its metrics on its --host
    # name -> token and scope; the name is the actor recorded in the event log.
    admin_tokens: Mapping[str, AdminToken] = field(default_factory=dict)
    # Keys a Generate call must present as `authorization: Bearer <key>`; empty = no key needed. Plain strings
    # are taken for keys without a name.
    api_keys: Sequence[ApiKey | str] = field(default=(), repr=False)
    max_concurrent_streams: int = 256
    # Generate streams one API key may have open at once (0 = no limit but max_concurrent_streams): one
    # client flooding the gateway gets RESOURCE_EXHAUSTED, not every slot.
    max_streams_per_client: int = 0
    heartbeat_interval_s: float = 2.0  # told to workers at registration
    heartbeat_timeout_s: float = 6.0  # a worker silent this long is marked unhealthy
    worker_forget_s: float = 300.0  # a worker silent this long is removed from the pool (its channel closed)
    deployment_cache_s: float = 0.25  # how stale a deployment read from the registry may be
    worker_info_timeout_s: float = 5.0  # RegisterWorker's call to the worker's Info
    # A worker that sends nothing for this long after taking a request has failed it: the request is retried
    # elsewhere (servicer_gateway). 0 = no limit. Above any queue wait plus prefill a loaded worker may take.
    first_reply_timeout_s: float = 120.0
    # A stream that makes no progress for this long once the worker has replied is ended (servicer_gateway): a
    # worker silent between tokens has failed it, a client that reads nothing has left it. 0 = no limit.
    stream_stall_timeout_s: float = 300.0
    budget: FallbackBudget = field(default_factory=FallbackBudget)
    quarantine: Quarantine = field(default_factory=Quarantine)  # of workers failing request after request
    fallback_check_s: float = 0.5  # how often the automatic fallback looks at the windows
    grace_s: float = 5.0  # graceful stop: in-flight streams get this long
    tls: ServerTls | None = None  # serve over TLS (clients may have to present a certificate); None = plaintext
    worker_tls: ClientTls | None = None  # dial workers over TLS; None = plaintext

    def __post_init__(self) -> None:
        if not self.registry_url:
            raise ConfigError("registry_url is required: sqlite:///path/registry.db or postgresql+psycopg://...")
        address = split_host_port(self.listen, port_zero=True)
        if address is None:
            raise ConfigError(f"listen address {self.listen!r} is not host:port (e.g. {DEFAULT_LISTEN}, or port 0)")
        self.metrics_host = self.metrics_host or address[0]
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics port {self.metrics_port} must be 0..65535 (0 = a free port) or unset (off)")
        check_scoped_tokens(self.admin_tokens, _WHAT, SCOPES, ConfigError, max_name=MAX_ACTOR)
        self.api_keys = tuple(k if isinstance(k, ApiKey) else ApiKey("", k) for k in self.api_keys)
        _check_api_keys(self.api_keys)
        if self.max_concurrent_streams < 1:
            raise ConfigError(f"max_concurrent_streams={self.max_concurrent_streams} must be at least 1")
        limit = self.max_streams_per_client
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ConfigError(f"--max-streams-per-client {limit} must be a whole number of streams, or 0 (no limit)")
        if limit and not self.api_keys:
            raise ConfigError("--max-streams-per-client needs API keys (QSERVE_API_KEYS): without them every call is "
                              "the same anonymous client")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "worker_forget_s", "worker_info_timeout_s",
                     "fallback_check_s", "grace_s"):
            if not _positive(getattr(self, name)):
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive number of seconds")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed heartbeat_interval_s="
                              f"{self.heartbeat_interval_s}, or every worker would be marked unhealthy between beats")
        if self.worker_forget_s <= self.heartbeat_timeout_s:
            raise ConfigError(f"worker_forget_s={self.worker_forget_s} must exceed heartbeat_timeout_s="
                              f"{self.heartbeat_timeout_s}: a worker is marked unhealthy before it is forgotten")
        if not (_positive(self.first_reply_timeout_s) or self.first_reply_timeout_s == 0):
            raise ConfigError(f"--first-reply-timeout-s {self.first_reply_timeout_s} must be a positive number of "
                              f"seconds, or 0 (no limit)")
        if not (_positive(self.stream_stall_timeout_s) or self.stream_stall_timeout_s == 0):
            raise ConfigError(f"--stream-stall-timeout-s {self.stream_stall_timeout_s} must be a positive number of "
                              f"seconds, or 0 (no limit)")
        if not (_positive(self.deployment_cache_s) or self.deployment_cache_s == 0) or self.deployment_cache_s > 1.0:
            raise ConfigError(f"deployment_cache_s={self.deployment_cache_s} must be 0..1 s: a fallback switch "
                              f"must take effect within a second")
        b = self.budget
        if not (0 <= b.max_error_rate <= 1):
            raise ConfigError(f"max error rate {b.max_error_rate} must be in [0, 1] (0.05 = 5% of requests)")
        if not _positive(b.max_tpot_p95_s):
            raise ConfigError(f"max TPOT p95 {b.max_tpot_p95_s} must be a positive number of seconds")
        if not (_positive(b.max_ttft_p95_s) or b.max_ttft_p95_s == 0):
            raise ConfigError(f"max TTFT p95 {b.max_ttft_p95_s} must be a positive number of seconds, or 0 (not "
                              f"judged)")
        if not _positive(b.window_s):
            raise ConfigError(f"fallback window {b.window_s} must be a positive number of seconds")
        if b.min_requests < 1:
            raise ConfigError(f"fallback min_requests={b.min_requests} must be at least 1")
        q = self.quarantine
        if isinstance(q.after_failures, bool) or not isinstance(q.after_failures, int) or q.after_failures < 0:
            raise ConfigError(f"--quarantine-after-failures {q.after_failures} must be a whole number of failed "
                              f"requests in a row, at least 1, or 0 (quarantine off)")
        if not _positive(q.first_s):
            raise ConfigError(f"--quarantine-s {q.first_s} must be a positive number of seconds")
        if not _positive(q.max_s):
            raise ConfigError(f"--quarantine-max-s {q.max_s} must be a positive number of seconds")
        if q.max_s < q.first_s:
            raise ConfigError(f"--quarantine-max-s {q.max_s} is shorter than --quarantine-s {q.first_s}: the "
                              f"longest quarantine cannot be shorter than the first")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> GatewayConfig:
        """Settings from the command line; tokens and API keys from the environment (read here, once:
        secrets never go on a command line):
            QSERVE_ADMIN_TOKENS  name=token:scope[,name=token:scope...]   e.g. ops=s3cret:admin,w=abc:worker
            QSERVE_API_KEYS      [name=]key[,[name=]key...]                 e.g. team-a=k1,team-b=k2"""
        env = os.environ if environ is None else environ
        args = _parser().parse_args(argv)
        if not _positive(args.max_tpot_p95_ms):  # named here: the budget holds it in seconds
            raise ConfigError(f"--max-tpot-p95-ms {args.max_tpot_p95_ms} must be a positive number of milliseconds")
        if not (_positive(args.max_ttft_p95_ms) or args.max_ttft_p95_ms == 0):
            raise ConfigError(f"--max-ttft-p95-ms {args.max_ttft_p95_ms} must be a positive number of milliseconds, "
                              f"or 0 (not judged)")
        return cls(
            registry_url=args.registry_url,
            listen=args.listen,
            metrics_port=None if args.metrics_port == -1 else args.metrics_port,
            admin_tokens=parse_admin_tokens(env.get("QSERVE_ADMIN_TOKENS", "")),
            api_keys=parse_api_keys(env.get("QSERVE_API_KEYS", "")),
            max_concurrent_streams=args.max_concurrent_streams,
            max_streams_per_client=args.max_streams_per_client,
            heartbeat_interval_s=args.heartbeat_interval_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            worker_forget_s=args.worker_forget_s,
            first_reply_timeout_s=args.first_reply_timeout_s,
            stream_stall_timeout_s=args.stream_stall_timeout_s,
            budget=FallbackBudget(
                max_error_rate=args.max_error_rate, max_tpot_p95_s=args.max_tpot_p95_ms / 1000.0,
                max_ttft_p95_s=args.max_ttft_p95_ms / 1000.0,
                window_s=args.fallback_window_s, min_requests=args.fallback_min_requests,
                enabled=args.auto_fallback,
            ),
            quarantine=Quarantine(after_failures=args.quarantine_after_failures, first_s=args.quarantine_s,
                                  max_s=args.quarantine_max_s),
            grace_s=args.grace_s,
            tls=server_tls_from_args(args, ConfigError),
            worker_tls=client_tls_from_args(args, ConfigError),
        )


def parse_admin_tokens(text: str) -> dict[str, AdminToken]:
    """`name=token:scope,...` -> {name: AdminToken}; the error names the entry that does not parse."""
    return parse_scoped_tokens(text, _WHAT, SCOPES, ConfigError)


def _check_api_keys(keys: Sequence[ApiKey]) -> None:
    """No error here shows a key: the message names the entry by its name, or its position."""
    names: set[str] = set()
    secrets: set[str] = set()
    for position, entry in enumerate(keys, 1):
        if not entry.key:
            raise ConfigError(f"QSERVE_API_KEYS: entry {position} has an empty key (an unset variable?); give "
                              f"non-empty keys or none (no key needed); a key ending in '=' needs a name: name=KEY")
        if entry.name:
            if not _CLIENT_NAME.fullmatch(entry.name):
                raise ConfigError(f"QSERVE_API_KEYS: key name {entry.name[:20]!r} is not accepted: 1-64 letters, "
                                  f"digits, '.', '_' or '-', starting with a letter or digit")
            if entry.name in names:
                raise ConfigError(f"QSERVE_API_KEYS: key name {entry.name!r} appears twice")
            names.add(entry.name)
        if entry.key in secrets:
            raise ConfigError(f"QSERVE_API_KEYS: entry {position} repeats another entry's key; every client needs "
                              f"its own")
        secrets.add(entry.key)


def _positive(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _parser() -> argparse.ArgumentParser:
    p = ServiceArgumentParser(
        prog="python -m services.gateway.server",
        description="The gateway: routes client generations to workers (canary rollouts, fallback switch). "
                    "Admin tokens come from QSERVE_ADMIN_TOKENS=name=token:scope,..., API keys from QSERVE_API_KEYS.",
    )
    add_registry_argument(p, required=True)
    p.add_argument("--listen", type=nonempty, default=DEFAULT_LISTEN,
                   help="host:port to serve gRPC on (port 0: a free one)")
    p.add_argument("--metrics-port", type=int, default=-1,
                   help="Prometheus /metrics HTTP port on the --listen host (0 picks a free one, -1 turns it off) "
                        "[default: off]")
    p.add_argument("--max-concurrent-streams", type=int, default=256,
                   help="open Generate streams beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--max-streams-per-client", type=int, default=0,
                   help="open Generate streams one API key may have beyond which its new ones get RESOURCE_EXHAUSTED "
                        "(0: no limit of its own)")
    p.add_argument("--heartbeat-interval-s", type=float, default=2.0,
                   help="how often registered workers are told to send a heartbeat")
    p.add_argument("--heartbeat-timeout-s", type=float, default=6.0,
                   help="a worker with no heartbeat for this long gets no new requests")
    p.add_argument("--worker-forget-s", type=float, default=300.0,
                   help="a worker with no heartbeat for this long is removed from the pool (it registers again "
                        "when it comes back)")
    p.add_argument("--first-reply-timeout-s", type=float, default=120.0,
                   help="a worker that has sent nothing for this long after taking a request is taken to have "
                        "failed it: its stream is cancelled, the failure counts towards its quarantine, and the "
                        "request is retried on another worker; a client that leaves before its first token after "
                        "waiting longer counts as an error of its arm. Keep it above the longest queue wait plus "
                        "prefill a loaded worker takes. 0 turns it off")
    p.add_argument("--stream-stall-timeout-s", type=float, default=300.0,
                   help="a stream that makes no progress for this long once its worker has replied is ended: a "
                        "worker that sends nothing more has failed it (UNAVAILABLE, counted towards its quarantine), "
                        "a client that reads nothing (its buffers full) has left it (the worker's slot is freed). "
                        "0 turns it off")
    p.add_argument("--auto-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="abort a canary that breaks its budget; turn fallback on when the quantized stable does")
    p.add_argument("--max-error-rate", type=float, default=0.05, help="error-rate budget of the stable and canary arms")
    p.add_argument("--max-tpot-p95-ms", type=float, default=500.0,
                   help="time-per-output-token p95 budget of the stable and canary arms, milliseconds")
    p.add_argument("--max-ttft-p95-ms", type=float, default=0.0,
                   help="time-to-first-token p95 budget of the stable and canary arms, milliseconds; 0 (the "
                        "default) leaves TTFT unjudged: it grows with prompt lengths and load")
    p.add_argument("--fallback-window-s", type=float, default=30.0, help="window the budgets are measured over")
    p.add_argument("--fallback-min-requests", type=int, default=20,
                   help="finished requests in the window below which the arm is judged on its whole run (up "
                        "to an hour back) instead; fewer there too: not judged")
    p.add_argument("--quarantine-after-failures", type=int, default=3,
                   help="a worker that fails this many requests in a row gets no requests for --quarantine-s "
                        "though it heartbeats, while another healthy worker serves its artifact (the last one "
                        "is never quarantined: the guard and fallback judge the artifact by its failures); "
                        "0 turns quarantine off")
    p.add_argument("--quarantine-s", type=float, default=5.0,
                   help="length of a worker's first quarantine; each further one of the same run of failures "
                        "(no request finished in between) lasts twice as long")
    p.add_argument("--quarantine-max-s", type=float, default=300.0, help="the longest a quarantine lasts")
    p.add_argument("--grace-s", type=float, default=5.0, help="graceful-stop time for in-flight streams")
    add_tls_server_arguments(p)
    add_tls_client_arguments(p, "workers")
    return p

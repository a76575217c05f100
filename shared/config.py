"""What every service's command line shares: a parser whose errors are one line, the registry and store
flags spelled and documented alike, and start-up failures printed as one line with exit code 2.

Settings come from flags; secrets only from the environment (a command line is visible to every user of
the host), so no setting has both a flag and a variable and none can shadow the other."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from shared.rpc.tls import ClientTls, ServerTls, TlsError, load_client_tls, load_server_tls
from shared.storage import InvalidConfig, StorageConfig

DEFAULT_STORE_REGION = "us-east-1"
REGISTRY_HELP = ("registry: sqlite:///path/registry.db or postgresql+psycopg://user@host:5432/db; the database "
                 "password comes from $PGPASSWORD, never the URL")
STORE_HELP = ("artifact store: s3://bucket/prefix?endpoint=http://host:9000&region=r, file:///path or a path; "
              "S3 credentials come from $AWS_ACCESS_KEY_ID, $AWS_SECRET_ACCESS_KEY and $AWS_SESSION_TOKEN")
SQLALCHEMY_FOOTER = "(Background on this error at:"


class ServiceArgumentParser(argparse.ArgumentParser):
    """argparse without abbreviations (`--grac` would become --grace-s today and something else once a
    flag with that prefix is added), whose errors are one line naming the flag instead of a usage block."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def nonempty(text: str) -> str:
    """argparse type: `--store=${UNSET:-}` is a mistake, not a request for the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def nonempty_path(text: str) -> Path:
    """argparse type: Path('') is '.', the current directory, which no operator means by an empty value."""
    return Path(nonempty(text))


def registry_url_argument(text: str) -> str:
    """argparse type of --registry-url: one that carries a password is refused (a command line is what `ps` and
    the orchestrator's pod listing show), as its help has always said; libpq reads $PGPASSWORD."""
    from shared.registry.urls import carries_password  # sqlalchemy only when a service parses its flags

    if carries_password(nonempty(text)):
        raise argparse.ArgumentTypeError("carries a password: give it in $PGPASSWORD, not on the command line "
                                         "(the URL is not shown here)")
    return text


def add_registry_argument(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--registry-url", type=registry_url_argument, required=required, default=None,
                        help=REGISTRY_HELP)


def add_store_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--store", type=nonempty, required=required, default=None, help=STORE_HELP)
    parser.add_argument("--store-endpoint", type=nonempty, default=None,
                        help="S3 endpoint URL when --store names none (e.g. http://minio:9000)")
    parser.add_argument("--store-region", type=nonempty, default=None,
                        help=f"S3 region when --store names none [default: {DEFAULT_STORE_REGION}]")


def store_from_args(args: argparse.Namespace, environ: Mapping[str, str], error: type[Exception]) -> StorageConfig:
    """--store with --store-endpoint / --store-region; a value given both ways is refused (the URL's would
    win without a word)."""
    query = args.store.partition("?")[2]
    for flag, key in (("--store-endpoint", "endpoint"), ("--store-region", "region")):
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is not None and any(p.partition("=")[0] == key for p in query.split("&")):
            raise error(f"{flag} and --store's ?{key}= both set the S3 {key}: give it once")
    try:
        return StorageConfig.from_command_line(args.store, args.store_endpoint,
                                               args.store_region or DEFAULT_STORE_REGION, environ)
    except InvalidConfig as exc:  # named as the operator wrote it
        raise error(f"--store: {exc}") from None


def add_tls_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own TLS: off (plaintext) unless --tls-cert and --tls-key are given."""
    parser.add_argument("--tls-cert", type=nonempty_path, default=None, metavar="FILE",
                        help="PEM certificate chain: serve gRPC over TLS (with --tls-key) [default: plaintext]")
    # A path, not a secret: the key stays in its file, which only the service's user should be able to read.
    parser.add_argument("--tls-key", type=nonempty_path, default=None, metavar="FILE",
                        help="PEM private key of --tls-cert (unencrypted)")
    parser.add_argument("--tls-client-ca", type=nonempty_path, default=None, metavar="FILE",
                        help="PEM CA certificates: require every client to present a certificate one of them "
                             "signed (mutual TLS; needs --tls-cert)")


def add_tls_client_arguments(parser: argparse.ArgumentParser, peers: str) -> None:
    """TLS towards `peers` (what this service dials): on when --tls-ca names a file. Unlike the other flags an
    empty value is accepted, as plaintext: `--tls-ca=${QSERVE_TLS_CA:-}` in a compose file turns it off."""
    parser.add_argument("--tls-ca", default=None, metavar="FILE",
                        help=f"PEM CA certificates that signed the {peers}' certificates: dial them over TLS, "
                             f"checking the certificate against the host dialled [default, or empty: plaintext]")
    parser.add_argument("--tls-client-cert", default=None, metavar="FILE",
                        help=f"PEM certificate to present to {peers} that require one (mutual TLS; needs --tls-ca)")
    parser.add_argument("--tls-client-key", default=None, metavar="FILE",
                        help="PEM private key of --tls-client-cert (unencrypted)")


def server_tls_from_args(args: argparse.Namespace, error: type[Exception]) -> ServerTls | None:
    """The files of add_tls_server_arguments, read and checked now: a bad one stops the start-up in one line
    (grpc would only fail at a client's first handshake)."""
    try:
        return load_server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    except TlsError as exc:
        raise error(str(exc)) from None


def client_tls_from_args(args: argparse.Namespace, error: type[Exception]) -> ClientTls | None:
    """The files of add_tls_client_arguments, read and checked now."""
    try:
        return load_client_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key)
    except TlsError as exc:
        raise error(str(exc)) from None


def check_device(device: str, accepted: tuple[str, ...], error: type[Exception]) -> None:
    """--device: one of `accepted` or cuda:N (the worker's and the quantizer's rule; the quantizer took 'cuda:'
    and 'cuda:x', and failed every publish on them)."""
    if device not in accepted and not re.fullmatch(r"cuda:[0-9]+", device):
        raise error(f"device {device!r} is not supported; accepted: {', '.join(accepted)}, cuda:N")


def require_visible_device(device: str, error: type[Exception]) -> None:
    """At a service's start: a CUDA device this process cannot see (a CPU build of torch, no GPU, an index past
    its GPUs) is refused naming --device. It was a traceback at the worker's first load, and a quantizer that
    reported healthy failed every publish minutes in."""
    if not device.startswith("cuda"):
        return
    import torch  # here: the services' configuration is parsed before torch is needed

    if not torch.cuda.is_available():
        raise error(f"--device {device}: no CUDA GPU is visible to this process (a CPU build of torch, or no GPU); "
                    f"use --device cpu")
    index = device.partition(":")[2]
    if index and int(index) >= torch.cuda.device_count():
        raise error(f"--device {device}: this process sees {torch.cuda.device_count()} CUDA GPU(s)")


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (SQLAlchemy adds a hint line and a link to its docs)."""
    lines = [line.strip() for line in str(exc).splitlines() if not line.startswith(SQLALCHEMY_FOOTER)]
    return " ".join(line for line in lines if line) or type(exc).__name__


def fail(exc: BaseException, prefix: str = "error: ") -> int:
    """Prints a start-up failure as one line for main() to return as exit code 2."""
    print(prefix + one_line(exc), file=sys.stderr)
    return 2

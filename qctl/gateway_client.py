"""What the gateway commands share: the address and token options (with env-var fallbacks), the
stubs with the bearer token attached (over TLS with qctl.tls's options), and gRPC errors as one line
with exit code 2."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import typer
from google.protobuf.duration_pb2 import Duration

from qctl.choices import bearer_token, service_address
from qctl.errors import rpc_errors as rpc_errors_of
from qctl.tls import open_channel
from shared.rpc.bearer import bearer_metadata
from shared.rpc.qserve.v1 import gateway_pb2_grpc

DEFAULT_GATEWAY = "127.0.0.1:50051"
GATEWAY_OPTION = typer.Option(DEFAULT_GATEWAY, "--gateway", envvar="QCTL_GATEWAY", help="host:port of the gateway",
                              callback=service_address)
TOKEN_OPTION = typer.Option(..., "--token", envvar="QCTL_TOKEN", show_default=False, callback=bearer_token,
                            help="admin bearer token (scope admin)")
RPC_TIMEOUT_S = 30.0


# gRPC failures as one line and exit code 2, naming the gateway (qctl.errors.rpc_errors).
rpc_errors = rpc_errors_of("gateway")


@dataclass
class Admin:
    """The Admin stub with the bearer token on every call."""

    stub: gateway_pb2_grpc.AdminStub
    metadata: tuple[tuple[str, str], ...]

    def __getattr__(self, rpc: str):
        method = getattr(self.stub, rpc)
        return functools.partial(method, metadata=self.metadata, timeout=RPC_TIMEOUT_S)


@contextmanager
def admin_client(address: str, token: str) -> Iterator[Admin]:
    """Over TLS inside qctl.tls.tls_settings with a CA, else plaintext."""
    with open_channel(address) as channel:
        yield Admin(gateway_pb2_grpc.AdminStub(channel), bearer_metadata(token))


@contextmanager
def gateway_client(address: str) -> Iterator[gateway_pb2_grpc.GatewayStub]:
    with open_channel(address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def ms(duration: Duration) -> str:
    return f"{duration.ToNanoseconds() / 1e6:.1f} ms"

"""qctl's TLS options (each with its variable, like --gateway / QCTL_GATEWAY) and its channels: plaintext
unless --tls-ca / QCTL_TLS_CA names the CA certificates that signed the server's certificate. The same
settings serve the gateway and the quantizer commands (a command talks to one of them).

A command decorated with @tls_options takes the three options and runs inside `with tls_settings(...)`:
the channel helpers (admin_client, gateway_client, quantizer_stub) keep their (address[, token])
signatures, and `qctl up`, which calls them outside any such block, stays on plaintext for its own
loopback stack whatever QCTL_TLS_CA holds."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import grpc
import typer

from shared.rpc.tls import ClientTls, channel, load_client_tls

# How a message names each setting: the flag, or its variable where the user set that instead.
FLAGS = ("--tls-ca / QCTL_TLS_CA", "--tls-client-cert / QCTL_TLS_CLIENT_CERT", "--tls-client-key / QCTL_TLS_CLIENT_KEY")
TLS_CA_OPTION = typer.Option("", "--tls-ca", envvar="QCTL_TLS_CA", show_default=False,
                             help="PEM CA certificates that signed the server's certificate: connect over TLS "
                                  "(unset or empty: plaintext)")
TLS_CERT_OPTION = typer.Option("", "--tls-client-cert", envvar="QCTL_TLS_CLIENT_CERT", show_default=False,
                               help="PEM client certificate, for a server that requires one (with --tls-ca)")
TLS_KEY_OPTION = typer.Option("", "--tls-client-key", envvar="QCTL_TLS_CLIENT_KEY", show_default=False,
                              help="PEM private key of --tls-client-cert")

_current: ContextVar[ClientTls | None] = ContextVar("qctl_tls", default=None)


@contextmanager
def tls_settings(tls_ca: str, tls_client_cert: str, tls_client_key: str) -> Iterator[None]:
    """Channels opened inside use these files (read and checked here: a bad one raises
    shared.rpc.tls.TlsError, which qctl.errors.rpc_errors prints as one line); no CA: plaintext."""
    token = _current.set(load_client_tls(tls_ca, tls_client_cert, tls_client_key, FLAGS))
    try:
        yield
    finally:
        _current.reset(token)


def open_channel(address: str) -> grpc.Channel:
    return channel(address, _current.get())


_OPTIONS = (("tls_ca", TLS_CA_OPTION), ("tls_client_cert", TLS_CERT_OPTION), ("tls_client_key", TLS_KEY_OPTION))


def tls_options(command):
    """A qctl command with --tls-ca / --tls-client-cert / --tls-client-key added to its options (typer
    reads the signature), run inside tls_settings. Put it under @rpc_errors, which prints a TlsError and
    reads tls_ca for its hints."""
    signature = inspect.signature(command)

    @functools.wraps(command)
    def run(*args, tls_ca: str, tls_client_cert: str, tls_client_key: str, **kwargs):
        with tls_settings(tls_ca, tls_client_cert, tls_client_key):
            return command(*args, **kwargs)

    extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=str)
             for name, option in _OPTIONS]
    run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *extra])
    return run

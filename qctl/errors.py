"""Turns the errors a user can cause into one clear line and exit code 2, never a traceback."""

from __future__ import annotations

import functools
import sys

import grpc
import typer

from qctl.tls import FLAGS as TLS_FLAGS
from shared.rpc.tls import TlsError, mismatch_hint

# The errors a user causes with a bad checkpoint, calibration file, artifact, manifest or format
# (shared.model.config.CheckpointError, shared.quant.calibration.CalibrationError,
# shared.formats.artifact.ArtifactError, shared.formats.manifest.ManifestError, shared.formats.weights.FormatError)
# are all ValueErrors, caught as such: naming them here imported torch (through artifact, weights and calibration)
# into every qctl command, --help included, for 2-3 s. tests/cli/test_start_up_imports.py checks that they
# still are ValueErrors.
# OSError: a path the user gave that cannot be written or read (--out or --workdir under a file, a folder without
# permission, a full disk); FileNotFoundError is one. It was a traceback but for a missing file.
USER_ERRORS = (OSError, ValueError)
# What to give when a service answers UNAUTHENTICATED (the gateway's commands require --token already).
TOKEN_HINTS = {"quantizer": "give one of the quantizer's tokens with --quantizer-token or QCTL_QUANTIZER_TOKEN"}


def user_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(code=2) from None

    return wrapper


def rpc_errors(service: str):
    """A gRPC failure of a call to `service` (the keyword argument of that name holds its address)
    as one line and exit code 2: the service's status and message, and, when the service cannot be
    reached at all, that it cannot be reached at that address (and which TLS setting may be wrong). A TLS
    file that cannot be used (qctl.tls) is one line too."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except TlsError as exc:
                print(f"error: {exc}", file=sys.stderr)
                raise typer.Exit(code=2) from None
            except UnicodeError as exc:  # an argument with bytes that are not UTF-8 (a shell's $'caf\xe9')
                print(f"error: an argument is not valid UTF-8 text: {exc}", file=sys.stderr)
                raise typer.Exit(code=2) from None
            except grpc.RpcError as exc:
                address = kwargs.get(service, "")
                details = " ".join((exc.details() or "").split())  # one line: a database's error spans several
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Connected and silent, or slow (a registry lock): a change asked for may still be applied
                    # after qctl gave up. Said to be unreachable, an operator retried a promote that had happened.
                    print(f"error: no answer from the {service} at {address} within its deadline: it may be "
                          f"unreachable, or slow, and then a change this command asked for may still be applied; "
                          f"check before retrying (qctl rollout status, qctl events, qctl jobs list)", file=sys.stderr)
                elif _unreachable(exc):
                    hint = mismatch_hint(exc.details() or "", bool(kwargs.get("tls_ca")), TLS_FLAGS)
                    print(f"error: cannot reach the {service} at {address} ({exc.code().name}): {details}"
                          f"{hint}", file=sys.stderr)
                else:
                    hint = TOKEN_HINTS.get(service) if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
                    print(f"error: {service} {address}: {details} ({exc.code().name})"
                          f"{f'; {hint}' if hint else ''}", file=sys.stderr)
                raise typer.Exit(code=2) from None

        return wrapper

    return decorate


# What gRPC's transport says when it reaches no server: "failed to connect to all addresses", "DNS resolution
# failed" or "errors resolving <host>" for a name that does not resolve, "Socket closed" / "Connection reset" for a
# peer that went away. A service's own UNAVAILABLE can say "connection" too (a gateway whose registry database is
# down passes on "connection failed: connection to server at ..."): that is the service answering.
_TRANSPORT_WORDS = ("failed to connect", "dns resolution", "errors resolving", "socket closed", "connection reset")


def _unreachable(exc: grpc.RpcError) -> bool:
    """A transport failure (nothing listening), as opposed to the service answering UNAVAILABLE itself (a gateway
    with no healthy worker, or without its database, does)."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and any(word in details for word in _TRANSPORT_WORDS)

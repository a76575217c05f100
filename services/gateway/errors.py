"""Errors of the gateway. Each maps to the gRPC status gateway.proto promises (see status_of)."""

from __future__ import annotations

import logging

import grpc
from sqlalchemy.exc import OperationalError

from shared.registry import Conflict, InvalidState, InvalidValue, NotFound

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base class of the errors below."""


class InvalidRequest(GatewayError, ValueError):
    """A request field is missing or malformed (INVALID_ARGUMENT); the message names it."""


class UnknownName(GatewayError):
    """A named deployment, worker or artifact does not exist (NOT_FOUND)."""


class Precondition(GatewayError):
    """The request is well formed but the state does not allow it (FAILED_PRECONDITION)."""


class AdmissionFull(GatewayError):
    """Too many open streams, or every eligible worker is at capacity (RESOURCE_EXHAUSTED)."""


class NoWorker(GatewayError):
    """No healthy worker can serve the request, or a worker failed mid-stream (UNAVAILABLE)."""


class Unauthenticated(GatewayError):
    """No bearer token, a malformed one, or one the gateway does not know (UNAUTHENTICATED)."""


class Forbidden(GatewayError):
    """A known token calling an rpc outside its scope (PERMISSION_DENIED)."""


class DeadlinePassed(GatewayError):
    """The client's deadline passed before an admin change was committed, so it was not (DEADLINE_EXCEEDED)."""


_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidValue, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownName, grpc.StatusCode.NOT_FOUND),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.ALREADY_EXISTS),
    (Precondition, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidState, grpc.StatusCode.FAILED_PRECONDITION),
    (AdmissionFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NoWorker, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (DeadlinePassed, grpc.StatusCode.DEADLINE_EXCEEDED),
    (OperationalError, grpc.StatusCode.UNAVAILABLE),  # the registry's database cannot be reached
)
MAPPED = tuple(error for error, _ in _CODES)


def status_of(exc: Exception) -> grpc.StatusCode:
    return next(code for error, code in _CODES if isinstance(exc, error))


def details_of(exc: Exception) -> str:
    """What a caller is told of a mapped error: a database error's own text (its SQL, the database's host and
    port) stays in the gateway's log."""
    if isinstance(exc, OperationalError):
        log.warning("the registry's database failed: %s", str(exc).replace("\n", " "))
        return "the registry's database cannot be reached; retry later"
    return str(exc)

"""Errors of the worker. Each carries the gRPC status the proto promises for it."""

from __future__ import annotations

import grpc

from shared.rpc.refusal import DRAINING_METADATA


class WorkerError(Exception):
    code = grpc.StatusCode.INTERNAL
    trailing_metadata: tuple[tuple[str, str], ...] = ()


class InvalidRequest(WorkerError, ValueError):
    """A Generate or Abort field is missing or out of range; the message names it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class DuplicateRequest(WorkerError):
    code = grpc.StatusCode.ALREADY_EXISTS


class QueueFull(WorkerError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Draining(WorkerError):
    """Shutting down: a routine refusal, marked as such so that the gateway does not count it as a failure."""

    code = grpc.StatusCode.UNAVAILABLE
    trailing_metadata = DRAINING_METADATA


class Stalled(WorkerError):
    """The engine made no progress for too long (a hung device?): a failure, unlike Draining."""

    code = grpc.StatusCode.UNAVAILABLE


class ArtifactRefused(WorkerError):
    """The artifact cannot be served by this worker (refused at start-up, before serving)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ArtifactMismatch(ArtifactRefused):
    """Built for another GPU target, or of a format this worker does not run."""


class ArtifactCorrupt(ArtifactRefused):
    """Files missing, truncated or not matching the manifest's sha256."""

    code = grpc.StatusCode.DATA_LOSS


class ArtifactBroken(ArtifactRefused):
    """Loads, but its start-up self-check generation fails or its logits are NaN / inf on this worker
    (bad scales, a kernel that breaks on its shapes): refused before it is announced to any gateway."""


class ArtifactNotFound(ArtifactRefused):
    code = grpc.StatusCode.NOT_FOUND


class ArtifactUnavailable(ArtifactRefused):
    """The artifact's objects cannot be fetched (the object store unreachable, or refusing this worker's
    credentials) and no complete cached copy is at hand: nothing says the artifact is damaged, and a
    later start may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class ArtifactNotReady(ArtifactRefused):
    """The registry has the artifact as PENDING (publication under way) or FAILED: never served."""


class RunnerUnavailable(WorkerError):
    """The runner for the requested device is not part of this build."""

    code = grpc.StatusCode.FAILED_PRECONDITION

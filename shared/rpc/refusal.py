"""The trailing metadata by which a worker says that its UNAVAILABLE is a routine refusal (it is draining),
not a failure: the gateway sends the request elsewhere without counting it against the worker or its arm.

A code alone cannot say it: a worker whose engine stalled answers UNAVAILABLE too, and that one is failing.
The gateway learns of a drain from the worker's heartbeat as well, but a request can reach the worker in
the moment between the drain's start and the next heartbeat."""

from __future__ import annotations

import grpc

REFUSAL_KEY = "qserve-refusal"
DRAINING = "draining"
DRAINING_METADATA: tuple[tuple[str, str], ...] = ((REFUSAL_KEY, DRAINING),)


def refused_for_draining(err: grpc.aio.AioRpcError) -> bool:
    """Whether the worker's error is its refusal of a new request while it drains."""
    if err.code() is not grpc.StatusCode.UNAVAILABLE:
        return False
    return any(key == REFUSAL_KEY and value == DRAINING for key, value in (err.trailing_metadata() or ()))

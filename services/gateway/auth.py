"""Bearer tokens: scoped admin tokens for the Admin service, plain API keys for Generate.

Checked per call (not in an interceptor) because the scope depends on the rpc and the token's name
becomes the actor of the events the call records."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from services.gateway.config import AdminToken, ApiKey
from services.gateway.errors import Forbidden, Unauthenticated
from shared.rpc.bearer import bearer, find_token

WORKER_RPCS = frozenset({"RegisterWorker", "Heartbeat", "DeregisterWorker"})


class AdminAuth:
    def __init__(self, tokens: Mapping[str, AdminToken]):
        self._tokens = dict(tokens)

    def actor(self, metadata, rpc: str) -> str:
        """The token's name when it may call `rpc`; raises Unauthenticated or Forbidden otherwise."""
        token = bearer(metadata)
        if token is None:
            raise Unauthenticated(f"Admin.{rpc} needs metadata `authorization: Bearer <token>` with an admin "
                                  f"or worker token")
        found = find_token(token, self._tokens)  # constant time, every entry
        if found is None:
            raise Unauthenticated(f"Admin.{rpc}: the bearer token is not one this gateway knows")
        name, scope = found[0], found[1].scope
        if scope == "admin" or (scope == "worker" and rpc in WORKER_RPCS):
            return name
        raise Forbidden(f"Admin.{rpc}: token {name!r} has scope {scope!r}, which allows only "
                        f"{', '.join(sorted(WORKER_RPCS))}; use an admin token")


class ApiKeys:
    def __init__(self, keys: Iterable[ApiKey]):
        self._keys = [(entry, entry.key.encode()) for entry in keys]

    def check(self, metadata) -> ApiKey | None:
        """The key the call presents (None when the gateway needs none); raises Unauthenticated."""
        if not self._keys:
            return None
        key = bearer(metadata)
        if key is None:
            raise Unauthenticated("Generate needs an API key: metadata `authorization: Bearer <key>`")
        presented = key.encode()
        found = None
        for entry, secret in self._keys:  # every entry, matched or not: the time tells nothing
            if hmac.compare_digest(secret, presented):
                found = entry
        if found is None:
            raise Unauthenticated("Generate: the API key is not one this gateway accepts")
        return found

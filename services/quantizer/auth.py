"""Caller tokens of the Quantizer service (QSERVE_QUANTIZER_TOKENS), checked per call as the gateway checks its
admin tokens: the scope depends on the rpc, and the token's name is the actor Publish and CancelJob record.
Health and reflection are other services: they stay open (container health checks)."""

from __future__ import annotations

from collections.abc import Mapping

from services.quantizer.config import TOKENS_ENV, QuantizerToken
from services.quantizer.errors import Forbidden, Unauthenticated
from shared.rpc.bearer import bearer, find_token

WRITE_RPCS = frozenset({"Publish", "CancelJob"})  # scope "publish" only; "read" may call every other rpc


class QuantizerAuth:
    def __init__(self, tokens: Mapping[str, QuantizerToken]):
        self._tokens = dict(tokens)

    @property
    def enabled(self) -> bool:
        return bool(self._tokens)

    def caller(self, metadata, rpc: str) -> str | None:
        """The token's name when it may call `rpc`; None when no tokens are configured (every caller is
        accepted); raises Unauthenticated or Forbidden otherwise."""
        if not self._tokens:
            return None
        token = bearer(metadata)
        if token is None:
            raise Unauthenticated(f"Quantizer.{rpc} needs metadata `authorization: Bearer <token>` with one of "
                                  f"this quantizer's tokens ({TOKENS_ENV})")
        found = find_token(token, self._tokens)
        if found is None:
            raise Unauthenticated(f"Quantizer.{rpc}: the bearer token is not one this quantizer knows (its "
                                  f"{TOKENS_ENV})")
        name, entry = found
        if entry.scope == "publish" or rpc not in WRITE_RPCS:
            return name
        raise Forbidden(f"Quantizer.{rpc}: token {name!r} has scope {entry.scope!r}, which allows only the read-only "
                        f"rpcs; {' and '.join(sorted(WRITE_RPCS))} need a token of scope 'publish'")

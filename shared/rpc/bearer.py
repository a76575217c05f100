"""Bearer tokens in gRPC metadata: the `authorization: Bearer <token>` header a caller sends, the
constant-time lookup of a presented token among configured ones, and the `name=token:scope,...` setting
that configures them. Used by the gateway (QSERVE_ADMIN_TOKENS) and the quantizer (QSERVE_QUANTIZER_TOKENS)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

_SCHEME = "bearer "


def bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` header; None when absent or malformed."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str) and value[:len(_SCHEME)].lower() == _SCHEME:
            return value[len(_SCHEME):].strip() or None
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries `token`; none for an empty token."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def find_token(presented: str, tokens: Mapping[str, ScopedToken]) -> tuple[str, ScopedToken] | None:
    """(name, entry) of the configured token equal to `presented`; None when none is. Every entry is
    compared (constant time, hmac.compare_digest) so the reply time does not reveal a near match."""
    found = None
    for name, entry in tokens.items():
        if hmac.compare_digest(entry.token.encode(), presented.encode()) and found is None:
            found = (name, entry)
    return found


@dataclass(frozen=True, slots=True)
class ScopedToken:
    token: str = field(repr=False)  # never in a repr or a log line
    scope: str  # what the token's holder may call; each service defines its scopes


def parse_scoped_tokens(text: str, what: str, scopes: Sequence[str], error: type[Exception]) -> dict[str, ScopedToken]:
    """`name=token:scope,...` -> {name: ScopedToken}. Errors (`error`) start with `what` (e.g. "admin token")
    and name the entry that does not parse, never its token."""
    tokens: dict[str, ScopedToken] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, eq, rest = entry.partition("=")
        token, colon, scope = rest.rpartition(":")
        name, token, scope = name.strip(), token.strip(), scope.strip()
        if not eq or not colon or not name or not token:
            # Never the token: without a ':' what rpartition calls the scope is the token itself.
            shown = (f"{name}=...:{scope}" if colon else f"{name}=...") if eq else "(no '=')"
            raise error(f"{what} entry {shown} is not name=token:scope (scope one of {', '.join(scopes)})")
        if name in tokens:
            raise error(f"{what} name {name!r} appears twice")
        tokens[name] = ScopedToken(token=token, scope=scope)
    return tokens


def check_scoped_tokens(tokens: Mapping[str, ScopedToken], what: str, scopes: Sequence[str], error: type[Exception],
                        max_name: int | None = None) -> None:
    """Raises `error` for an empty name or token, a name over max_name characters, an unknown scope, or one
    token under two names (a call could not be told apart, nor its actor recorded)."""
    seen: set[str] = set()
    for name, entry in tokens.items():
        if not name or not entry.token:
            raise error(f"{what} {name!r}: both a name and a non-empty token are required")
        if max_name is not None and len(name) > max_name:
            raise error(f"{what} name {name[:20]!r}... has {len(name)} characters; at most {max_name} are accepted")
        if entry.scope not in scopes:
            raise error(f"{what} {name!r} has scope {entry.scope!r}; accepted scopes: {', '.join(scopes)}")
        if entry.token in seen:
            raise error(f"{what} {name!r} reuses another name's token; every name needs its own")
        seen.add(entry.token)

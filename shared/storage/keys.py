"""Object keys: '/'-separated relative paths, the same rules for every store.

The rules are those of the strictest store (a local folder), so a key that works on one store
works on all of them: no leading '/', no backslash, no empty, '.' or '..' segment.
"""

from __future__ import annotations

from .errors import InvalidKey

STAGING_ROOT = "_staging/"
# Where a publish claims its final prefix (claims.py): `_claims/<prefix>/claim-<generation>`.
CLAIMS_ROOT = "_claims/"


def _bad_segments(text: str) -> list[str]:
    return [seg for seg in text.split("/") if seg in ("", ".", "..")]


def check_key(key: str) -> str:
    """Return key unchanged if it is a valid object key, else raise InvalidKey naming it."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"object key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(
            f"object key {key!r} is not accepted: use a relative '/'-separated path "
            "without a leading '/', backslashes or NUL"
        )
    if _bad_segments(key):
        raise InvalidKey(
            f"object key {key!r} is not accepted: empty, '.' and '..' path segments are not "
            "allowed (keys must stay inside the store)"
        )
    return key


def check_prefix(prefix: str) -> str:
    """Return prefix unchanged if valid. '' means the whole store; a trailing '/' is allowed."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def folder_prefix(prefix: str) -> str:
    """The prefix as a folder: '' stays '', 'a/b' and 'a/b/' both become 'a/b/'."""
    check_prefix(prefix)
    return prefix if prefix == "" or prefix.endswith("/") else prefix + "/"

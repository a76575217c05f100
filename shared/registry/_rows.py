"""Helpers the repository modules share: ids, argument checks, race-safe insert, locked reads."""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.registry.errors import InvalidValue

T = TypeVar("T")

# Names that become object-store key segments (`<model>/<model_version>/<format>/<gpu>/...`).
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# The largest value of an INTEGER column on PostgreSQL (SQLite would store more, PostgreSQL refuses it).
MAX_INT = 2**31 - 1


def new_id() -> str:
    return uuid.uuid4().hex


def check_segment(what: str, value: object, max_len: int = 128) -> str:
    """`max_len` is the length of the column the value goes to: checked here, because PostgreSQL
    refuses a longer value with a DataError while SQLite stores it."""
    if not isinstance(value, str) or len(value) > max_len or not _SEGMENT.fullmatch(value):
        raise InvalidValue(
            f"{what} {value!r} is not accepted: use 1 to {max_len} characters from letters, digits, '.', '_' "
            f"and '-', starting with a letter or digit (it becomes a segment of the object-store key)"
        )
    return value


def check_key(what: str, value: object, of: type = str) -> object:
    """An id or name to look a row up by. A value of another type would reach SQL and fail there on
    PostgreSQL (`character varying = integer`), or be read as a missing row."""
    if isinstance(value, bool) or not isinstance(value, of):
        raise InvalidValue(f"{what} {value!r} is not accepted: use a {of.__name__}")
    check_no_nul(what, value)
    return value


def check_text(what: str, value: object, max_len: int) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > max_len:
        raise InvalidValue(f"{what} {value!r} is not accepted: use a non-empty string of at most {max_len} characters")
    check_no_nul(what, value)
    return value


def check_no_nul(what: str, value: object) -> None:
    """PostgreSQL refuses text holding a NUL character (a DataError, where SQLite stores it): refused here, the
    same on both, before a job has done its work only to fail recording it."""
    if isinstance(value, str) and "\x00" in value:
        raise InvalidValue(f"{what} {value!r} is not accepted: it holds a NUL character")


def check_sha256(what: str, value: object) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise InvalidValue(f"{what} {value!r} is not accepted: use 64 lowercase hex digits (a sha256 hex digest)")
    return value


def check_perplexity(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1.0:
        raise InvalidValue(f"{what} {value!r} is not accepted: a perplexity is a finite number >= 1")
    return float(value)


def check_canary_percent(value: object) -> int:
    # 0 is what a deployment without a canary carries; a canary at 0 % would be a rollout that
    # serves nothing yet blocks another one (gateway.proto: canary_percent 1..100).
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise InvalidValue(f"canary percent {value!r} is not accepted: use an integer from 1 to 100")
    return value


def insert_or_get(session: Session, row: T, find: Callable[[], T | None]) -> tuple[T, bool]:
    """Inserts `row` unless `find()` already sees its twin; returns (row, created).

    Race-safe through the table's unique constraint: when a concurrent transaction inserts the twin
    first, our INSERT fails inside a savepoint (on PostgreSQL it waits for the other transaction to
    commit), the savepoint is rolled back and the committed twin is returned instead."""
    existing = find()
    if existing is not None:
        return existing, False
    try:
        with session.begin_nested():
            session.add(row)
    except IntegrityError:
        existing = find()
        if existing is None:  # some other constraint failed: not a lost race
            raise
        return existing, False
    return row, True


def locked(session: Session, stmt: sa.Select[tuple[T]], of: type[T]) -> T | None:
    """One row read under FOR UPDATE (PostgreSQL; SQLite transactions already hold the write lock),
    refreshing any stale copy in the session's identity map."""
    stmt = stmt.with_for_update(of=of).execution_options(populate_existing=True)
    return session.scalars(stmt).unique().one_or_none()

"""One writer at a time per artifact prefix: a claim object that only one attempt can create.

An orphaned quantizer job (cut off from its registry, still running) and its retry can publish the same
artifact at once. Each saw the prefix empty, both moved their files in (a mixed artifact), and the one that
failed deleted, cleaning up, what the other had published. Now a publish (and a clearing of the prefix)
first creates `_claims/<prefix>` with a conditional write (S3's If-None-Match: *, a hard link on a folder):
one attempt holds it, the other is refused with PublishInProgress. The holder rewrites the claim every
CLAIM_REFRESH_S while it works (a thread of its own: a long upload, hashing or copy writes nothing else for
minutes), learns there if it was taken over (PrefixClaim.lost, checked before each move), and deletes it
when done.

A claim not rewritten for CLAIM_STALE_AFTER_S belongs to a writer that is gone (killed mid-publish): it is
taken over. That is shorter than a quantizer's orphan_after_s (60 s), so the sweep that fails a killed
quantizer's job finds its claim stale and deletes what it left. One this process left (its release failed
with the store) is taken over at once. An S3-compatible server that ignores If-None-Match lets two claims
through: no worse than without them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ObjectNotFound, PublishInProgress, StorageError
from .keys import CLAIMS_ROOT, folder_prefix

if TYPE_CHECKING:
    from .base import ObjectStore

CLAIM_REFRESH_S = 10.0
CLAIM_STALE_AFTER_S = 45.0

log = logging.getLogger(__name__)

# This process, in claims: host and pid name a process for people, not for this check (two containers on one
# node's network namespace both run as pid 1 on the same host name). A forked child is another process.
_process = uuid.uuid4().hex
os.register_at_fork(after_in_child=lambda: globals().update(_process=uuid.uuid4().hex))
# The attempts of this process that hold (or are taking) a claim now: a claim of this process that is not
# among them was left behind by a publish that ended (its release failed with the store), so it is no one's.
_held_here: set[str] = set()


@dataclass(eq=False)
class PrefixClaim:
    key: str  # CLAIMS_ROOT + the prefix without its trailing '/'
    attempt: str  # the holder's staging attempt ('<millis>-<id>'), or a clearing's own id
    prefix: str
    lost: bool = False  # set by the refresher once the claim is found taken over (or gone)
    _done: threading.Event = field(default_factory=threading.Event)
    # Held by the refresher while it checks and rewrites the claim: released meanwhile, a late rewrite
    # would bring the deleted claim back.
    _writing: threading.Lock = field(default_factory=threading.Lock)


def claim_key(prefix: str) -> str:
    return CLAIMS_ROOT + folder_prefix(prefix).rstrip("/")


def claim_prefix(store: ObjectStore, prefix: str, attempt: str) -> PrefixClaim:
    """Claims prefix for attempt, and keeps it fresh until release(); PublishInProgress while another
    attempt holds it."""
    claim = PrefixClaim(claim_key(prefix), attempt, folder_prefix(prefix))
    _held_here.add(attempt)  # before it exists: another thread of ours must not take it for one left behind
    try:
        _take(store, claim)
    except BaseException:
        _held_here.discard(attempt)
        raise
    threading.Thread(target=_refresh, args=(store, claim), name=f"claim-{attempt}", daemon=True).start()
    return claim


def release(store: ObjectStore, claim: PrefixClaim) -> None:
    """Stops refreshing and deletes the claim if it is still this attempt's; a claim taken over is the new
    holder's to delete. A store failing here leaves it (logged): the error that ends the publish matters more,
    and the claim is taken over once stale (by this process at once)."""
    with claim._writing:
        claim._done.set()
    try:
        if holds(store, claim):
            store.delete(claim.key)
        else:
            log.warning("the claim %s of attempt %s was taken over meanwhile; left to its holder", claim.key,
                        claim.attempt)
    except StorageError as exc:
        log.warning("could not release the claim %s (taken over once stale): %s", claim.key, exc)
    finally:
        _held_here.discard(claim.attempt)


def holds(store: ObjectStore, claim: PrefixClaim) -> bool:
    """Whether claim is still its attempt's (not taken over as stale)."""
    return _attempt_of(_holder(store, claim.key)) == claim.attempt


def delete_stale(store: ObjectStore, older_than_s: float) -> int:
    """Deletes the claims not rewritten for older_than_s (at least CLAIM_STALE_AFTER_S): their writer is gone.
    Each is looked at again just before its deletion: one taken over since the listing is fresh. Returns how many."""
    cutoff = time.time() - max(older_than_s, CLAIM_STALE_AFTER_S)
    deleted = 0
    for info in store.list(CLAIMS_ROOT):
        written = _written(store, info.key) if (info.modified or 0.0) <= cutoff else None
        if written is not None and written <= cutoff:
            store.delete(info.key)
            deleted += 1
    return deleted


def _take(store: ObjectStore, claim: PrefixClaim) -> None:
    for _ in range(3):  # a holder may release, or another taker break, between our reads
        if store.create_bytes(_body(claim), claim.key):
            return
        holder, written = _holder(store, claim.key), _written(store, claim.key)
        if holder is None or written is None:
            continue  # released meanwhile
        if holder.get("attempt") == claim.attempt and holder.get("process") == _process:
            return  # ours: the write went through, its reply was lost and the retried request refused
        idle = time.time() - written
        if idle < CLAIM_STALE_AFTER_S and not _left_here(holder):
            raise PublishInProgress(
                f"cannot write {store.uri(claim.prefix)}: another publish (attempt {holder.get('attempt')!r} on "
                f"{holder.get('host')}, pid {holder.get('pid')}) holds it, its claim rewritten {idle:.0f} s ago; "
                f"a claim not rewritten for {CLAIM_STALE_AFTER_S:.0f} s is taken over (retry then)"
            )
        log.warning("taking over %s: its publish (attempt %r on %s) left it %.0f s ago", claim.key,
                    holder.get("attempt"), holder.get("host"), idle)
        store.delete(claim.key)
    raise PublishInProgress(f"cannot write {store.uri(claim.prefix)}: its claim {claim.key} keeps changing hands")


def _refresh(store: ObjectStore, claim: PrefixClaim) -> None:
    """Rewrites the claim every CLAIM_REFRESH_S until released; marks it lost once another attempt has it."""
    while not claim._done.wait(CLAIM_REFRESH_S):
        with claim._writing:
            if claim._done.is_set():
                return
            try:
                if not holds(store, claim):
                    claim.lost = True
                    log.warning("the claim %s of attempt %s was taken over", claim.key, claim.attempt)
                    return
                store.put_bytes(_body(claim), claim.key)
            except Exception as exc:  # a store failing for a while: the next round tries again
                log.warning("could not refresh the claim %s: %s", claim.key, exc)


def _body(claim: PrefixClaim) -> bytes:
    return json.dumps({"attempt": claim.attempt, "process": _process, "host": socket.gethostname(),
                       "pid": os.getpid(), "at": time.time()}).encode()


def _left_here(holder: dict) -> bool:
    """Whether the claim is this process's and none of its publishes holds it (see _held_here)."""
    return holder.get("process") == _process and holder.get("attempt") not in _held_here


def _attempt_of(holder: dict | None) -> str | None:
    return None if holder is None else holder.get("attempt")


def _holder(store: ObjectStore, key: str) -> dict | None:
    """The claim's record; None once it is gone; {} where it cannot be read as one (its time alone then counts)."""
    try:
        record = json.loads(store.get_bytes(key).decode())
    except ObjectNotFound:
        return None
    except (UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _written(store: ObjectStore, key: str) -> float | None:
    """When the claim was last written, by the store's clock as listed; None once it is gone."""
    return next((info.modified or 0.0 for info in store.list(key) if info.key == key), None)

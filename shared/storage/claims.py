"""One writer at a time per artifact prefix: claims that only one attempt can hold.

An orphaned quantizer job (cut off from its registry, still running) and its retry can publish the same
artifact at once. Each saw the prefix empty, both moved their files in (a mixed artifact), and the one that
failed deleted, cleaning up, what the other had published. Now a publish (and a clearing of the prefix)
first claims the prefix, and the other attempt is refused with PublishInProgress.

A claim is an object `_claims/<prefix>/claim-<generation>` created with a conditional write (S3's
If-None-Match: *, a hard link on a folder), which only one attempt can make for a generation; the highest
generation present holds the prefix. Its holder writes `beat-<generation>` beside it every CLAIM_REFRESH_S
while it works (a thread of its own: a long upload, hashing or copy writes nothing else for minutes), learns
there if it was taken over (PrefixClaim.lost; the publish also looks before each move), and deletes both when
done. The claim object itself is written once: a late heartbeat of a holder taken over rewrites only its own
beat, never bringing back a claim.

A claim whose newest write is older than CLAIM_STALE_AFTER_S belongs to a writer that is gone (killed
mid-publish): it is taken over by creating the next generation, so of two attempts taking over at once only
one gets it. That is shorter than a quantizer's orphan_after_s (60 s), so the sweep that fails a killed
quantizer's job finds its claim stale and deletes what it left. One this process left (its release failed
with the store) is taken over at once. An attempt that made its claim but then finds another it had not seen
(a first claim made while it took over one that was released meanwhile) gives its own up: at most one holds.
An S3-compatible server that ignores If-None-Match lets two claims of one generation through: no worse than
without claims.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ObjectNotFound, PublishInProgress, StorageError
from .keys import CLAIMS_ROOT, folder_prefix

if TYPE_CHECKING:
    from .base import ObjectInfo, ObjectStore

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

_NAME = re.compile(r"(claim|beat)-(\d{12})")


@dataclass(eq=False)
class PrefixClaim:
    attempt: str  # the holder's staging attempt ('<millis>-<id>'), or a clearing's own id
    prefix: str
    generation: int = 0  # set once claimed
    lost: bool = False  # set by the refresher once the claim is found taken over (or gone)
    _done: threading.Event = field(default_factory=threading.Event)
    # Held by the refresher while it checks and writes the heartbeat: released meanwhile, a late write would
    # leave a heartbeat behind the deleted claim.
    _writing: threading.Lock = field(default_factory=threading.Lock)

    @property
    def key(self) -> str:
        return claim_key(self.prefix, self.generation)


def claims_folder(prefix: str) -> str:
    return CLAIMS_ROOT + folder_prefix(prefix)


def claim_key(prefix: str, generation: int) -> str:
    return f"{claims_folder(prefix)}claim-{generation:012d}"


def beat_key(prefix: str, generation: int) -> str:
    return f"{claims_folder(prefix)}beat-{generation:012d}"


def claim_prefix(store: ObjectStore, prefix: str, attempt: str) -> PrefixClaim:
    """Claims prefix for attempt, and keeps it fresh until release(); PublishInProgress while another
    attempt holds it."""
    claim = PrefixClaim(attempt, folder_prefix(prefix))
    _held_here.add(attempt)  # before it exists: another thread of ours must not take it for one left behind
    try:
        _take(store, claim)
    except BaseException:
        _held_here.discard(attempt)
        raise
    threading.Thread(target=_refresh, args=(store, claim), name=f"claim-{attempt}", daemon=True).start()
    return claim


def release(store: ObjectStore, claim: PrefixClaim) -> None:
    """Stops refreshing and deletes the claim and its heartbeat (its generation is this attempt's alone, held or
    taken over). A store failing here leaves them (logged): the error that ends the publish matters more, and
    the claim is taken over once stale (by this process at once)."""
    with claim._writing:
        claim._done.set()
    try:
        if not holds(store, claim):
            log.warning("the claim %s of attempt %s was taken over meanwhile", claim.key, claim.attempt)
        _delete_own(store, claim)
    except StorageError as exc:
        log.warning("could not release the claim %s (taken over once stale): %s", claim.key, exc)
    finally:
        _held_here.discard(claim.attempt)


def holds(store: ObjectStore, claim: PrefixClaim) -> bool:
    """Whether claim is still the highest generation of its prefix (not taken over as stale, nor purged), and
    that generation is still its own: once every claim of a prefix is gone, generations start again at 1, and a
    holder paused while it was taken over (and the taker finished) would find a newcomer's first generation to
    be its number."""
    if max(_claims_of(store, claim.prefix), default=None) != claim.generation:
        return False
    holder = _holder(store, claim.key)
    return holder is not None and holder.get("attempt") == claim.attempt and holder.get("process") == _process


def delete_stale(store: ObjectStore, older_than_s: float) -> int:
    """Deletes the claims (and heartbeats) not written for older_than_s (at least CLAIM_STALE_AFTER_S): their
    writer is gone. Each prefix's are listed again just before deletion: one written since is fresh. Returns how
    many objects were deleted."""
    cutoff = time.time() - max(older_than_s, CLAIM_STALE_AFTER_S)
    deleted = 0
    folders = {info.key.rpartition("/")[0] + "/" for info in store.list(CLAIMS_ROOT)
               if (info.modified or 0.0) <= cutoff}
    for folder in sorted(folders):
        listed = [info for info in store.list(folder) if "/" not in info.key[len(folder):]]
        newest = _newest_writes(listed, folder)
        for info in listed:
            match = _NAME.fullmatch(info.key[len(folder):])
            # A claim counts with its heartbeat; a heartbeat without its claim, or an object of another name
            # (a claim as earlier versions wrote it), by its own time.
            written = newest.get(int(match.group(2)), 0.0) if match and match.group(1) == "claim" else None
            if max(written or 0.0, info.modified or 0.0) <= cutoff:
                store.delete(info.key)
                deleted += 1
    return deleted


def _take(store: ObjectStore, claim: PrefixClaim) -> None:
    for _ in range(3):  # a holder may release, or another taker get there, between our reads
        seen = _claims_of(store, claim.prefix)
        if seen:
            top = max(seen)
            holder = _holder(store, claim_key(claim.prefix, top))
            if holder is None:
                continue  # released meanwhile
            idle = time.time() - seen[top]
            if idle < CLAIM_STALE_AFTER_S and not _left_here(holder):
                raise PublishInProgress(
                    f"cannot write {store.uri(claim.prefix)}: another publish (attempt {holder.get('attempt')!r} "
                    f"on {holder.get('host')}, pid {holder.get('pid')}) holds it, its claim last written {idle:.0f} "
                    f"s ago; a claim not written for {CLAIM_STALE_AFTER_S:.0f} s is taken over (retry then)"
                )
        claim.generation = max(seen, default=0) + 1
        if not _create(store, claim):
            continue  # another attempt made this generation first: look again
        # Ours only if nothing was claimed or written beside it since it looked: a claim it had not seen (or one
        # of a generation it saw, made again) is another attempt's that found the prefix free, the claim taken
        # over having been released meanwhile. Then it gives its own up; the next round sees who holds it.
        others = {generation: written for generation, written in _claims_of(store, claim.prefix).items()
                  if generation != claim.generation}
        if max(others, default=0) < claim.generation and all(seen.get(g) == w for g, w in others.items()):
            if seen:
                log.warning("took over the claim on %s: its publish (attempt %r on %s) left it %.0f s ago",
                            store.uri(claim.prefix), holder.get("attempt"), holder.get("host"), idle)
                _delete_taken_over(store, claim.prefix, set(seen))
            return
        _delete_own(store, claim)
    raise PublishInProgress(f"cannot write {store.uri(claim.prefix)}: its claim keeps changing hands")


def _create(store: ObjectStore, claim: PrefixClaim) -> bool:
    """Creates claim's generation; whether it is this attempt's (a write that landed unanswered, its retry
    refused, is ours too)."""
    if store.create_bytes(_body(claim), claim.key):
        return True
    holder = _holder(store, claim.key)
    return holder is not None and holder.get("attempt") == claim.attempt and holder.get("process") == _process


def _refresh(store: ObjectStore, claim: PrefixClaim) -> None:
    """Writes the claim's heartbeat every CLAIM_REFRESH_S until released; marks it lost once another attempt
    holds the prefix."""
    while not claim._done.wait(CLAIM_REFRESH_S):
        with claim._writing:
            if claim._done.is_set():
                return
            try:
                if not holds(store, claim):
                    claim.lost = True
                    log.warning("the claim %s of attempt %s was taken over", claim.key, claim.attempt)
                    return
                store.put_bytes(b"", beat_key(claim.prefix, claim.generation))
            except Exception as exc:  # a store failing for a while: the next round tries again
                log.warning("could not refresh the claim %s: %s", claim.key, exc)


def _delete_taken_over(store: ObjectStore, prefix: str, generations: set[int]) -> None:
    """Deletes the claims taken over, with their heartbeats; a store failing here leaves them (they hold nothing
    now, a higher generation does) to the purge of stale claims."""
    try:
        for generation in sorted(generations):
            store.delete(claim_key(prefix, generation))
            store.delete(beat_key(prefix, generation))
    except StorageError as exc:
        log.warning("could not delete the claims taken over on %s (purged once stale): %s", store.uri(prefix), exc)


def _delete_own(store: ObjectStore, claim: PrefixClaim) -> None:
    store.delete(beat_key(claim.prefix, claim.generation))
    store.delete(claim.key)


def _claims_of(store: ObjectStore, prefix: str) -> dict[int, float]:
    """The claims of prefix (not those of longer prefixes inside it): generation -> newest write."""
    folder = claims_folder(prefix)
    return _newest_writes([info for info in store.list(folder) if "/" not in info.key[len(folder):]], folder)


def _newest_writes(listed: list[ObjectInfo], folder: str) -> dict[int, float]:
    """Each claim listed in folder, by generation, and its newest write (its own or its heartbeat's), by the
    store's clock."""
    claimed: dict[int, float] = {}
    beats: dict[int, float] = {}
    for info in listed:
        match = _NAME.fullmatch(info.key[len(folder):])
        if match:
            kind, generation = match.group(1), int(match.group(2))
            (claimed if kind == "claim" else beats)[generation] = info.modified or 0.0
    return {generation: max(written, beats.get(generation, 0.0)) for generation, written in claimed.items()}


def _body(claim: PrefixClaim) -> bytes:
    return json.dumps({"attempt": claim.attempt, "process": _process, "host": socket.gethostname(),
                       "pid": os.getpid(), "at": time.time()}).encode()


def _left_here(holder: dict) -> bool:
    """Whether the claim is this process's and none of its publishes holds it (see _held_here)."""
    return holder.get("process") == _process and holder.get("attempt") not in _held_here


def _holder(store: ObjectStore, key: str) -> dict | None:
    """The claim's record; None once it is gone; {} where it cannot be read as one (its time alone then counts)."""
    try:
        record = json.loads(store.get_bytes(key).decode())
    except ObjectNotFound:
        return None
    except (UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}

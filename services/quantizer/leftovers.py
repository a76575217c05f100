"""Deleting what jobs left in the object store: under an artifact that ended FAILED, and in staging.

Two jobs leave objects there: a quantizer killed while its publish moved objects into the artifact's prefix
(its job is failed as an orphan by another quantizer), and an orphan that was only cut off from the registry
and, still running, finished its publish after the orphan sweep (its register then fails: it lost the job).
Nothing else would ever delete them (gigabytes, and a manifest a worker without a registry finds them by).

Not under a registry lock: a store slow to delete (botocore's retries, a large prefix) held the artifact's
row lock, and on SQLite the whole registry's write lock, for as long; heartbeats and claims timed out and
healthy jobs failed. Under the prefix's claim in the store instead (shared/storage/claims.py): a retry of
the artifact writes there only holding that claim, and the artifact is read again once it is held.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shared.registry import ArtifactState, get_artifact, prefix_served_by_another
from shared.storage import ObjectStore, PublishInProgress, StorageError

if TYPE_CHECKING:
    from services.quantizer.pipeline import Services

log = logging.getLogger(__name__)

STAGING_MAX_AGE_S = 3600.0  # a staging attempt this old that wrote nothing for as long belongs to a dead publish
PURGE_INTERVAL_S = 600.0  # how often a running quantizer purges stale staging (besides at its start)


def purge_stale_staging(store: ObjectStore) -> None:
    """What publishes killed mid-upload left in staging (and their claims). At start-up, and every
    PURGE_INTERVAL_S while running: a quantizer restarted at once found them too young, and left them until
    its next start an hour later at least, which may never come."""
    try:
        removed = store.purge_staging(STAGING_MAX_AGE_S)
    except StorageError as exc:
        log.warning("could not purge stale staging objects: %s", exc)
        return
    if removed:
        log.info("removed %d stale staging objects", removed)


def delete_leftover_objects(services: Services, artifact_id: str, left_by: str) -> int | None:
    """Deletes the objects under the artifact's prefix while it is FAILED and no READY artifact reuses them;
    returns how many, or None when they could not be looked at yet (the prefix's claim is held, by a publish
    alive or one killed less than claims.CLAIM_STALE_AFTER_S ago; the store or registry failing): try later."""

    def failed_prefix() -> str | None:
        """Its object prefix while it is FAILED and no READY artifact reuses the objects there; else None."""
        with services.registry.sessions() as session:
            artifact = get_artifact(session, artifact_id)
            if artifact.state == ArtifactState.FAILED and not prefix_served_by_another(session, artifact):
                return artifact.object_prefix
            return None

    try:
        prefix = failed_prefix()
        if prefix is None:
            return 0  # retried (its job clears the prefix first), or someone's objects
        removed = services.store.clear_prefix(prefix, only_if=lambda: failed_prefix() is not None)
    except PublishInProgress as exc:
        log.info("left the objects of artifact %s alone for now: %s", artifact_id, exc)
        return None
    except Exception as exc:
        log.warning("could not delete what %s left in the store under artifact %s: %s", left_by, artifact_id, exc)
        return None
    if removed:
        log.warning("deleted %d object(s) that %s left under %s", removed, left_by, services.store.uri(prefix))
    return removed

"""One publisher per artifact prefix (shared/storage/claims.py), on both stores.

An orphaned quantizer job still publishing and its retry wrote one prefix at once: both saw it empty, both
moved their files in, and a failing one's cleanup deleted the other's objects.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from shared.storage import PublishInProgress, StorageError
from shared.storage import claims
from shared.storage.claims import claim_key

FINAL = "llama/v1/w4a8kv4-g128/sm90/art-1/"


def _keys(store, prefix=""):
    return {info.key for info in store.list(prefix)}


def _claim_of_another_process(store, attempt="1-dead", generation=1, **fields):
    """A claim as another quantizer writes it (one killed since, or one alive elsewhere)."""
    record = {"attempt": attempt, "process": "another", "host": "elsewhere", "pid": 7, "at": time.time(), **fields}
    store.put_bytes(json.dumps(record).encode(), claim_key(FINAL, generation))


def test_a_second_publish_while_one_writes_is_refused_and_the_first_lands_whole(store, artifact_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text('{"schema": 1, "format": "other"}')
    (other / "extra.bin").write_bytes(b"x" * 1000)
    refusals = []

    def publish_the_other_meanwhile(_info):
        if not refusals:
            with pytest.raises(PublishInProgress, match="another publish .* holds it") as refused:
                store.publish_folder(other, FINAL)
            refusals.append(str(refused.value))

    published = store.publish_folder(artifact_dir, FINAL, progress=publish_the_other_meanwhile)
    assert refusals
    assert _keys(store, FINAL) == {info.key for info in published}  # only the first one's files
    assert store.get_bytes(FINAL + "manifest.json") == (artifact_dir / "manifest.json").read_bytes()
    assert not store.exists(claim_key(FINAL, 1))  # released
    assert _keys(store) == _keys(store, FINAL)  # nor staging left by either


def test_clearing_a_prefix_waits_for_no_publish(store, artifact_dir):
    def clear_meanwhile(_info):
        with pytest.raises(PublishInProgress):
            store.clear_prefix(FINAL)

    published = store.publish_folder(artifact_dir, FINAL, progress=clear_meanwhile)
    assert store.clear_prefix(FINAL, only_if=lambda: False) == 0
    assert store.clear_prefix(FINAL) == len(published)
    assert _keys(store) == set()


def test_a_long_publish_keeps_its_claim_fresh(store, artifact_dir, monkeypatch):
    """Judged by the writes it made, a live publish hashing, uploading or copying one large file for longer
    than the staleness bound had its claim taken over."""
    # Stores keep times to the second: a claim rewritten every 0.2 s reads up to ~1.2 s old, against a bound of 3.
    monkeypatch.setattr(claims, "CLAIM_REFRESH_S", 0.2)
    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 3.0)
    refusals = []

    def a_long_write_then_another_publish(_info):
        if not refusals:
            time.sleep(4.5)
            with pytest.raises(PublishInProgress):
                claims.claim_prefix(store, FINAL, "2-other")  # another attempt: refused, the claim is fresh
            refusals.append(True)

    published = store.publish_folder(artifact_dir, FINAL, progress=a_long_write_then_another_publish)
    assert refusals and _keys(store) == {info.key for info in published}


def test_a_claim_whose_writer_is_gone_is_taken_over_once_stale(store, artifact_dir, monkeypatch):
    # Another process on this host with this pid (containers sharing a node's network, each its pid 1): not ours.
    _claim_of_another_process(store, host=socket.gethostname(), pid=os.getpid())
    with pytest.raises(PublishInProgress, match="'1-dead'.*not written for 45 s is taken over"):
        store.publish_folder(artifact_dir, FINAL)
    assert _keys(store) == {claim_key(FINAL, 1)}  # the refused publish wrote nothing

    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 0.0)
    published = store.publish_folder(artifact_dir, FINAL)
    assert _keys(store) == {info.key for info in published}


def test_purge_removes_stale_claims_only(store, monkeypatch):
    _claim_of_another_process(store)
    assert store.purge_staging(older_than_s=0) == 0  # rewritten within CLAIM_STALE_AFTER_S: alive
    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 0.0)
    assert store.purge_staging(older_than_s=3600) == 0
    assert store.purge_staging(older_than_s=0) == 1
    assert _keys(store) == set()


def test_a_publish_whose_claim_was_taken_over_stops_and_leaves_the_prefix_to_its_new_holder(store, artifact_dir):
    def taken_over(_info):
        if not store.exists(FINAL + "manifest.json"):  # once, after the first upload
            _claim_of_another_process(store, attempt="3-new", generation=2)  # found stale, taken over
            store.put_bytes(b"theirs", FINAL + "manifest.json")

    with pytest.raises(StorageError, match="was taken over"):
        store.publish_folder(artifact_dir, FINAL, progress=taken_over)
    # The new holder's claim and object stay; the stopped publish's staging is gone.
    assert _keys(store) == {claim_key(FINAL, 2), FINAL + "manifest.json"}
    assert store.get_bytes(FINAL + "manifest.json") == b"theirs"


def test_claims_are_not_a_place_to_publish(store, artifact_dir):
    with pytest.raises(StorageError, match="outside '_staging/' and '_claims/'"):
        store.publish_folder(artifact_dir, "_claims/x")


def test_create_bytes_writes_only_where_nothing_is(store):
    assert store.create_bytes(b"a", "k/one")
    assert not store.create_bytes(b"b", "k/one")
    assert store.get_bytes("k/one") == b"a"


def test_a_key_that_a_folder_store_cannot_hold_beside_another_is_an_error_not_a_claim_taken(tmp_path):
    """Keys a/b and a/b/c (claims once were named so): a folder cannot be both a file and a folder, and the
    failure read as "someone holds it", ending in "its claim keeps changing hands"."""
    from shared.storage import LocalStore

    store = LocalStore(tmp_path / "store", create=True)
    assert store.create_bytes(b"x", "_claims/team/llama")
    with pytest.raises(StorageError, match="cannot write .*_claims/team/llama/v1"):
        store.create_bytes(b"y", "_claims/team/llama/v1")
    assert store.create_bytes(b"x", "_claims/other/llama/v1")
    with pytest.raises(StorageError, match="cannot write .*_claims/other/llama"):
        store.create_bytes(b"y", "_claims/other/llama")


def test_a_claim_whose_write_landed_unanswered_is_taken_as_ours(store, monkeypatch):
    """The conditional write went through but its reply was lost; the retried request was refused (412): the
    publish was refused as if another held the prefix, naming its own attempt, and left the claim for 45 s."""
    real_create = type(store).create_bytes

    def landed_unanswered(self, data, key):
        real_create(self, data, key)
        return False

    monkeypatch.setattr(type(store), "create_bytes", landed_unanswered)
    claim = claims.claim_prefix(store, FINAL, "5-mine")
    assert claims.holds(store, claim)
    claims.release(store, claim)
    assert _keys(store) == set()


def _wait_for(condition, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_late_heartbeat_of_a_holder_taken_over_does_not_take_the_claim_back(store, monkeypatch):
    """A holder paused past the staleness bound just after its refresher found the claim still its own, and taken
    over meanwhile, rewrote its claim over the new holder's: the new holder lost it, the paused one went on."""
    monkeypatch.setattr(claims, "CLAIM_REFRESH_S", 0.05)
    real_holds, taker = claims.holds, []

    def taken_over_right_after_the_check(store_, claim):
        held = real_holds(store_, claim)
        if claim.attempt == "1-paused" and not taker and threading.current_thread().name.startswith("claim-"):
            monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 0.0)  # paused long enough to be stale
            taker.append(claims.claim_prefix(store_, FINAL, "2-taker"))
        return held

    monkeypatch.setattr(claims, "holds", taken_over_right_after_the_check)
    paused = claims.claim_prefix(store, FINAL, "1-paused")
    _wait_for(lambda: taker and (paused.lost or taker[0].lost), "neither claim was found lost")
    assert real_holds(store, taker[0]) and not real_holds(store, paused)
    assert paused.lost and not taker[0].lost
    for claim in (paused, taker[0]):
        claims.release(store, claim)
    assert _keys(store) == set()


def test_of_two_attempts_taking_over_one_stale_claim_only_one_holds_it(store, monkeypatch):
    _claim_of_another_process(store)  # its writer was killed
    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 0.0)
    real_create, other = type(store).create_bytes, []

    def the_other_gets_there_first(self, data, key):
        if not other:
            other.append(None)
            other[0] = claims.claim_prefix(self, FINAL, "2-other")
            monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 45.0)  # its claim is fresh now
        return real_create(self, data, key)

    monkeypatch.setattr(type(store), "create_bytes", the_other_gets_there_first)
    with pytest.raises(PublishInProgress, match="'2-other'"):
        claims.claim_prefix(store, FINAL, "3-late")
    assert claims.holds(store, other[0])
    claims.release(store, other[0])
    assert _keys(store) == set()


def test_a_first_claim_made_while_a_released_claim_is_taken_over_keeps_the_prefix(store, monkeypatch):
    """The claim taken over is released meanwhile and a third attempt claims the free prefix (the same first
    generation again): the attempt taking over must not also hold it, nor delete that claim as the stale one."""
    _claim_of_another_process(store, attempt="1-slow")
    time.sleep(1.1)  # stores keep times to the second: the new claim must not read as written when the old one was
    monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 0.0)
    real_create, fresh = type(store).create_bytes, []

    def released_and_claimed_again_meanwhile(self, data, key):
        if not fresh:
            fresh.append(None)
            self.delete(claim_key(FINAL, 1))  # the slow publish ends and releases its claim
            monkeypatch.setattr(claims, "CLAIM_STALE_AFTER_S", 45.0)
            fresh[0] = claims.claim_prefix(self, FINAL, "3-fresh")
        return real_create(self, data, key)

    monkeypatch.setattr(type(store), "create_bytes", released_and_claimed_again_meanwhile)
    with pytest.raises(PublishInProgress, match="'3-fresh'"):
        claims.claim_prefix(store, FINAL, "2-taker")
    assert claims.holds(store, fresh[0]) and _keys(store) == {claim_key(FINAL, 1)}
    claims.release(store, fresh[0])
    assert _keys(store) == set()


def test_claims_of_nested_prefixes_are_apart(store):
    """A claim on a/b beside one on a/b/c: neither is the other's, on a folder store too."""
    outer = claims.claim_prefix(store, "team/llama/", "1-outer")
    inner = claims.claim_prefix(store, "team/llama/v1/", "2-inner")
    assert claims.holds(store, outer) and claims.holds(store, inner)
    for claim in (outer, inner):
        claims.release(store, claim)
    assert _keys(store) == set()


def test_a_holder_taken_over_does_not_hold_a_newcomers_claim_of_its_number(store, monkeypatch):
    """Taken over while paused, the taker done and gone, the prefix claimed afresh: generations start at 1 again,
    and the paused holder of generation 1 read the newcomer's claim as its own and went on moving files."""
    paused = claims.claim_prefix(store, FINAL, "1-paused")
    paused._done.set()  # its refresher paused with it
    store.delete(claim_key(FINAL, 1))  # taken over (and the taker's claim released since)
    newcomer = claims.claim_prefix(store, FINAL, "3-new")
    assert newcomer.generation == paused.generation == 1
    assert claims.holds(store, newcomer) and not claims.holds(store, paused)
    claims.release(store, newcomer)

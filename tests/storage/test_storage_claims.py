"""One publisher per artifact prefix (shared/storage/claims.py), on both stores.

An orphaned quantizer job still publishing and its retry wrote one prefix at once: both saw it empty, both
moved their files in, and a failing one's cleanup deleted the other's objects.
"""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from shared.storage import PublishInProgress, StorageError
from shared.storage import claims
from shared.storage.claims import claim_key

FINAL = "llama/v1/w4a8kv4-g128/sm90/art-1/"


def _keys(store, prefix=""):
    return {info.key for info in store.list(prefix)}


def _claim_of_another_process(store, attempt="1-dead", **fields):
    """A claim as another quantizer writes it (one killed since, or one alive elsewhere)."""
    record = {"attempt": attempt, "process": "another", "host": "elsewhere", "pid": 7, "at": time.time(), **fields}
    store.put_bytes(json.dumps(record).encode(), claim_key(FINAL))


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
    assert not store.exists(claim_key(FINAL))  # released
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
    with pytest.raises(PublishInProgress, match="'1-dead'.*not rewritten for 45 s is taken over"):
        store.publish_folder(artifact_dir, FINAL)
    assert _keys(store) == {claim_key(FINAL)}  # the refused publish wrote nothing

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
            _claim_of_another_process(store, attempt="3-new")  # another publish found it stale and took it over
            store.put_bytes(b"theirs", FINAL + "manifest.json")

    with pytest.raises(StorageError, match="was taken over"):
        store.publish_folder(artifact_dir, FINAL, progress=taken_over)
    # The new holder's claim and object stay; the stopped publish's staging is gone.
    assert _keys(store) == {claim_key(FINAL), FINAL + "manifest.json"}
    assert store.get_bytes(FINAL + "manifest.json") == b"theirs"


def test_claims_are_not_a_place_to_publish(store, artifact_dir):
    with pytest.raises(StorageError, match="outside '_staging/' and '_claims/'"):
        store.publish_folder(artifact_dir, "_claims/x")


def test_create_bytes_writes_only_where_nothing_is(store):
    assert store.create_bytes(b"a", "k/one")
    assert not store.create_bytes(b"b", "k/one")
    assert store.get_bytes("k/one") == b"a"


def test_a_key_that_a_folder_store_cannot_hold_beside_another_is_an_error_not_a_claim_taken(tmp_path):
    """A claim on a/b beside one on a/b/c: a folder cannot be both a file and a folder, and the failure read as
    "someone holds it", ending in "its claim keeps changing hands"."""
    from shared.storage import LocalStore

    store = LocalStore(tmp_path / "store", create=True)
    assert store.create_bytes(b"x", "_claims/team/llama")
    with pytest.raises(StorageError, match="cannot write .*_claims/team/llama/v1"):
        store.create_bytes(b"y", "_claims/team/llama/v1")
    assert store.create_bytes(b"x", "_claims/other/llama/v1")
    with pytest.raises(StorageError, match="cannot write .*_claims/other/llama"):
        store.create_bytes(b"y", "_claims/other/llama")


def test_a_claim_whose_write_landed_unanswered_is_taken_as_ours(store):
    """The conditional write went through but its reply was lost; the retried request was refused (412): the
    publish was refused as if another held the prefix, naming its own attempt, and left the claim for 45 s."""
    body = claims._body(claims.PrefixClaim(claim_key(FINAL), "5-mine", FINAL))
    store.put_bytes(body, claim_key(FINAL))  # the write that landed
    claim = claims.claim_prefix(store, FINAL, "5-mine")
    claims.release(store, claim)
    assert not store.exists(claim_key(FINAL))

"""What a publisher killed mid-write leaves outside the staging objects, and purge_staging removing it."""

from __future__ import annotations

import os
import time

from shared.storage import STAGING_ROOT, LocalStore, open_store
from shared.storage.local import TMP_DIR

HOUR_S = 3600


def _start_upload(client, bucket: str, key: str) -> str:
    """A multipart upload with one part sent, as a publisher killed before completing it leaves it."""
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=b"x" * 1024)
    return upload_id


def test_purge_staging_aborts_the_unfinished_uploads_of_old_attempts(moto_endpoint, s3_config, s3_client):
    """Times are S3's, to the second: a threshold of 2 s, and a wait of 3 so that the killed upload's
    writes are older than that; the slow one sends a part after the wait."""
    config = s3_config(moto_endpoint, prefix="models")
    store = open_store(config, create=True)
    client = s3_client(moto_endpoint)
    now_ms = int(time.time() * 1000)
    old_key = f"models/{STAGING_ROOT}{now_ms - 2 * HOUR_S * 1000}-dead/weights/layer0.bin"
    live_key = f"models/{STAGING_ROOT}{now_ms}-live/weights/layer0.bin"
    slow_key = f"models/{STAGING_ROOT}{now_ms - 2 * HOUR_S * 1000}-slow/weights/layer0.bin"
    _start_upload(client, config.bucket, old_key)
    slow_id = _start_upload(client, config.bucket, slow_key)
    time.sleep(3.0)
    live_id = _start_upload(client, config.bucket, live_key)
    # started two hours ago, one large file still going up: its latest part is recent
    client.upload_part(Bucket=config.bucket, Key=slow_key, UploadId=slow_id, PartNumber=2, Body=b"x" * 1024)
    # The killed attempt completed no object: only its multipart upload says it was ever there.
    assert store.list(STAGING_ROOT) == []

    assert store.purge_staging(older_than_s=2) == 1

    left = client.list_multipart_uploads(Bucket=config.bucket).get("Uploads", [])
    assert sorted((u["Key"], u["UploadId"]) for u in left) == sorted([(live_key, live_id), (slow_key, slow_id)])


def test_purge_staging_removes_old_partial_writes_of_a_local_store(tmp_path):
    store = LocalStore(tmp_path / "store", create=True)
    killed, writing = store.root / TMP_DIR / "killed-mid-copy", store.root / TMP_DIR / "being-written"
    killed.write_bytes(b"half a shard")
    writing.write_bytes(b"a shard on its way")
    two_hours_ago = time.time() - 2 * HOUR_S
    os.utime(killed, (two_hours_ago, two_hours_ago))

    assert store.purge_staging(older_than_s=HOUR_S) == 1

    assert not killed.exists()
    assert writing.exists()


def test_a_download_removes_the_folders_that_abandoned_downloads_left_beside_it(tmp_path):
    """A worker killed mid-download left its hidden `.<id>.download-*` folder (gigabytes) in the cache for
    good. The next download into that cache removes the ones untouched for an hour, never one in progress."""
    store = LocalStore(tmp_path / "store", create=True)
    source = tmp_path / "src"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"w" * 100)
    store.put_file(source / "weights.bin", "art/weights.bin")
    cache = tmp_path / "cache"
    abandoned, in_progress = cache / ".old.download-ab12", cache / ".new.download-cd34"
    writer_staging = cache / ".other.partial-ef56"  # an artifact writer's: never the downloader's to remove
    for folder in (abandoned, in_progress, writer_staging):
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "shard.bin").write_bytes(b"x" * 10)
    two_hours_ago = time.time() - 7200
    for path in (abandoned / "sub" / "shard.bin", abandoned / "sub", abandoned):
        os.utime(path, (two_hours_ago, two_hours_ago))
    os.utime(in_progress, (two_hours_ago, two_hours_ago))  # an old folder whose file is still being written
    for path in (writer_staging / "sub" / "shard.bin", writer_staging / "sub", writer_staging):
        os.utime(path, (two_hours_ago, two_hours_ago))

    store.download_folder("art", cache / "art")

    assert (cache / "art" / "weights.bin").read_bytes() == b"w" * 100
    assert not abandoned.exists()
    assert (in_progress / "sub" / "shard.bin").exists()
    assert (writer_staging / "sub" / "shard.bin").exists()

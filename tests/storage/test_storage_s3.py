"""S3-only behaviour: parts, metadata, opening errors, and the server going away mid-publish."""

from __future__ import annotations

import hashlib
import os
import socket

import pytest

from shared.storage import InvalidConfig, StorageError, open_store
from shared.storage.claims import claim_key

MIB = 1024 * 1024


def test_large_files_go_up_in_parts_with_sha256_metadata(moto_endpoint, s3_config, s3_client, tmp_path):
    config = s3_config(moto_endpoint)
    store = open_store(config, create=True)
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * MIB))

    store.put_file(src, "big.bin")

    head = s3_client(moto_endpoint).head_object(Bucket=config.bucket, Key="big.bin")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of three 5 MiB parts
    assert head["Metadata"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_store_prefix_scopes_every_key(moto_endpoint, s3_config, s3_client):
    config = s3_config(moto_endpoint, prefix="team/artifacts")
    store = open_store(config, create=True)
    store.put_bytes(b"{}", "m/manifest.json")

    keys = [o["Key"] for o in s3_client(moto_endpoint).list_objects_v2(Bucket=config.bucket)["Contents"]]
    assert keys == ["team/artifacts/m/manifest.json"]
    assert [o.key for o in store.list()] == ["m/manifest.json"]
    assert store.uri("m/manifest.json") == f"s3://{config.bucket}/team/artifacts/m/manifest.json"


def test_missing_bucket_is_a_clear_error(moto_endpoint, s3_config):
    config = s3_config(moto_endpoint, bucket="no-such-bucket-here")
    with pytest.raises(StorageError, match=f"bucket 'no-such-bucket-here' does not exist at endpoint {moto_endpoint}"):
        open_store(config)


def test_unreachable_endpoint_names_the_endpoint(s3_config):
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(StorageError, match=f"cannot reach S3 endpoint {endpoint}"):
        open_store(s3_config(endpoint, max_attempts=1))


def test_download_detects_an_object_that_does_not_match_its_checksum(moto_endpoint, s3_config, s3_client, tmp_path):
    config = s3_config(moto_endpoint)
    store = open_store(config, create=True)
    store.put_bytes(b"good", "a/ok.bin")
    s3_client(moto_endpoint).put_object(
        Bucket=config.bucket, Key="a/bad.bin", Body=b"rotten", Metadata={"sha256": hashlib.sha256(b"fresh!").hexdigest()}
    )

    with pytest.raises(StorageError, match="verification of .*a/bad.bin failed.*sha256"):
        store.download_folder("a", tmp_path / "dl")
    assert list(tmp_path.iterdir()) == []  # neither the folder nor a partial one


def test_download_accepts_objects_without_recorded_checksum(moto_endpoint, s3_config, s3_client, tmp_path):
    config = s3_config(moto_endpoint)
    store = open_store(config, create=True)
    s3_client(moto_endpoint).put_object(Bucket=config.bucket, Key="ckpt/config.json", Body=b"{}")

    [got] = store.download_folder("ckpt/", tmp_path / "ckpt")
    assert got.sha256 == hashlib.sha256(b"{}").hexdigest()
    assert (tmp_path / "ckpt" / "config.json").read_bytes() == b"{}"


def test_server_stopping_mid_publish(moto_server, s3_config, artifact_dir):
    server = moto_server()
    store = open_store(s3_config(server.endpoint), create=True)
    final = "llama/v1/w4a8kv4-g128/sm90/art-1"
    staged = []

    def stop_after_first_upload(info):
        staged.append(info.key)
        server.stop()

    with pytest.raises(StorageError) as failure:
        store.publish_folder(artifact_dir, final, progress=stop_after_first_upload)

    message = str(failure.value)
    assert f"cannot reach S3 endpoint {server.endpoint}" in message
    staging_prefix = staged[0].rsplit("/", 1)[0] + "/"
    assert store.uri(staging_prefix) in message  # cleanup could not run, so the error says what may be left

    # moto's state lives in this process: the server started again holds what the stopped one held.
    moto_server(server.port)
    assert store.list(final) == []  # the final prefix never saw an object
    # The publish's claim could not be released either: this process takes it over at once (another once stale).
    assert {o.key for o in store.list()} == {*staged, claim_key(final, 1)}
    assert store.purge_staging(older_than_s=0) == len(staged)
    assert [o.key for o in store.list()] == [claim_key(final, 1)]

    published = store.publish_folder(artifact_dir, final)
    assert len(published) == 4
    assert {o.key for o in store.list()} == {o.key for o in published}


def test_create_makes_the_bucket_once_in_any_region(moto_endpoint, s3_config):
    config = s3_config(moto_endpoint, region="eu-west-1")
    open_store(config, create=True).put_bytes(b"{}", "k")
    again = open_store(config, create=True)  # the bucket exists now: opening again is fine
    assert again.get_bytes("k") == b"{}"


def test_a_client_that_cannot_be_set_up_is_a_storage_error(s3_config, monkeypatch):
    # Raised by botocore before any request: callers that handle StorageError got a raw botocore exception.
    with pytest.raises(InvalidConfig, match="cannot set up the S3 client.*region_name 'eu west 1'"):
        open_store(s3_config("http://127.0.0.1:9", region="eu west 1"))
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(InvalidConfig, match=r"cannot set up the S3 client.*profile \(no-such-profile\)"):
        open_store(s3_config("http://127.0.0.1:9"))


@pytest.mark.parametrize("endpoint, error", [
    ("http://my_host:9000", "cannot set up the S3 client for s3://.* \\(endpoint http://my_host:9000\\)"),
    ("http://[::1", "endpoint_url 'http://\\[::1' is not a URL: Invalid IPv6 URL"),
])
def test_an_endpoint_that_cannot_be_used_is_one_clear_error(s3_config, endpoint, error):
    # A ValueError (botocore's, urllib's) went past the services' error handling: a traceback at start-up (an
    # underscore in a host name is common in compose service names).
    with pytest.raises(InvalidConfig, match=error):
        open_store(s3_config(endpoint))


def test_retries_that_run_out_name_their_cause(moto_endpoint, s3_config, tmp_path, monkeypatch):
    """boto3's RetriesExceededError says "Max Retries Exceeded" alone; what failed each time is its last_exception."""
    from boto3.exceptions import RetriesExceededError

    store = open_store(s3_config(moto_endpoint), create=True)
    store.put_bytes(b"{}", "k")

    def cut(*args, **kwargs):
        raise RetriesExceededError(ConnectionResetError(104, "Connection reset by peer"))

    monkeypatch.setattr(store._client, "download_file", cut)
    with pytest.raises(StorageError, match=r"Max Retries Exceeded \(last: \[Errno 104\] Connection reset by peer\)"):
        store.get_file("k", tmp_path / "k")


def test_a_session_token_without_keys_is_ignored_as_boto3_does(moto_endpoint, s3_config, monkeypatch):
    """A stray AWS_SESSION_TOKEN beside credentials from the chain (here the environment's keys): passed on
    its own, every request failed with a TypeError."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = open_store(s3_config(moto_endpoint, access_key=None, secret_key=None, session_token="stray"), create=True)
    store.put_bytes(b"x", "k")
    assert [o.key for o in store.list()] == ["k"]


def test_a_text_file_url_is_percent_decoded_in_its_name_as_in_its_folder(moto_endpoint, s3_config, tmp_path):
    """The quantizer's --calib / eval text from S3 (services/quantizer/sources.local_file): the folder part was
    decoded and the file name not, so s3://b/my%20data/eval%20set.txt was 'does not exist'."""
    from services.quantizer.sources import local_file

    config = s3_config(moto_endpoint)
    open_store(config, create=True).put_bytes(b"text", "my data/eval set.txt")
    url = f"s3://{config.bucket}/my%20data/eval%20set.txt"
    assert local_file(url, tmp_path, config).read_bytes() == b"text"
    with pytest.raises(InvalidConfig, match="write it as %23"):
        local_file(f"s3://{config.bucket}/my%20data/eval#2.txt", tmp_path, config)

"""StorageConfig parsing and validation, and fetch_folder (how the quantizer reads s3:// checkpoints)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.storage import InvalidConfig, ObjectNotFound, StorageConfig, fetch_folder, open_store
from shared.storage.config import MIB


def test_s3_url_with_endpoint_and_region():
    config = StorageConfig.from_url("s3://artifacts/team/q?endpoint=http://127.0.0.1:9000&region=eu-west-1")
    assert (config.kind, config.bucket, config.prefix) == ("s3", "artifacts", "team/q/")
    assert (config.endpoint_url, config.region) == ("http://127.0.0.1:9000", "eu-west-1")


def test_url_fields_take_the_rest_from_base():
    base = StorageConfig(kind="s3", bucket="main-bucket", endpoint_url="http://minio:9000", access_key="ak", secret_key="sk")
    config = StorageConfig.from_url("s3://checkpoints/llama-3-8b", base=base)
    assert (config.bucket, config.prefix, config.endpoint_url) == ("checkpoints", "llama-3-8b/", "http://minio:9000")
    assert (config.access_key, config.secret_key) == ("ak", "sk")


def test_local_urls_and_paths():
    assert StorageConfig.from_url("file:///var/lib/qserve").root == Path("/var/lib/qserve")
    assert StorageConfig.from_url("/var/lib/qserve").root == Path("/var/lib/qserve")
    assert StorageConfig.from_url("relative/store").kind == "local"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("gs://bucket/x", "scheme 'gs'.*accepted: s3://"),
        ("s3://bucket/x?endpiont=http://h", "unknown parameter 'endpiont'.*accepted: endpoint, region"),
        ("s3://key:secret@bucket/x", "credentials do not belong in the URL"),
        ("s3://Bad_Bucket/x", "bucket name 'Bad_Bucket' is not valid"),
        ("s3://bucket/a/../b", "prefix 'a/../b' is not valid"),
        ("s3://bucket/x?endpoint=minio:9000", "must start with http:// or https://"),
        # urlsplit would drop '#ft': the prefix models/llama, another model's checkpoint, read without an error.
        ("s3://bucket/models/llama#ft", "holds '#': write it as %23"),
        ("file:///srv/store#2", "holds '#': write it as %23"),
        ("file:///srv/store?endpoint=http://h", "a file URL takes no parameters"),
        ("s3://bucket/x?endpoint=http://AKIAEXAMPLE:VerySecret@minio:9000", r"http\(s\)://...@minio:9000: credentials"),
    ],
)
def test_bad_urls_say_what_is_accepted(url, message):
    with pytest.raises(InvalidConfig, match=message) as refused:
        StorageConfig.from_url(url)
    assert "VerySecret" not in str(refused.value)


def test_a_plain_path_keeps_its_hash_sign():
    assert StorageConfig.from_url("/srv/store#2").root == Path("/srv/store#2")  # a file name, not a URL
    assert StorageConfig.from_url("s3://bucket/models/llama%23ft").prefix == "models/llama#ft/"


def test_settings_are_validated():
    with pytest.raises(InvalidConfig, match="kind 'gcs' is not supported; accepted: local, s3"):
        StorageConfig(kind="gcs")
    with pytest.raises(InvalidConfig, match="needs root"):
        StorageConfig(kind="local")
    with pytest.raises(InvalidConfig, match="multipart_chunk_size=1048576 is out of range"):
        StorageConfig(kind="s3", bucket="b-1", multipart_chunk_size=MIB)
    with pytest.raises(InvalidConfig, match="both access_key and secret_key"):
        StorageConfig(kind="s3", bucket="b-1", access_key="ak")


def test_secrets_stay_out_of_repr():
    config = StorageConfig(kind="s3", bucket="b-1", access_key="AKIAEXAMPLE", secret_key="very-secret")
    assert "very-secret" not in repr(config)


def test_from_env_is_explicit():
    env = {
        "QSERVE_STORE_URL": "s3://artifacts/q",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
        "AWS_ACCESS_KEY_ID": "ak",
        "AWS_SECRET_ACCESS_KEY": "sk",
    }
    config = StorageConfig.from_env(env)
    assert (config.bucket, config.endpoint_url, config.access_key, config.region) == (
        "artifacts",
        "http://127.0.0.1:9000",
        "ak",
        "us-east-1",
    )
    with pytest.raises(InvalidConfig, match="QSERVE_STORE_URL is not set"):
        StorageConfig.from_env({})


def test_fetch_folder_downloads_an_s3_checkpoint(moto_endpoint, s3_config, artifact_dir, tmp_path):
    base = s3_config(moto_endpoint, bucket="shared-credentials-only")
    source = open_store(s3_config(moto_endpoint), create=True)
    source.publish_folder(artifact_dir, "hf/tiny-llama")

    local = fetch_folder(f"s3://{source.bucket}/hf/tiny-llama", tmp_path / "ckpt", base=base)

    assert local == tmp_path / "ckpt"
    assert sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()) == [
        "manifest.json",
        "tokenizer.json",
        "weights/layer0.bin",
        "weights/layer1.bin",
    ]


def test_fetch_folder_returns_local_paths_as_they_are(artifact_dir, tmp_path):
    assert fetch_folder(artifact_dir, tmp_path / "unused") == artifact_dir
    assert fetch_folder(artifact_dir.as_uri(), tmp_path / "unused") == artifact_dir
    assert not (tmp_path / "unused").exists()
    with pytest.raises(ObjectNotFound, match="does not exist"):
        fetch_folder(tmp_path / "nothing-here", tmp_path / "unused")

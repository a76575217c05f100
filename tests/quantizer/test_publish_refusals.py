"""A refused Publish writes nothing: no job, no model, no artifact in the registry, no object in the
store; its error is one line that names the bad field."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import sqlalchemy as sa

from shared.registry import Artifact, Model, QuantJob
from shared.rpc.qserve.v1 import quantizer_pb2
from shared.storage import open_store

Q = quantizer_pb2
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def _file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"not a folder")
    return str(path)


def _bad_config(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    return str(folder)


@pytest.mark.parametrize(
    ("change", "code", "says"),
    [
        (lambda r, t: setattr(r, "format", "w2a2"), INVALID, "format 'w2a2'"),
        (lambda r, t: setattr(r, "gpu_target", "sm75"), INVALID, "gpu_target 'sm75'"),
        (lambda r, t: setattr(r, "source", str(t / "absent")), NOT_FOUND, "does not exist"),
        (lambda r, t: setattr(r, "source", _file(t)), NOT_FOUND, "source checkpoint folder"),
        (lambda r, t: setattr(r, "source", _bad_config(t)), INVALID, "config.json"),
        (lambda r, t: setattr(r.eval, "data", str(t)), NOT_FOUND, "eval.data file"),
        (lambda r, t: setattr(r.eval, "data", "s3://bucket/"), INVALID, "eval.data 's3://bucket/' names no object"),
        # The kernel's pseudo-files: /proc/self/environ (the quantizer's S3 keys and tokens) was scored as eval text.
        (lambda r, t: setattr(r.eval, "data", "/proc/self/environ"), INVALID, "is a system file"),
        (lambda r, t: setattr(r.calibration, "data", "/proc/self/../self/environ"), INVALID, "is a system file"),
        (lambda r, t: setattr(r, "source", "/sys/kernel"), INVALID, "is a system file"),
    ],
)
def test_a_refused_publish_writes_nothing(bucket_store, start_quantizer, registry_url, open_registry, small_model,
                                          request_for, tmp_path, change, code, says):
    quantizer = start_quantizer(bucket_store, registry_url)
    request = request_for(small_model)
    change(request, tmp_path)
    with pytest.raises(grpc.RpcError) as raised:
        quantizer.stub.Publish(request)
    assert raised.value.code() == code and says in raised.value.details()
    assert "\n" not in raised.value.details()
    with open_registry(registry_url).sessions() as session:
        for table in (QuantJob, Model, Artifact):
            assert session.scalar(sa.select(sa.func.count()).select_from(table)) == 0
    assert open_store(bucket_store).list() == []


def test_local_roots_bound_what_a_publish_may_read(bucket_store, start_quantizer, registry_url, small_model,
                                                   request_for, tmp_path):
    """Any file on the quantizer's host could be read as eval text (its perplexity, and whether it exists,
    answered to any publish-scope token): --local-root bounds them."""
    texts = Path(request_for(small_model).calibration.data).parent
    quantizer = start_quantizer(bucket_store, registry_url, local_roots=(small_model, texts))
    outside = tmp_path / "elsewhere" / "secret.txt"
    outside.parent.mkdir()
    outside.write_text("not for publishing\n" * 200)
    for where in (str(outside), str(tmp_path / "elsewhere" / "absent.txt"), str(small_model / ".." / ".." / "x")):
        request = request_for(small_model)
        request.eval.data = where
        with pytest.raises(grpc.RpcError) as raised:
            quantizer.stub.Publish(request)
        assert raised.value.code() == INVALID and "outside the folders" in raised.value.details(), where
    request = request_for(small_model)  # the folders it may read: accepted
    job = quantizer.stub.Publish(request)
    assert job.job_id

"""A refused Publish writes nothing: no job, no model, no artifact in the registry, no object in the
store; its error is one line that names the bad field."""

from __future__ import annotations

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

"""A checkpoint whose config.json has the keys a Llama needs but unusable values is refused at Publish
with INVALID_ARGUMENT naming the source, not an UNKNOWN status that names neither."""

from __future__ import annotations

import json

import grpc
import pytest

from tests.conftest import write_random_llama


@pytest.fixture
def quantizer(bucket_store, start_quantizer, registry_url):
    return start_quantizer(bucket_store, registry_url)


DROP = object()  # the key is removed


@pytest.mark.parametrize(
    "changes",
    [
        {"num_attention_heads": 0, "head_dim": DROP},
        {"num_attention_heads": None},
        {"hidden_size": "512"},
        {"rope_scaling": [1]},
        {"vocab_size": "4096"},  # passed Publish, failed later inside the job
        {"num_hidden_layers": 2.5},
    ],
)
def test_a_config_json_with_unusable_values_is_invalid_argument(quantizer, request_for, tmp_path, changes):
    source = write_random_llama(tmp_path / "llama")
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            del config[key]
        else:
            config[key] = value
    (source / "config.json").write_text(json.dumps(config))

    with pytest.raises(grpc.RpcError) as raised:
        quantizer.stub.Publish(request_for(source))

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith(f"source {str(source)!r}: ")
    assert "\n" not in raised.value.details()

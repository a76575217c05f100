"""Failures of one request or of the artifact that must stay contained: a text prompt whose tokens fall
outside the model's vocabulary is refused alone (not the whole batch it would have joined)."""

from __future__ import annotations

import grpc
import pytest

from shared.rpc.qserve.v1 import worker_pb2
from tests.worker.conftest import stub
from tests.worker.test_service import _idle, _request, _wait_for


def test_a_text_prompt_outside_the_vocabulary_is_refused_alone(start_worker):
    """A tokenizer that gives ids past the embedding table (added tokens the model was never resized for,
    or another model's tokenizer) made the step that held the prompt raise: every request of that batch
    ended INTERNAL, other users' streams included."""
    w = start_worker("fp16")
    channel, client = stub(w)
    vocab = w.server.served.vocab_size
    running = client.Generate(_request(ignore_eos=True), timeout=60)  # runs until cancelled: in every step
    stream = iter(running)
    next(stream)
    w.server.served.tokenizer.encode = lambda text: [5, vocab + 7]  # the id one added token would get
    with pytest.raises(grpc.RpcError) as err:
        list(client.Generate(worker_pb2.GenerateRequest(text="def main("), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"token id {vocab + 7}" in err.value.details() and "tokenizer" in err.value.details()
    for _ in range(3):  # the other stream goes on, untouched
        message = next(stream)
        assert message.token_ids and not message.HasField("finish")
    running.cancel()
    _wait_for(lambda: _idle(client), 5.0, "the cancelled request's blocks to be freed")
    channel.close()

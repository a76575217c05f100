"""A request whose bytes cannot be parsed (a string field that is not UTF-8) answers INVALID_ARGUMENT on every
method of our servers (shared/rpc/malformed.py): it was UNKNOWN "Unexpected <class DecodeError>", a status that
reads as a server fault (retried by clients, counted by alerts)."""

from __future__ import annotations

import grpc
import pytest

from shared.rpc.qserve.v1 import gateway_pb2
from tests.gateway.conftest import ADMIN, DEPLOYMENT, gateway_stack, run


def _not_utf8(message, text: str) -> bytes:
    """message serialized, with the bytes of one of its string fields (holding `text`) made invalid UTF-8."""
    data = message.SerializeToString()
    assert data.count(text.encode()) == 1
    return data.replace(text.encode(), b"\xff\xfe" + text.encode()[2:])


def test_bytes_that_are_not_a_message_answer_invalid_argument(artifacts):
    async def scenario():
        async with gateway_stack(artifacts) as stack:
            await stack.add_worker(artifacts.stable)
            stream = stack.channel.unary_stream("/qserve.v1.Gateway/Generate")
            request = gateway_pb2.GatewayGenerateRequest(deployment=DEPLOYMENT, text="hello there")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                [reply async for reply in stream(_not_utf8(request, "hello there"), metadata=ADMIN)]
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
            assert "UTF-8" in raised.value.details()

            unary = stack.channel.unary_unary("/qserve.v1.Admin/GetDeployment")
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await unary(_not_utf8(gateway_pb2.GetDeploymentRequest(deployment=DEPLOYMENT), DEPLOYMENT),
                            metadata=ADMIN)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()

            # The same methods, parsed, answer as before.
            assert [r async for r in stream(request.SerializeToString(), metadata=ADMIN)]
            assert await unary(gateway_pb2.GetDeploymentRequest(deployment=DEPLOYMENT).SerializeToString(),
                               metadata=ADMIN)

    run(scenario())

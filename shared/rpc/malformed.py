"""Requests whose bytes are not a valid message answer INVALID_ARGUMENT, not UNKNOWN.

gRPC parses a request before any handler runs, and a parse that raises (a string field holding bytes that are
not UTF-8, a truncated message) reached the client as UNKNOWN "Unexpected <class DecodeError>": a status that
reads as a server fault, which clients retry and alerts count. This interceptor gives every method a parser
that hands such bytes on as MalformedRequest, and a handler that refuses it with INVALID_ARGUMENT before the
service's own code runs. The services have no client-streaming methods; those are left as they are."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class MalformedRequest:
    reason: str


def _lenient(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def parse_or_mark(data: bytes) -> object:
        try:
            return parse(data)
        except DecodeError as exc:
            return MalformedRequest(str(exc) or "not a valid message")
    return parse_or_mark


async def _refuse(request: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request could not be parsed: {request.reason}")


def _unary(behaviour):
    async def handle(request, context):
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        return await behaviour(request, context)
    return handle


def _streaming(behaviour):
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            if isinstance(request, MalformedRequest):
                await _refuse(request, context)
            replies = behaviour(request, context)
            try:
                async for reply in replies:
                    yield reply
            finally:  # a client gone closes this one at its yield: the service's own cleanup runs now, not at GC
                await replies.aclose()
        return stream

    async def write(request, context):  # a handler that writes through context.write
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        return await behaviour(request, context)
    return write


class MalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        lenient = _lenient(handler.request_deserializer)
        if handler.response_streaming:
            return handler._replace(request_deserializer=lenient, unary_stream=_streaming(handler.unary_stream))
        return handler._replace(request_deserializer=lenient, unary_unary=_unary(handler.unary_unary))

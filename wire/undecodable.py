"""A request gRPC cannot decode is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio answers a message its deserializer cannot parse (a truncated or corrupted
protobuf) with UNKNOWN "Unexpected DecodeError", as if the server had failed. This
interceptor, on every kvhandoff server (``wire.grpc_server.start_server``), wraps each
method's deserializer: a message that does not parse becomes :class:`Undecodable`, and
the method answers INVALID_ARGUMENT saying so before any of its code runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


class Undecodable:
    """What a request that did not parse is handed on as (never to a servicer)."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # DecodeError, and anything a parser may raise
            return Undecodable(e)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, request: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request is not a well-formed message of this method "
                        f"({type(request.error).__name__}): truncated or corrupted?")


def _unary_request(behavior: Callable) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)
    return call


def _unary_request_stream_response(behavior: Callable) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext):
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        async for item in behavior(request, context):
            yield item
    return call


def _stream_request(behavior: Callable, streaming_response: bool) -> Callable:
    async def requests(iterator: Any, context: grpc.aio.ServicerContext):
        async for request in iterator:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            yield request

    if streaming_response:
        async def call_stream(iterator: Any, context: grpc.aio.ServicerContext):
            async for item in behavior(requests(iterator, context), context):
                yield item
        return call_stream

    async def call(iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(requests(iterator, context), context)
    return call


#: The services whose methods are wrapped: ours (``proto/kvhandoff``), whose streaming
#: methods yield their responses; gRPC's health and reflection pass through unchanged.
OURS = "/kvhandoff."


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """See the module docstring."""

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(OURS):
            return handler
        parse = _tolerant(handler.request_deserializer)
        out = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_request(handler.unary_unary), parse, out)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _unary_request_stream_response(handler.unary_stream), parse, out)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _stream_request(handler.stream_unary, False), parse, out)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _stream_request(handler.stream_stream, True), parse, out)
        return handler

"""The Router gRPC service: a thin servicer over :class:`~router.api.RouterAPI` (the
``grpc`` front), its messages converted by ``router.grpc_wire``. Its statuses are the
API's; a client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvhandoff.v1 import router_pb2_grpc
from router import grpc_wire as wire
from router.api import RouterAPI
from router.auth import CLIENT, OPERATOR, grpc_authorization, need_of
from router.grpc_wire import SERVICE_NAME

__all__ = ["SERVICE_NAME", "RouterServicer", "add_router_service"]

FRONT = "grpc"


def add_router_service(api: RouterAPI, server: grpc.aio.Server) -> None:
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(api), server)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Every method checks the caller (``router.auth``) before anything runs, and maps
    whatever fails (refusals, bad input, the run's errors) to a status in one place."""

    def __init__(self, api: RouterAPI):
        self.api = api

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message = self.api.failed(FRONT, exc, context.time_remaining())
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        await context.abort(code, message)

    async def _unary(self, context: grpc.aio.ServicerContext, need: str,
                     call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            self.api.authorize(grpc_authorization(context), need)
            return await call()
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def _stream(self, context: grpc.aio.ServicerContext, need: str,
                      events: Callable[[], AsyncIterator[Any]]) -> AsyncIterator[Any]:
        try:
            self.api.authorize(grpc_authorization(context), need)
            async with contextlib.aclosing(events()) as items:
                async for item in items:
                    yield item
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def _generate(self, request, context) -> AsyncIterator[Any]:
        async with contextlib.aclosing(self.api.generate(
                FRONT, wire.generate_call(request), _deadline(context))) as items:
            async for item in items:
                yield wire.event_to_pb(item)

    async def _result(self, request, context):
        async with contextlib.aclosing(self._generate(request, context)) as events:
            async for event in events:
                if event.HasField("result"):
                    return event.result
        raise AssertionError("the router produced no result")

    async def _parent(self, request, context) -> AsyncIterator[Any]:
        async with contextlib.aclosing(self.api.start_parent(
                FRONT, wire.parent_call(request), _deadline(context))) as items:
            async for item in items:
                yield wire.parent_event_to_pb(item)

    async def _continue(self, request, context):
        return wire.result_to_pb(await self.api.continue_(
            FRONT, wire.continue_call(request), _deadline(context)))

    # grpc.aio tells handlers apart by their kind: each must be a coroutine function
    # (unary) or an async generator function (streams).
    async def Generate(self, request, context):
        return await self._unary(context, need_of(request.fault),
                                 lambda: self._result(request, context))

    async def GenerateStream(self, request, context):
        async with contextlib.aclosing(self._stream(
                context, need_of(request.fault),
                lambda: self._generate(request, context))) as events:
            async for event in events:
                yield event

    async def StartParent(self, request, context):
        async with contextlib.aclosing(self._stream(
                context, CLIENT, lambda: self._parent(request, context))) as events:
            async for event in events:
                yield event

    async def Continue(self, request, context):
        return await self._unary(context, need_of(request.fault),
                                 lambda: self._continue(request, context))

    async def ReleaseParent(self, request, context):
        async def call():
            return wire.released_to_pb(await self.api.release_parent(request.parent_id))
        return await self._unary(context, OPERATOR, call)

    async def Move(self, request, context):
        async def call():
            return wire.moved_to_pb(await self.api.move(request.request_id,
                                                        request.to_endpoint))
        return await self._unary(context, OPERATOR, call)

    async def RegisterChunk(self, request, context):
        async def call():
            return wire.chunk_to_pb(await self.api.register_chunk(
                FRONT, wire.chunk_call(request), _deadline(context)))
        return await self._unary(context, need_of(request.fault), call)

    async def ListChunks(self, request, context):
        async def call():
            return wire.chunks_to_pb(await self.api.chunks())
        return await self._unary(context, OPERATOR, call)  # every chunk's tokens

    async def DeleteChunk(self, request, context):
        async def call():
            return wire.deleted_to_pb(await self.api.delete_chunk(request.chunk_id))
        return await self._unary(context, OPERATOR, call)

    async def Drain(self, request, context):
        async def call():
            return wire.drained_to_pb(await self.api.drain(
                request.endpoint, request.timeout_ms, request.undo))
        return await self._unary(context, OPERATOR, call)

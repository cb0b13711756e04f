"""The Router gRPC service: a thin servicer over :class:`~router.api.RouterAPI` (the
``grpc`` front). Its statuses are the API's; a client that goes away cancels its
request."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from kvhandoff.v1 import router_pb2_grpc
from router.api import RouterAPI
from router.auth import CLIENT, OPERATOR, grpc_authorization

FRONT = "grpc"


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _need(request) -> str:
    """A request that names a negative-control fault is an operator's call."""
    return OPERATOR if getattr(request, "fault", "") else CLIENT


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Every method checks the caller (``router.auth``) before anything runs: refusals
    are counted and answered like any other error."""

    def __init__(self, api: RouterAPI):
        self.api = api

    def _authorize(self, context: grpc.aio.ServicerContext, need: str) -> None:
        self.api.authorize(grpc_authorization(context), need)

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message = self.api.failed(FRONT, exc, context.time_remaining())
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        await context.abort(code, message)

    async def Generate(self, request, context):
        try:
            self._authorize(context, _need(request))
            async with contextlib.aclosing(
                    self.api.generate(FRONT, request, _deadline(context))) as events:
                async for event in events:
                    if event.HasField("result"):
                        return event.result
        except (Exception, asyncio.CancelledError) as e:  # mapped to a status in one place
            await self._abort(context, e)

    async def GenerateStream(self, request, context):
        try:
            self._authorize(context, _need(request))
            async with contextlib.aclosing(
                    self.api.generate(FRONT, request, _deadline(context))) as events:
                async for event in events:
                    yield event
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def StartParent(self, request, context):
        try:
            self._authorize(context, _need(request))
            async with contextlib.aclosing(
                    self.api.parent_events(FRONT, request, _deadline(context))) as events:
                async for event in events:
                    yield event
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def Continue(self, request, context):
        try:
            self._authorize(context, _need(request))
            return await self.api.continue_(FRONT, request, _deadline(context))
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def ReleaseParent(self, request, context):
        try:
            self._authorize(context, OPERATOR)
            return await self.api.release_parent(request)
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def Move(self, request, context):
        try:
            self._authorize(context, OPERATOR)
            return await self.api.move(request)
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def Drain(self, request, context):
        try:
            self._authorize(context, OPERATOR)
            return await self.api.drain(request)
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

"""The Router gRPC service (thin): requests in, ``router.core.Router`` does the work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvhandoff.errors import status_for
from kvhandoff.tls import ServerTLS
from kvhandoff.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.core import Router, RouterConfig
from router.metrics import OVERLOAD_MESSAGE, RouterMetrics
from router.plan import Outcome, RouterError, to_response
from server.grpc_common import set_serving, start_server, wait_for_shutdown_signal, watch_loop_lag

logger = logging.getLogger(__name__)


async def generate_events(router: Router, metrics: RouterMetrics,
                          request: router_pb2.GenerateRequest, deadline: float | None
                          ) -> AsyncIterator[router_pb2.GenerateStreamEvent]:
    """Stage-1 token batches as P samples them, then the result: what both rpcs of the
    Router service send, standalone (``RouterServicer``) or behind Ray Serve
    (``deploy.deployments.RouterServer``)."""
    received_at = time.perf_counter()
    plan = router.plan(request, deadline)
    async with contextlib.aclosing(router.run(plan)) as items:
        async for item in items:
            if isinstance(item, Outcome):
                resp = to_response(item, router.tokens.tokenizer, received_at)
                metrics.observe(resp)
                yield router_pb2.GenerateStreamEvent(result=resp)
            else:
                yield router_pb2.GenerateStreamEvent(stage1_tokens={"ids": item})


async def parent_events(router: Router, request: router_pb2.ParentRequest,
                        deadline: float | None) -> AsyncIterator[router_pb2.ParentEvent]:
    """StartParent: stage-1 token batches as P samples them, then the Parent."""
    from router.parents import ParentRecord, parent_to_pb

    router.check_model(request.model)
    as_generate = router_pb2.GenerateRequest(
        request_id=request.request_id, stage1=request.stage1, timeout_ms=request.timeout_ms,
        path=(common_pb2.PATH_HANDOFF if router.decode and request.path != common_pb2.PATH_COLOCATED
              else common_pb2.PATH_COLOCATED))
    if request.WhichOneof("prompt") == "prompt_text":
        as_generate.prompt_text = request.prompt_text
    elif request.WhichOneof("prompt") == "prompt_token_ids":
        as_generate.prompt_token_ids.CopyFrom(request.prompt_token_ids)
    plan = router.plan(as_generate, deadline)
    async with contextlib.aclosing(router.run_parent(plan)) as items:
        async for item in items:
            if isinstance(item, ParentRecord):
                yield router_pb2.ParentEvent(parent=parent_to_pb(item, router.tokens.tokenizer))
            else:
                yield router_pb2.ParentEvent(stage1_tokens={"ids": item})


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a router caller sees for ``exc`` (standalone and Ray Serve routers)."""
    if isinstance(exc, RouterError):
        return exc.code, str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    return status_for(exc)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router, metrics: RouterMetrics | None = None):
        self.router = router
        self.metrics = metrics or RouterMetrics()
        self.inflight = 0

    @contextlib.contextmanager
    def _admit(self):
        """Count a request in flight; beyond ``max_inflight``, RESOURCE_EXHAUSTED."""
        limit = self.router.config.max_inflight
        if self.inflight >= limit:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{OVERLOAD_MESSAGE}: {limit} requests in flight (its limit); "
                              "retry later")
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    async def _abort(self, context: grpc.aio.ServicerContext, exc: BaseException) -> None:
        code, message = status_of(exc)
        remaining = context.time_remaining()
        if code == grpc.StatusCode.CANCELLED and remaining is not None and remaining <= 0:
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
        self.metrics.observe_error(code, message)
        if code == grpc.StatusCode.INTERNAL:
            logger.error("internal error", exc_info=exc)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        await context.abort(code, message)

    async def _events(self, request, context) -> AsyncIterator[router_pb2.GenerateStreamEvent]:
        with self._admit():
            async with contextlib.aclosing(generate_events(
                    self.router, self.metrics, request, _deadline(context))) as events:
                async for event in events:
                    yield event

    async def Generate(self, request, context):
        try:
            async with contextlib.aclosing(self._events(request, context)) as events:
                async for event in events:
                    if event.HasField("result"):
                        return event.result
        except (Exception, asyncio.CancelledError) as e:  # mapped to a status in one place
            await self._abort(context, e)

    async def GenerateStream(self, request, context):
        try:
            async with contextlib.aclosing(self._events(request, context)) as events:
                async for event in events:
                    yield event
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def StartParent(self, request, context):
        try:
            with self._admit():
                async with contextlib.aclosing(parent_events(
                        self.router, request, _deadline(context))) as events:
                    async for event in events:
                        yield event
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def Move(self, request, context):
        try:
            return await self.router.move(request.request_id, to=request.to_endpoint)
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def Drain(self, request, context):
        try:
            return await self.router.drain(request.endpoint,
                                           (request.timeout_ms or 300_000) / 1e3,
                                           undo=request.undo)
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)

    async def Continue(self, request, context):
        try:
            with self._admit():
                resp = await self.router.run_continuation(request, _deadline(context))
            self.metrics.observe(resp)
            return resp
        except (Exception, asyncio.CancelledError) as e:
            await self._abort(context, e)


async def serve_router(config: RouterConfig, host: str, port: int,
                       metrics_port: int | None = None, tls: ServerTLS | None = None,
                       http_port: int | None = None) -> None:
    """Serve the Router over gRPC (and, with ``http_port``, the OpenAI-compatible HTTP
    front of ``router.http``) until SIGTERM/SIGINT."""
    router = Router(config)
    metrics = RouterMetrics()
    metrics.track_engines(router)
    if metrics_port is not None:
        bound_metrics = metrics.serve(host, metrics_port)
        print(f"kvhandoff router metrics on http://{host}:{bound_metrics}/metrics", flush=True)
    service = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
    server, health, bound = await start_server(
        lambda s: router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router, metrics), s),
        service, host, port, tls)
    # SERVING once a prefill engine (and a decode engine, if any are configured) answers;
    # engines that are down are skipped until they answer.
    while True:
        await router.refresh_capacity(router.prefill + router.decode)
        if any(ep.capacity for ep in router.prefill) and (
            not router.decode or any(ep.capacity for ep in router.decode)
        ):
            break
        await asyncio.sleep(0.5)
    if config.warm_up:
        await router.warm_up()
    poller = asyncio.create_task(router.poll_capacity())
    lag = asyncio.create_task(watch_loop_lag(metrics.loop_lag, "router"))
    http = None
    if http_port is not None:
        from router.http import serve_http

        http, http_task, bound_http = await serve_http(router, metrics, host, http_port)
        print(f"kvhandoff router HTTP (OpenAI-compatible) on http://{host}:{bound_http}",
              flush=True)
    await set_serving(health, service, True)
    print(f"kvhandoff router serving on {host}:{bound}", flush=True)
    try:
        await wait_for_shutdown_signal()
    finally:
        if http is not None:
            http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(http_task, 5)
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        for task in (poller, lag):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await router.close()

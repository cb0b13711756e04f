"""The Serve deployments: one vLLM engine per P or D replica, and the router.

Engine replicas serve the same calls as ``kvhandoff serve --role prefill|decode`` (the
same :class:`~server.engine_service.EngineServicer` runs them), with protobuf bytes
in and out, over deployment handles instead of a gRPC port. The router deployment is the
``kvhandoff.v1.Router`` gRPC service, served by Ray Serve's gRPC proxy; it runs the same
:class:`~router.core.Router` as the standalone router, over handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from ray import serve

from engine import EngineConfig
from kvhandoff.budget import blocks_needed
from kvhandoff.model import resolve_model
from kvhandoff.types import check_beam_width
from kvhandoff.v1 import engine_pb2, router_pb2
from router import Endpoint, Router, RouterConfig, RouterError
from router.metrics import RouterMetrics
from router.service import generate_events, parent_events, status_of
from server.engine_service import make_servicer, start_engine

logger = logging.getLogger("kvhandoff.deploy")


class EngineCallError(Exception):
    """An engine replica's refusal, with the gRPC status the standalone server sends."""

    def __init__(self, code_name: str, message: str):
        super().__init__(f"{code_name}: {message}")
        self.code_name, self.message = code_name, message

    def __reduce__(self):  # crosses process boundaries inside Ray's error wrapper
        return (EngineCallError, (self.code_name, self.message))


class RequestFailed(Exception):
    """Raised by the router deployment after it set the call's gRPC status: a plain,
    picklable exception, so the proxy sends the status and message and nothing else."""


class _CallContext:
    """The slice of a gRPC servicer context ``EngineServicer`` uses."""

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise EngineCallError(code.name, message)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


@serve.deployment
class EngineServer:
    """One P or D engine. Started in ``__init__`` (Serve marks the replica ready after)."""

    async def __init__(self, role: str, model: str, engine_kwargs: dict[str, Any],
                       side_channel_host: str | None = None, side_channel_port: int = 0):
        self.role = role
        model_dir = str(resolve_model(model))
        port = None
        if side_channel_port:
            # A fixed range: this replica's rank within its deployment picks its port.
            port = side_channel_port + serve.get_replica_context().rank.rank
        host = side_channel_host or _node_ip()
        config = EngineConfig(model=model_dir, role=role, side_channel_host=host,
                              side_channel_port=port, **engine_kwargs)
        self.servicer = make_servicer(role, model_dir)
        self.engine = await start_engine(self.servicer, config)
        logger.info("%s replica ready: engine %s, NIXL side channel %s", role,
                    self.engine.engine_id, host)

    async def stage1(self, request: bytes) -> AsyncIterator[bytes]:
        req = engine_pb2.Stage1Request.FromString(request)
        async for event in self.servicer.Stage1(req, _CallContext()):
            yield event.SerializeToString()

    async def stage2(self, request: bytes, blocks_needed: int = 0) -> bytes:
        # ``blocks_needed`` is read by CapacityRouter before the call lands here.
        req = engine_pb2.Stage2Request.FromString(request)
        return (await self.servicer.Stage2(req, _CallContext())).SerializeToString()

    async def stage2_stream(self, request: bytes, blocks_needed: int = 0
                            ) -> AsyncIterator[bytes]:
        req = engine_pb2.Stage2Request.FromString(request)
        async for event in self.servicer.Stage2Stream(req, _CallContext()):
            yield event.SerializeToString()

    async def capacity(self) -> bytes:
        cap = await self.servicer.GetCapacity(engine_pb2.CapacityRequest(), _CallContext())
        return cap.SerializeToString()

    async def stop(self, request: bytes) -> bytes:
        req = engine_pb2.StopRequest.FromString(request)
        return (await self.servicer.Stop(req, _CallContext())).SerializeToString()

    async def release(self, request: bytes) -> bytes:
        req = engine_pb2.ReleaseRequest.FromString(request)
        return (await self.servicer.Release(req, _CallContext())).SerializeToString()

    def info(self) -> dict[str, Any]:
        import vllm

        return {"role": self.role, "engine_id": self.engine.engine_id,
                "vllm_version": vllm.__version__,
                "model_fingerprint": self.servicer.model_fingerprint,
                "block_size": self.engine.block_size}

    def record_routing_stats(self) -> dict[str, Any]:
        """What CapacityRouter routes D's calls by (Serve polls it)."""
        snap = self.engine.pool()
        return {"free_blocks": snap.num_free_blocks, "block_size": snap.block_size}

    def check_health(self) -> None:
        if self.engine.llm.errored:
            raise RuntimeError(f"engine {self.engine.engine_id} has failed")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class HandleStub:
    """``EngineStub``'s calls over a deployment handle, for :class:`Router`."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.block_size = 0  # learnt from GetCapacity

    @staticmethod
    def _error(exc: BaseException) -> Exception:
        cause = exc if isinstance(exc, EngineCallError) else getattr(exc, "cause", None)
        if isinstance(cause, EngineCallError):
            return RouterError(grpc.StatusCode[cause.code_name], cause.message)
        logger.warning("engine replica call failed: %r", exc)
        return RouterError(grpc.StatusCode.UNAVAILABLE,
                           f"engine replica unavailable ({type(exc).__name__})")

    async def Stage1(self, request: engine_pb2.Stage1Request,  # noqa: N802 (gRPC names)
                     timeout: float | None = None) -> AsyncIterator[engine_pb2.Stage1Event]:
        stream = self.handle.options(stream=True).stage1.remote(request.SerializeToString())
        try:
            async with asyncio.timeout(timeout):
                async for data in stream:
                    yield engine_pb2.Stage1Event.FromString(data)
        except (asyncio.CancelledError, TimeoutError):
            stream.cancel()
            raise
        except Exception as e:
            raise self._error(e) from None

    async def Stage2(self, request: engine_pb2.Stage2Request,  # noqa: N802
                     timeout: float | None = None) -> engine_pb2.Stage2Response:
        need = 0
        if request.HasField("handoff") and self.block_size:
            need = blocks_needed(len(request.prompt_token_ids), self.block_size,
                                 request.beam.beam_width, request.beam.max_tokens, True)
        response = self.handle.stage2.remote(request.SerializeToString(), blocks_needed=need)
        try:
            async with asyncio.timeout(timeout):
                return engine_pb2.Stage2Response.FromString(await response)
        except (asyncio.CancelledError, TimeoutError):
            response.cancel()
            raise
        except Exception as e:
            raise self._error(e) from None

    async def Stage2Stream(self, request: engine_pb2.Stage2Request,  # noqa: N802
                           timeout: float | None = None
                           ) -> AsyncIterator[engine_pb2.Stage2Event]:
        need = 0
        if request.HasField("handoff") and self.block_size:
            need = blocks_needed(len(request.prompt_token_ids), self.block_size,
                                 request.beam.beam_width, request.beam.max_tokens, True)
        stream = self.handle.options(stream=True).stage2_stream.remote(
            request.SerializeToString(), blocks_needed=need)
        try:
            async with asyncio.timeout(timeout):
                async for data in stream:
                    yield engine_pb2.Stage2Event.FromString(data)
        except (asyncio.CancelledError, TimeoutError):
            stream.cancel()
            raise
        except Exception as e:
            raise self._error(e) from None

    async def Release(self, request: engine_pb2.ReleaseRequest,  # noqa: N802
                      timeout: float | None = None) -> engine_pb2.ReleaseResponse:
        # A held parent is on one P replica; the handle may pick another, which ignores
        # names it does not hold (that hold then ends at its lease).
        try:
            async with asyncio.timeout(timeout):
                data = await self.handle.release.remote(request.SerializeToString())
        except Exception as e:
            raise self._error(e) from None
        return engine_pb2.ReleaseResponse.FromString(data)

    async def Stop(self, request: engine_pb2.StopRequest,  # noqa: N802
                   timeout: float | None = None) -> engine_pb2.StopResponse:
        try:
            async with asyncio.timeout(timeout):
                data = await self.handle.stop.remote(request.SerializeToString())
        except Exception as e:
            raise self._error(e) from None
        return engine_pb2.StopResponse.FromString(data)

    async def GetCapacity(self, request: Any,  # noqa: N802
                          timeout: float | None = None) -> engine_pb2.Capacity:
        try:
            async with asyncio.timeout(timeout):
                cap = engine_pb2.Capacity.FromString(await self.handle.capacity.remote())
        except Exception as e:
            raise self._error(e) from None
        self.block_size = cap.block_size
        return cap


@serve.deployment
class RouterServer:
    """``kvhandoff.v1.Router`` behind Serve's gRPC proxy: same messages, semantics and
    status codes as ``kvhandoff serve --role router``."""

    def __init__(self, prefill: Any, decode: Any, model: str, colocated_below_tokens: int = 0,
                 max_beam_width: int = 32):
        config = RouterConfig(prefill=("serve:Prefill",), decode=("serve:Decode",),
                              model=str(resolve_model(model)),
                              colocated_below_tokens=colocated_below_tokens)
        self.router = Router(config, endpoints=(
            [Endpoint("serve:Prefill", HandleStub(prefill), None)],
            [Endpoint("serve:Decode", HandleStub(decode), None)]))
        self.max_beam_width = max_beam_width
        self.metrics = RouterMetrics()
        self._prefill, self._decode = prefill, decode
        self._checked = False
        #: The background warm-up, started by the first health check that finds P and D.
        self._warm_up: asyncio.Task | None = None

    async def _check_engines(self) -> None:
        """Once: P and D run the same model, vLLM and block size."""
        if self._checked:
            return
        p, d = await asyncio.gather(self._prefill.info.remote(), self._decode.info.remote())
        for key in ("vllm_version", "model_fingerprint", "block_size"):
            if p[key] != d[key]:
                raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"P and D differ in {key}: {p[key]} vs {d[key]}")
        self._checked = True

    async def _events(self, request: router_pb2.GenerateRequest):
        await self._check_engines()
        check_beam_width(request.beam.beam_width, self.max_beam_width, "this deployment")
        if not any(ep.capacity for ep in self.router.prefill):
            await self.router.refresh_capacity(self.router.prefill)
        async with contextlib.aclosing(
                generate_events(self.router, self.metrics, request, None)) as events:
            async for event in events:
                yield event

    def _fail(self, grpc_context: Any, exc: BaseException) -> None:
        """Set the status the standalone router would send, then raise RequestFailed
        (a CancelledError stays one: the client went away)."""

        code, message = status_of(exc)
        self.metrics.observe_error(code, message)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if code == grpc.StatusCode.INTERNAL:
            logger.error("internal error", exc_info=exc)
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(message)
        raise RequestFailed(message) from None

    async def Generate(self, request: router_pb2.GenerateRequest,  # noqa: N802
                       grpc_context: Any = None) -> router_pb2.GenerateResponse:
        try:
            async for event in self._events(request):
                if event.HasField("result"):
                    return event.result
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)
        raise AssertionError("the router produced no response")

    async def GenerateStream(self, request: router_pb2.GenerateRequest,  # noqa: N802
                             grpc_context: Any = None):
        try:
            async for event in self._events(request):
                yield event
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)

    async def StartParent(self, request: router_pb2.ParentRequest,  # noqa: N802
                          grpc_context: Any = None):
        """Stage 1 as a parent. The parent registry is this replica's: run one Router
        replica for continuations (a continuation that lands on another gets NOT_FOUND)."""
        try:
            await self._check_engines()
            # No poller here: an engine without a snapshot (never asked, or out after an
            # error) is asked now, or the parent would not be held for want of a D.
            missing = [ep for ep in self.router.prefill + self.router.decode
                       if ep.capacity is None]
            if missing:
                await self.router.refresh_capacity(missing)
            async with contextlib.aclosing(
                    parent_events(self.router, request, None)) as events:
                async for event in events:
                    yield event
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)

    async def Move(self, request: router_pb2.MoveRequest,  # noqa: N802
                   grpc_context: Any = None) -> router_pb2.MoveResponse:
        """Move a running request (this replica's: requests on another get NOT_FOUND)."""
        try:
            return await self.router.move(request.request_id, to=request.to_endpoint)
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)
        raise AssertionError("unreachable")

    async def Drain(self, request: router_pb2.DrainRequest,  # noqa: N802
                    grpc_context: Any = None) -> router_pb2.DrainResponse:
        """Drain an engine for this replica's requests (run one Router replica, or drain
        through each)."""
        try:
            return await self.router.drain(request.endpoint,
                                           (request.timeout_ms or 300_000) / 1e3,
                                           undo=request.undo)
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)
        raise AssertionError("unreachable")

    async def Continue(self, request: router_pb2.ContinueRequest,  # noqa: N802
                       grpc_context: Any = None) -> router_pb2.GenerateResponse:
        try:
            await self._check_engines()
            check_beam_width(request.beam.beam_width, self.max_beam_width, "this deployment")
            resp = await self.router.run_continuation(request, None)
            self.metrics.observe(resp)
            return resp
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)
        raise AssertionError("unreachable")

    async def check_health(self) -> None:
        endpoints = self.router.prefill + self.router.decode
        with contextlib.suppress(Exception):
            await self.router.refresh_capacity(endpoints)
        if self._warm_up is None and all(ep.capacity is not None for ep in endpoints):
            # One handoff through the handles, off the request path (Router.warm_up): it
            # sets up the NIXL connection between the P and D replicas Serve picks for it.
            self._warm_up = asyncio.create_task(self.router.warm_up())

    async def warm_up_outcome(self) -> dict[str, str] | None:
        """What the background warm-up did (None while it has not finished)."""
        if self._warm_up is None or not self._warm_up.done():
            return None
        return self._warm_up.result()

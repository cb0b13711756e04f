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
import time
from collections.abc import AsyncIterator, Callable
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


class ReplicaWatch:
    """Whether a deployment has a RUNNING replica, as Serve's controller reports it
    (``serve.status()``), fetched at most once per ``poll_s`` for all the calls that ask.

    Serve's handle queues a call for a deployment with no live replica until one is placed
    again, with no bound of its own (a node lost: until it returns). :meth:`gone` returns
    a message once the deployment has had no RUNNING replica on ``misses`` polls in a row,
    and never while one runs or while the controller cannot be asked (unknown is not gone).
    """

    def __init__(self, app: str, deployment: str, poll_s: float = 1.0, misses: int = 2,
                 status: Callable[[], Any] | None = None):
        self.app, self.deployment = app, deployment
        self.poll_s, self.misses = poll_s, misses
        self._status = status or serve.status
        self._states: dict[str, int] | None = None
        self._fetched_at = float("-inf")
        self._lock = asyncio.Lock()

    async def states(self) -> dict[str, int] | None:
        """Replica count by state (``{}``: the deployment has none); None: not known."""
        async with self._lock:
            if time.monotonic() - self._fetched_at >= self.poll_s:
                try:
                    status = await asyncio.to_thread(self._status)
                    app = status.applications.get(self.app)
                    overview = app.deployments.get(self.deployment) if app else None
                    self._states = {getattr(state, "value", str(state)): n for state, n in
                                    (overview.replica_states if overview else {}).items()}
                except Exception as e:  # the controller unreachable: say nothing
                    logger.warning("serve.status() failed: %r", e)
                    self._states = None
                self._fetched_at = time.monotonic()
            return self._states

    async def gone(self) -> str:
        misses = 0
        while True:
            await asyncio.sleep(self.poll_s)
            states = await self.states()
            if states is None or states.get("RUNNING", 0):
                misses = 0
                continue
            misses += 1
            if misses >= self.misses:
                return (f"no running replica of deployment {self.deployment!r} "
                        f"(replicas: {states or 'none'}); the call was not taken")


class HandleStub:
    """``EngineStub``'s calls over a deployment handle, for :class:`Router`.

    Each call ends within the router's ``timeout``, and fails UNAVAILABLE (its handle call
    cancelled) once ``watch`` finds the deployment without a running replica; a call a
    replica is running when that replica dies fails UNAVAILABLE through Ray's error."""

    def __init__(self, handle: Any, watch: ReplicaWatch | None = None):
        self.handle = handle
        self.watch = watch or ReplicaWatch(handle.app_name, handle.deployment_name)
        self.block_size = 0  # learnt from GetCapacity

    @staticmethod
    def _error(exc: BaseException) -> Exception:
        cause = exc if isinstance(exc, EngineCallError) else getattr(exc, "cause", None)
        if isinstance(cause, EngineCallError):
            return RouterError(grpc.StatusCode[cause.code_name], cause.message)
        logger.warning("engine replica call failed: %r", exc)
        return RouterError(grpc.StatusCode.UNAVAILABLE,
                           f"engine replica unavailable ({type(exc).__name__})")

    @contextlib.asynccontextmanager
    async def _call(self, response: Any, timeout: float | None) -> AsyncIterator[None]:
        """The body awaits ``response`` (a handle call or stream): bounded by ``timeout``
        and by the watch; Ray's errors become the standalone router's statuses."""
        gone: list[str] = []

        async def watch() -> None:
            gone.append(await self.watch.gone())
            logger.warning("%s: cancelling a call: %s", self.watch.deployment, gone[0])
            response.cancel()  # its await raises CancelledError, or Ray's cancel error

        watcher = asyncio.create_task(watch())
        try:
            async with asyncio.timeout(timeout):
                yield
        except (asyncio.CancelledError, TimeoutError):
            task = asyncio.current_task()
            if gone and not (task and task.cancelling()):
                raise RouterError(grpc.StatusCode.UNAVAILABLE, gone[0]) from None
            response.cancel()
            raise
        except Exception as e:
            if gone:
                raise RouterError(grpc.StatusCode.UNAVAILABLE, gone[0]) from None
            raise self._error(e) from None
        finally:
            watcher.cancel()

    def _need(self, request: engine_pb2.Stage2Request) -> int:
        if not (request.HasField("handoff") and self.block_size):
            return 0
        return blocks_needed(len(request.prompt_token_ids), self.block_size,
                             request.beam.beam_width, request.beam.max_tokens, True)

    async def _unary(self, response: Any, timeout: float | None) -> bytes:
        async with self._call(response, timeout):
            return await response
        raise AssertionError("unreachable")  # _call re-raises whatever the body raised

    async def Stage1(self, request: engine_pb2.Stage1Request,  # noqa: N802 (gRPC names)
                     timeout: float | None = None) -> AsyncIterator[engine_pb2.Stage1Event]:
        stream = self.handle.options(stream=True).stage1.remote(request.SerializeToString())
        async with self._call(stream, timeout):
            async for data in stream:
                yield engine_pb2.Stage1Event.FromString(data)

    async def Stage2(self, request: engine_pb2.Stage2Request,  # noqa: N802
                     timeout: float | None = None) -> engine_pb2.Stage2Response:
        response = self.handle.stage2.remote(request.SerializeToString(),
                                             blocks_needed=self._need(request))
        return engine_pb2.Stage2Response.FromString(await self._unary(response, timeout))

    async def Stage2Stream(self, request: engine_pb2.Stage2Request,  # noqa: N802
                           timeout: float | None = None
                           ) -> AsyncIterator[engine_pb2.Stage2Event]:
        stream = self.handle.options(stream=True).stage2_stream.remote(
            request.SerializeToString(), blocks_needed=self._need(request))
        async with self._call(stream, timeout):
            async for data in stream:
                yield engine_pb2.Stage2Event.FromString(data)

    async def Release(self, request: engine_pb2.ReleaseRequest,  # noqa: N802
                      timeout: float | None = None) -> engine_pb2.ReleaseResponse:
        # A held parent is on one P replica; the handle may pick another, which ignores
        # names it does not hold (that hold then ends at its lease).
        response = self.handle.release.remote(request.SerializeToString())
        return engine_pb2.ReleaseResponse.FromString(await self._unary(response, timeout))

    async def Stop(self, request: engine_pb2.StopRequest,  # noqa: N802
                   timeout: float | None = None) -> engine_pb2.StopResponse:
        response = self.handle.stop.remote(request.SerializeToString())
        return engine_pb2.StopResponse.FromString(await self._unary(response, timeout))

    async def GetCapacity(self, request: Any,  # noqa: N802
                          timeout: float | None = None) -> engine_pb2.Capacity:
        cap = engine_pb2.Capacity.FromString(
            await self._unary(self.handle.capacity.remote(), timeout))
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

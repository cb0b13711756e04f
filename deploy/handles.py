"""The router's engine calls over Ray Serve deployment handles: ``EngineStub``'s calls
(:class:`HandleStub`), each bounded by the router's timeout and failed UNAVAILABLE once
its deployment has no running replica (:class:`ReplicaWatch`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from ray import serve

from deploy.engine_server import EngineCallError
from kvhandoff.budget import blocks_needed
from kvhandoff.v1 import engine_pb2
from router import RouterError

logger = logging.getLogger("kvhandoff.deploy")


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
    replica is running when that replica dies fails UNAVAILABLE through Ray's error.

    The handle stands for several engines, yet a stage 2 can be moved
    (``finds_runs``): each Stage2 call learns the engine of the replica it reached (the
    replica's first item), and a Stop naming that stage 2 goes to that replica
    (``engine``, Decode's request router); a resume (``Stage2Request.resume``) goes to a
    replica other than the one its export comes from (``avoid``)."""

    #: ``router.endpoint.Endpoint.finds_runs``: read by ``RouterAPI.over_stubs``.
    finds_runs = True

    def __init__(self, handle: Any, watch: ReplicaWatch | None = None, *,
                 by_prefix: bool = False):
        self.handle = handle
        self.watch = watch or ReplicaWatch(handle.app_name, handle.deployment_name)
        self.block_size = 0  # learnt from GetCapacity
        #: Calls carry their prompt (``prefix``) for the deployment's PrefillRouter.
        self.by_prefix = by_prefix
        #: Stage2 calls in flight, by request id: the engine running each, once its
        #: replica has said (the future is set then; it is removed when the call ends).
        self._running: dict[str, asyncio.Future[str]] = {}

    def _prefix(self, request: Any) -> tuple:
        """What PrefillRouter places a call by: (adapter, prompt token ids); () without."""
        if not self.by_prefix:
            return ()
        return (request.adapter, tuple(request.prompt_token_ids))

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
                             request.beam.beam_width, request.beam.max_tokens, True,
                             from_parent=bool(request.beam.catalog))

    async def _unary(self, response: Any, timeout: float | None) -> bytes:
        async with self._call(response, timeout):
            return await response
        raise AssertionError("unreachable")  # _call re-raises whatever the body raised

    async def Stage1(self, request: engine_pb2.Stage1Request,  # noqa: N802 (gRPC names)
                     timeout: float | None = None) -> AsyncIterator[engine_pb2.Stage1Event]:
        stream = self.handle.options(stream=True).stage1.remote(
            request.SerializeToString(), prefix=self._prefix(request))
        async with self._call(stream, timeout):
            async for data in stream:
                yield engine_pb2.Stage1Event.FromString(data)

    async def Stage2(self, request: engine_pb2.Stage2Request,  # noqa: N802
                     timeout: float | None = None) -> engine_pb2.Stage2Response:
        # A continuation's parent id (``affinity``): Decode's request router keeps a
        # parent's continuations on one D while it runs and has room. A resume avoids
        # the engine that stopped it (its export's).
        stream = self.handle.options(stream=True).stage2.remote(
            request.SerializeToString(), blocks_needed=self._need(request),
            prefix=self._prefix(request), affinity=request.affinity,
            avoid=request.resume.export.engine_id if request.HasField("resume") else "")
        engine = self._running.setdefault(request.request_id,
                                          asyncio.get_running_loop().create_future())
        data = None
        try:
            async with self._call(stream, timeout):
                async for item in stream:
                    if not engine.done():
                        engine.set_result(item.decode())
                    else:
                        data = item
        finally:
            if self._running.get(request.request_id) is engine:
                del self._running[request.request_id]
            engine.cancel()  # a Stop still waiting for it sends nothing
        if data is None:
            raise RouterError(grpc.StatusCode.INTERNAL,
                              f"{self.watch.deployment} ended stage 2 "
                              f"{request.request_id!r} without a response")
        return engine_pb2.Stage2Response.FromString(data)

    async def Stage2Stream(self, request: engine_pb2.Stage2Request,  # noqa: N802
                           timeout: float | None = None
                           ) -> AsyncIterator[engine_pb2.Stage2Event]:
        stream = self.handle.options(stream=True).stage2_stream.remote(
            request.SerializeToString(), blocks_needed=self._need(request),
            prefix=self._prefix(request), affinity=request.affinity)
        async with self._call(stream, timeout):
            async for data in stream:
                yield engine_pb2.Stage2Event.FromString(data)

    async def Release(self, request: engine_pb2.ReleaseRequest,  # noqa: N802
                      timeout: float | None = None) -> engine_pb2.ReleaseResponse:
        # A held parent is on one P replica: the request names its engine, which
        # Prefill's request router sends the call to.
        response = self.handle.release.remote(request.SerializeToString(),
                                              engine=request.engine_id)
        return engine_pb2.ReleaseResponse.FromString(await self._unary(response, timeout))

    async def Stop(self, request: engine_pb2.StopRequest,  # noqa: N802
                   timeout: float | None = None) -> engine_pb2.StopResponse:
        """To the replica running the requests: the one ``engine_id`` names, else the
        one this stub's Stage2 call of the first request reached (waited for, within
        ``timeout``, while that call is on its way; nothing is sent when it ends
        first: the engine would drop a Stop of a request it does not run)."""
        engine = request.engine_id
        running = self._running.get(request.request_ids[0]) if request.request_ids else None
        if not engine and running is not None:
            try:
                async with asyncio.timeout(timeout):
                    engine = await asyncio.shield(running)
            except asyncio.CancelledError:
                if not running.cancelled():
                    raise
                return engine_pb2.StopResponse()
        response = self.handle.stop.remote(request.SerializeToString(), engine=engine)
        return engine_pb2.StopResponse.FromString(await self._unary(response, timeout))

    async def GetCapacity(self, request: Any,  # noqa: N802
                          timeout: float | None = None) -> engine_pb2.Capacity:
        cap = engine_pb2.Capacity.FromString(
            await self._unary(self.handle.capacity.remote(), timeout))
        self.block_size = cap.block_size
        return cap

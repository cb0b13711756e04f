"""The router deployment, the application's ingress with two fronts over one
:class:`~deploy.replica_api.ReplicaAPI` per replica (the same admission, runs, statuses
and metrics as the standalone router's gRPC and HTTP fronts), over deployment handles to
the engine deployments:

- ``kvhandoff.v1.Router`` behind Ray Serve's gRPC proxy (the ``serve`` front: the
  proxy calls this class's methods by the RPC's name);
- the standalone router's OpenAI-compatible HTTP front (``router.http``, the ``http``
  front) behind Serve's HTTP proxy, under the application's route prefix: the app is
  built per replica over that replica's API (``__serve_build_asgi_app__``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve

from deploy.affinity import owned_id
from deploy.handles import HandleStub
from deploy.replica_api import ReplicaAPI
from deploy.shared import SharedState
from kvhandoff.model import resolve_model
from kvhandoff.v1 import router_pb2
from router import grpc_wire as wire
from router.auth import API_KEY_ENV, CLIENT, OPERATOR, OPERATOR_KEY_ENV, Credentials, need_of
from router.config import RouterConfig
from router.errors import RouterError
from router.http import HttpFront

logger = logging.getLogger("kvhandoff.deploy")

FRONT = "serve"


class RequestFailed(Exception):
    """Raised by the router deployment after it set the call's gRPC status: a plain,
    picklable exception, so the proxy sends the status and message and nothing else."""


@serve.deployment
@serve.ingress()  # the app: __serve_build_asgi_app__, once the replica is constructed
class RouterServer:
    """``kvhandoff.v1.Router`` behind Serve's gRPC proxy: same messages, semantics and
    status codes as ``kvhandoff serve --role router``. Parents, chunks and drained
    engines are shared by every replica (``deploy.shared``: a store outside any of
    them, read before each call); the requests a replica runs are its own. With several
    replicas, Serve routes each call that names an id to its owner
    (``deploy.request_router.OwnerRouter``, by this replica's rank in
    :meth:`record_routing_stats`), and the ids a replica makes are its own. A ``rank``
    keyword (a deployment handle's call only; unused here) sends a call to that replica
    instead: Generate, Continue and RegisterChunk take one, so a test can reach a replica
    other than the id's owner. Serve's HTTP proxy reaches the replica's HTTP front
    (module docstring): OwnerRouter finds no id in its calls, which go by load."""

    def __init__(self, prefill: Any, decode: Any, model: str, colocated_below_tokens: int = 0,
                 max_beam_width: int = 32, max_inflight: int = 256,
                 by_cache: bool = False):
        config = RouterConfig(prefill=("serve:Prefill",), decode=("serve:Decode",),
                              model=str(resolve_model(model)),
                              colocated_below_tokens=colocated_below_tokens,
                              max_inflight=max_inflight,
                              # One endpoint per role stands for all its replicas:
                              # Serve's request router picks the replica (by cache:
                              # PrefillRouter, which follows each P replica's events).
                              placement="load")
        self.shared = SharedState(serve.get_replica_context().app_name, config, self._rank)
        # The standalone router's keys (router.auth), from the replica's environment
        # (the application's runtime_env env_vars), checked on the proxy's metadata and
        # on the HTTP front's Authorization header.
        self.api = ReplicaAPI.over_stubs(
            config, HandleStub(prefill, by_prefix=by_cache), HandleStub(decode),
            new_id=lambda: owned_id(*self._rank()), credentials=Credentials(
                os.environ.get(API_KEY_ENV) or None, os.environ.get(OPERATOR_KEY_ENV) or None),
            stores=self.shared.stores, shared=self.shared, engines=(prefill, decode),
            max_beam_width=max_beam_width, rank=self._rank)
        #: The background warm-up, started by the first health check that finds P and D.
        self._warm_up: asyncio.Task | None = None

    def __serve_build_asgi_app__(self) -> Any:
        """Serve's HTTP ingress: the standalone router's OpenAI-compatible front
        (``router.http``) over this replica's own API, so both fronts share its
        admission, counts, keys and state. Serve calls it once, after ``__init__``."""
        return HttpFront(self.api).app

    @staticmethod
    def _rank() -> tuple[int, int]:
        """This replica's rank and the deployment's replicas (read each time: Serve sets
        them, and a scaled deployment changes the second)."""
        context = serve.get_replica_context()
        return context.rank.rank, context.world_size

    def record_routing_stats(self) -> dict[str, Any]:
        """What OwnerRouter routes by (Serve polls it)."""
        rank, world_size = self._rank()
        return {"rank": rank, "world_size": world_size}

    def _authorize(self, grpc_context: Any, need: str) -> None:
        """The caller's key, from the proxy's metadata (a call through a handle, with
        no gRPC context, comes from inside the cluster)."""
        if grpc_context is None:
            return
        metadata = dict(grpc_context.invocation_metadata() or ())
        self.api.authorize(metadata.get("authorization"), need)

    def _fail(self, grpc_context: Any, exc: BaseException) -> None:
        """Set the status the standalone router would send, then raise RequestFailed
        (a CancelledError stays one: the client went away)."""
        code, message = self.api.failed(FRONT, exc)
        if isinstance(exc, asyncio.CancelledError):
            raise exc
        if grpc_context is not None:
            grpc_context.set_code(code)
            grpc_context.set_details(message)
        raise RequestFailed(message) from None

    async def _events(self, request: router_pb2.GenerateRequest
                      ) -> AsyncIterator[router_pb2.GenerateStreamEvent]:
        async with contextlib.aclosing(
                self.api.generate(FRONT, wire.generate_call(request), None)) as items:
            async for item in items:
                yield wire.event_to_pb(item)

    async def Generate(self, request: router_pb2.GenerateRequest,  # noqa: N802
                       grpc_context: Any = None, rank: int | None = None
                       ) -> router_pb2.GenerateResponse:
        try:
            self._authorize(grpc_context, need_of(request.fault))
            async with contextlib.aclosing(self._events(request)) as events:
                async for event in events:
                    if event.HasField("result"):
                        return event.result
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)
        raise AssertionError("the router produced no response")

    async def GenerateStream(self, request: router_pb2.GenerateRequest,  # noqa: N802
                             grpc_context: Any = None):
        try:
            self._authorize(grpc_context, need_of(request.fault))
            async with contextlib.aclosing(self._events(request)) as events:
                async for event in events:
                    yield event
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)

    async def StartParent(self, request: router_pb2.ParentRequest,  # noqa: N802
                          grpc_context: Any = None):
        try:
            self._authorize(grpc_context, CLIENT)
            async with contextlib.aclosing(self.api.start_parent(
                    FRONT, wire.parent_call(request), None)) as items:
                async for item in items:
                    yield wire.parent_event_to_pb(item)
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)

    async def _unary(self, grpc_context: Any, call: Any, need: str) -> Any:
        """Await ``call`` (a coroutine of the API) as one unary RPC for a caller granted
        ``need``: its answer, or the standalone router's status through ``_fail``."""
        try:
            self._authorize(grpc_context, need)
        except RouterError as e:
            call.close()  # never started
            self._fail(grpc_context, e)
        try:
            return await call
        except (Exception, asyncio.CancelledError) as e:
            self._fail(grpc_context, e)
        raise AssertionError("unreachable")  # _fail always raises

    async def _continue(self, request: router_pb2.ContinueRequest
                        ) -> router_pb2.GenerateResponse:
        return wire.result_to_pb(
            await self.api.continue_(FRONT, wire.continue_call(request), None))

    async def Continue(self, request: router_pb2.ContinueRequest,  # noqa: N802
                       grpc_context: Any = None, rank: int | None = None
                       ) -> router_pb2.GenerateResponse:
        return await self._unary(grpc_context, self._continue(request),
                                 need_of(request.fault))

    async def ReleaseParent(self, request: router_pb2.ReleaseParentRequest,  # noqa: N802
                            grpc_context: Any = None) -> router_pb2.ReleaseParentResponse:
        return await self._unary(grpc_context, self._release(request), OPERATOR)

    async def _release(self, request: router_pb2.ReleaseParentRequest
                       ) -> router_pb2.ReleaseParentResponse:
        return wire.released_to_pb(await self.api.release_parent(request.parent_id))

    async def Move(self, request: router_pb2.MoveRequest,  # noqa: N802
                   grpc_context: Any = None) -> router_pb2.MoveResponse:
        return await self._unary(grpc_context, self._move(request), OPERATOR)

    async def _move(self, request: router_pb2.MoveRequest) -> router_pb2.MoveResponse:
        return wire.moved_to_pb(await self.api.move(request.request_id, request.to_endpoint))

    async def RegisterChunk(self, request: router_pb2.ChunkRequest,  # noqa: N802
                            grpc_context: Any = None, rank: int | None = None
                            ) -> router_pb2.Chunk:
        return await self._unary(grpc_context, self._register_chunk(request),
                                 need_of(request.fault))

    async def _register_chunk(self, request: router_pb2.ChunkRequest) -> router_pb2.Chunk:
        return wire.chunk_to_pb(await self.api.register_chunk(
            FRONT, wire.chunk_call(request), None))

    async def ListChunks(self, request: router_pb2.ListChunksRequest,  # noqa: N802
                         grpc_context: Any = None) -> router_pb2.ListChunksResponse:
        async def listing():
            return wire.chunks_to_pb(await self.api.chunks())
        return await self._unary(grpc_context, listing(), OPERATOR)

    async def DeleteChunk(self, request: router_pb2.DeleteChunkRequest,  # noqa: N802
                          grpc_context: Any = None) -> router_pb2.DeleteChunkResponse:
        async def delete():
            return wire.deleted_to_pb(await self.api.delete_chunk(request.chunk_id))
        return await self._unary(grpc_context, delete(), OPERATOR)

    async def Drain(self, request: router_pb2.DrainRequest,  # noqa: N802
                    grpc_context: Any = None) -> router_pb2.DrainResponse:
        return await self._unary(grpc_context, self._drain(request), OPERATOR)

    async def _drain(self, request: router_pb2.DrainRequest) -> router_pb2.DrainResponse:
        return wire.drained_to_pb(await self.api.drain(request.endpoint, request.timeout_ms,
                                                       request.undo))

    async def check_health(self) -> None:
        with contextlib.suppress(Exception):
            await self.api.refresh_engines()
        with contextlib.suppress(RouterError):
            await self.shared.sync()  # a restarted store gets this replica's mirror
        if self._warm_up is None and self.api.engines_known():
            # One handoff through the handles, off the request path (router.warmup): it
            # sets up the NIXL connection between the P and D replicas Serve picks for it.
            self._warm_up = asyncio.create_task(self.api.warm_up())

    # The operator's per-replica calls, through a deployment handle: ``rank`` picks the
    # replica (OwnerRouter routes by it; unused here).

    def actor_name(self, rank: int | None = None) -> str:
        """This replica's Ray actor (namespace ``serve``): what a test kills."""
        return ray.get_runtime_context().get_actor_name()

    async def warm_up_outcome(self, rank: int | None = None) -> dict[str, str] | None:
        """What the background warm-up did (None while it has not finished)."""
        if self._warm_up is None or not self._warm_up.done():
            return None
        return self._warm_up.result()

    def inflight(self, rank: int | None = None) -> tuple[int, int]:
        """Requests this replica runs now, and the most it has run at once since the
        start or the last ``set_max_inflight``."""
        return self.api.inflight, self.api.admission.peak

    def set_max_inflight(self, limit: int | None, rank: int | None = None) -> None:
        """Change this replica's ``max_inflight`` while it serves; None turns the guard
        off (the flood test's control: what the guard prevents)."""
        if limit is not None and limit < 1:
            raise ValueError("max_inflight must be positive (None: no limit)")
        self.api.admission.limit = limit
        self.api.admission.reset_peak()

    def parent_ids(self, rank: int | None = None) -> list[str]:
        """The parents in this replica's registry."""
        return self.api.parent_ids()

    async def drained(self, rank: int | None = None) -> list[str]:
        """The engines this replica routes no new work to, read as by any call."""
        await self.shared.sync()
        return self.shared.rotation.drained()

    def set_shared_state(self, enabled: bool, rank: int | None = None) -> None:
        """Share this replica's state (the default), or keep its own registries alone,
        as with one replica (the tests' controls: what sharing prevents)."""
        self.shared.enabled = enabled

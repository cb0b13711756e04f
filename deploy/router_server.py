"""The router deployment: ``kvhandoff.v1.Router`` behind Ray Serve's gRPC proxy, the
``serve`` front of :class:`~router.api.RouterAPI` (the same admission, runs, statuses and
metrics as the standalone router's gRPC and HTTP fronts), over deployment handles to the
engine deployments."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
import ray
from ray import serve

from deploy.affinity import owned_id
from deploy.handles import HandleStub
from deploy.shared import SharedState
from kvhandoff.model import resolve_model
from kvhandoff.types import check_beam_width
from kvhandoff.v1 import router_pb2
from router import grpc_wire as wire
from router.api import RouterAPI
from router.auth import API_KEY_ENV, CLIENT, OPERATOR, OPERATOR_KEY_ENV, Credentials, need_of
from router.config import RouterConfig
from router.errors import RouterError
from router.requests import Parent

logger = logging.getLogger("kvhandoff.deploy")

FRONT = "serve"


class RequestFailed(Exception):
    """Raised by the router deployment after it set the call's gRPC status: a plain,
    picklable exception, so the proxy sends the status and message and nothing else."""


@serve.deployment
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
    other than the id's owner."""

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
        # (the application's runtime_env env_vars), checked on the proxy's metadata.
        self.api = RouterAPI.over_stubs(
            config, HandleStub(prefill, by_prefix=by_cache), HandleStub(decode),
            new_id=lambda: owned_id(*self._rank()), credentials=Credentials(
                os.environ.get(API_KEY_ENV) or None, os.environ.get(OPERATOR_KEY_ENV) or None),
            stores=self.shared.stores)
        self.max_beam_width = max_beam_width
        self._prefill, self._decode = prefill, decode
        self._checked = False
        #: The background warm-up, started by the first health check that finds P and D.
        self._warm_up: asyncio.Task | None = None

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

    async def _ready(self, beam_width: int | None = None, ask: tuple[str, ...] = (),
                     unless_one_answered: bool = False) -> None:
        """Once: P and D run the same model, vLLM and block size. Then: the beam width
        is one this deployment takes, and the engines of roles ``ask`` without a
        snapshot are asked now (no poller runs here; ``RouterAPI.ask_engines``)."""
        if not self._checked:
            p, d = await asyncio.gather(self._prefill.info.remote(),
                                        self._decode.info.remote())
            for key in ("vllm_version", "model_fingerprint", "block_size"):
                if p[key] != d[key]:
                    raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"P and D differ in {key}: {p[key]} vs {d[key]}")
            self._checked = True
        if beam_width is not None:
            check_beam_width(beam_width, self.max_beam_width, "this deployment")
        if ask:
            await self.api.ask_engines(ask, unless_one_answered)

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
        await self._ready(request.beam.beam_width, ask=("prefill",), unless_one_answered=True)
        await self.shared.sync(chunks=bool(request.chunk_ids))
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
            # Every engine: without a D's snapshot the parent would not be held.
            await self._ready(ask=("prefill", "decode"))
            await self.shared.sync(chunks=bool(request.chunk_ids))
            async with contextlib.aclosing(self.api.start_parent(
                    FRONT, wire.parent_call(request), None)) as items:
                async for item in items:
                    if isinstance(item, Parent):  # shared before its client hears of it
                        await self.shared.publish_parent(item.parent_id)
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
        # Every engine: the parent may be another replica's, on engines not asked here yet.
        await self._ready(request.beam.beam_width, ask=("prefill", "decode"))
        await self.shared.sync(parent_id=request.parent_id)
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
        await self.shared.sync(parent_id=request.parent_id)
        released = await self.api.release_parent(request.parent_id)
        await self.shared.flush()  # dropped from the store: no replica continues it
        return wire.released_to_pb(released)

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
        rank, world_size = self._rank()
        if world_size > 1 and not self.shared.enabled:
            # A chunk's registry is one router replica's, and a call reaches one of them.
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, (
                f"named KV chunks live in one router replica's registry and this "
                f"deployment runs {world_size} (router state not shared): run one router "
                "replica to use them"))
        await self._ready(ask=("prefill",))
        await self.shared.sync(chunks=True)
        # An id unique over the replicas: taken in the store before P prefills anything.
        call = wire.chunk_call(request)
        if not call.chunk_id:
            call = dataclasses.replace(call, chunk_id=owned_id(rank, world_size, "chunk"))
        if not await self.shared.reserve_chunk(call.chunk_id):
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                              f"chunk {call.chunk_id!r} exists: delete it first, or pick "
                              "another name")
        try:
            chunk = await self.api.register_chunk(FRONT, call, None)
        except BaseException:
            with contextlib.suppress(RouterError):
                await self.shared.unreserve_chunk(call.chunk_id)
            raise
        held = await self.shared.publish_chunk(chunk.chunk_id)
        if held is not None:  # the share filled through other replicas meanwhile
            await self.api.delete_chunk(chunk.chunk_id)
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"chunk {chunk.chunk_id!r} needs {chunk.num_blocks} blocks and chunks "
                f"registered meanwhile hold {held} of its P's share: retry"))
        return wire.chunk_to_pb(chunk)

    async def ListChunks(self, request: router_pb2.ListChunksRequest,  # noqa: N802
                         grpc_context: Any = None) -> router_pb2.ListChunksResponse:
        async def listing():
            await self.shared.sync(chunks=True)
            return wire.chunks_to_pb(self.api.chunks())
        return await self._unary(grpc_context, listing(), OPERATOR)

    async def DeleteChunk(self, request: router_pb2.DeleteChunkRequest,  # noqa: N802
                          grpc_context: Any = None) -> router_pb2.DeleteChunkResponse:
        async def delete():
            await self.shared.sync(chunks=True)
            deleted = await self.api.delete_chunk(request.chunk_id)
            await self.shared.flush()
            return wire.deleted_to_pb(deleted)
        return await self._unary(grpc_context, delete(), OPERATOR)

    async def Drain(self, request: router_pb2.DrainRequest,  # noqa: N802
                    grpc_context: Any = None) -> router_pb2.DrainResponse:
        return await self._unary(grpc_context, self._drain(request), OPERATOR)

    async def _drain(self, request: router_pb2.DrainRequest) -> router_pb2.DrainResponse:
        _, world_size = self._rank()
        if world_size > 1 and not self.shared.enabled:
            # Rotation is each replica's own, and a call reaches one of them.
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, (
                f"Drain takes an engine out of one router replica's rotation and this "
                f"deployment runs {world_size} (router state not shared): drain engine "
                "replicas through Serve (lower the role's num_replicas; a replica stops "
                "after finishing its requests, within graceful_shutdown_timeout_s)"))
        await self.shared.sync()
        # The drain is in the store when the rotation changes (sent, in order): every
        # replica reads it before its next call. This replica waits for its own requests.
        drained = await self.api.drain(request.endpoint, request.timeout_ms, request.undo)
        await self.shared.flush()
        return wire.drained_to_pb(drained)

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

"""``ReplicaAPI``: :class:`~router.api.RouterAPI` as a Router replica of the Serve
application runs it, under both of the replica's fronts (``kvhandoff.v1.Router`` through
Serve's gRPC proxy, the OpenAI-compatible HTTP front through Serve's HTTP proxy:
``deploy.router_server``). Each call is the standalone router's, with what a replica
adds around it, written here once for both fronts:

- the engines checked once (P and D run the same model, vLLM and block size) and asked
  for a snapshot when the call needs one (no poller runs in a replica), and the beam
  width checked against the deployment's;
- the state the replicas share (``deploy.shared``) read before the call (the drained
  engines, the parent named, the chunks) and, where another replica must see the result
  before the client does, written and waited for after it (a parent, a chunk, a
  release, a deletion, a drain);
- a new chunk's id made unique over the replicas and reserved in the store before P
  prefills anything.

The admission (``max_inflight``) and the counts stay the base class's: one guard per
replica over both fronts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from deploy.affinity import owned_id
from deploy.shared import SharedState
from kvhandoff.types import check_beam_width
from router.api import RouterAPI
from router.auth import Credentials
from router.errors import RouterError
from router.requests import (
    BeamsCall,
    Chunk,
    ChunkCall,
    ChunkListing,
    ContinueCall,
    Drained,
    GenerateCall,
    Parent,
    ParentCall,
    Released,
    Result,
    TokenBatch,
)

Rank = Callable[[], tuple[int, int]]


class ReplicaAPI(RouterAPI):
    """See the module docstring. Built by ``RouterAPI.over_stubs`` with the keywords
    ``shared`` (this replica's side of the store), ``engines`` (the Prefill and Decode
    deployment handles, for the engines' ``info``), ``max_beam_width`` and ``rank``
    (this replica's rank and the deployment's replicas, read each time: Serve sets them,
    and a scaled deployment changes the second)."""

    def __init__(self, router: Any, metrics: Any = None,
                 credentials: Credentials | None = None, *, shared: SharedState,
                 engines: tuple[Any, Any], max_beam_width: int, rank: Rank):
        # ``router`` and ``metrics``: the base class's (a router.core.Router and its
        # RouterMetrics, which this front may not import: pyproject's contract).
        super().__init__(router, metrics, credentials)
        self.shared, self._engines = shared, engines
        self.max_beam_width, self._rank = max_beam_width, rank
        self._checked = False

    async def ready(self, beam_width: int | None = None, ask: tuple[str, ...] = (),
                    unless_one_answered: bool = False) -> None:
        """Once: P and D run the same model, vLLM and block size. Then: the beam width
        is one this deployment takes, and the engines of roles ``ask`` without a
        snapshot are asked now (``RouterAPI.ask_engines``)."""
        if not self._checked:
            p, d = await asyncio.gather(*(e.info.remote() for e in self._engines))
            for key in ("vllm_version", "model_fingerprint", "block_size"):
                if p[key] != d[key]:
                    raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"P and D differ in {key}: {p[key]} vs {d[key]}")
            self._checked = True
        if beam_width is not None:
            check_beam_width(beam_width, self.max_beam_width, "this deployment")
        if ask:
            await self.ask_engines(ask, unless_one_answered)

    # ---- requests ---------------------------------------------------------------------
    async def generate(self, front: str, request: GenerateCall, deadline: float | None
                       ) -> AsyncIterator[TokenBatch | Result]:
        await self.ready(request.beam.beam_width, ask=("prefill",), unless_one_answered=True)
        await self.shared.sync(chunks=bool(request.chunk_ids))
        async with contextlib.aclosing(super().generate(front, request, deadline)) as items:
            async for item in items:
                yield item

    async def start_parent(self, front: str, request: ParentCall, deadline: float | None
                           ) -> AsyncIterator[TokenBatch | Parent]:
        # Every engine: without a D's snapshot the parent would not be held.
        await self.ready(ask=("prefill", "decode"))
        await self.shared.sync(chunks=bool(request.chunk_ids))
        async with contextlib.aclosing(super().start_parent(front, request, deadline)
                                       ) as items:
            async for item in items:
                if isinstance(item, Parent):  # shared before its client hears of it
                    await self.shared.publish_parent(item.parent_id)
                yield item

    async def continue_(self, front: str, request: ContinueCall,
                        deadline: float | None) -> Result:
        # Every engine: the parent may be another replica's, on engines not asked here yet.
        await self.ready(request.beam.beam_width, ask=("prefill", "decode"))
        await self.shared.sync(parent_id=request.parent_id)
        return await super().continue_(front, request, deadline)

    async def prompt_beams(self, front: str, request: BeamsCall,
                           deadline: float | None) -> Result:
        await self.ready(request.beam.beam_width, ask=("decode",))
        await self.shared.sync()
        return await super().prompt_beams(front, request, deadline)

    async def release_parent(self, parent_id: str) -> Released:
        await self.shared.sync(parent_id=parent_id)
        released = await super().release_parent(parent_id)
        await self.shared.flush()  # dropped from the store: no replica continues it
        return released

    # ---- named KV chunks ----------------------------------------------------------------
    async def register_chunk(self, front: str, request: ChunkCall,
                             deadline: float | None) -> Chunk:
        rank, world_size = self._rank()
        if world_size > 1 and not self.shared.enabled:
            # A chunk's registry is one router replica's, and a call reaches one of them.
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, (
                f"named KV chunks live in one router replica's registry and this "
                f"deployment runs {world_size} (router state not shared): run one router "
                "replica to use them"))
        await self.ready(ask=("prefill",))
        await self.shared.sync(chunks=True)
        # An id unique over the replicas: taken in the store before P prefills anything.
        if not request.chunk_id:
            request = dataclasses.replace(request,
                                          chunk_id=owned_id(rank, world_size, "chunk"))
        if not await self.shared.reserve_chunk(request.chunk_id):
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS,
                              f"chunk {request.chunk_id!r} exists: delete it first, or pick "
                              "another name")
        try:
            chunk = await super().register_chunk(front, request, deadline)
        except BaseException:
            with contextlib.suppress(RouterError):
                await self.shared.unreserve_chunk(request.chunk_id)
            raise
        held = await self.shared.publish_chunk(chunk.chunk_id)
        if held is not None:  # the share filled through other replicas meanwhile
            await super().delete_chunk(chunk.chunk_id)
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"chunk {chunk.chunk_id!r} needs {chunk.num_blocks} blocks and chunks "
                f"registered meanwhile hold {held} of its P's share: retry"))
        return chunk

    async def chunks(self) -> ChunkListing:
        await self.shared.sync(chunks=True)
        return await super().chunks()

    async def delete_chunk(self, chunk_id: str) -> list[str]:
        await self.shared.sync(chunks=True)
        deleted = await super().delete_chunk(chunk_id)
        await self.shared.flush()
        return deleted

    # ---- control calls ------------------------------------------------------------------
    async def drain(self, endpoint: str, timeout_ms: int = 0, undo: bool = False) -> Drained:
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
        drained = await super().drain(endpoint, timeout_ms, undo)
        await self.shared.flush()
        return drained

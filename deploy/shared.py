"""A Router replica's side of the shared router state (``deploy.state``).

Its registries (:class:`SharedParents`, :class:`SharedChunks`, :class:`SharedRotation`)
are the router core's stores: the core's synchronous interfaces, answered from this
process (the *mirror*), and what they change is sent to the store without waiting (a Ray
actor runs one caller's calls in the order sent, so a later call of this replica finds
them there). :class:`SharedState` is the async part, run by the Serve front around the
core's call: before it, :meth:`SharedState.sync` reads the store (drained engines, the
parent named, the chunks) into the mirror; after it, what must be in the store before
the client hears of it is written and waited for (a parent, a chunk, a release, a
drain). A store that cannot be reached fails the call UNAVAILABLE, retryable.

What each replica holds: the parents it started and those it fetched (a record fetched is
a copy: use counts and the P-share bookkeeping of holds stay with the replica that ran
stage 1), every registered chunk as of its last chunk call, the drained engines as of its
last call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc
import ray
from ray.exceptions import RayActorError

from deploy.state import (
    NAME,
    RouterState,
    chunk_bytes,
    chunk_of,
    namespace,
    parent_bytes,
    parent_of,
)
from router.chunk_registry import ChunkRecord, ChunkRegistry
from router.config import RouterConfig
from router.endpoint import Endpoint
from router.errors import RouterError
from router.parents import ParentRecord, ParentRegistry, ParentState
from router.rotation import LocalRotation

logger = logging.getLogger("kvhandoff.deploy")

#: A store call that takes longer (the actor restarting, its node gone) fails UNAVAILABLE.
CALL_TIMEOUT_S = 10.0

Send = Callable[..., None]


def _unavailable(why: str) -> RouterError:
    return RouterError(grpc.StatusCode.UNAVAILABLE,
                       f"the router state shared by the Router replicas is unavailable "
                       f"({why}): retry")


class SharedParents(ParentRegistry):
    """This replica's parents. A parent forgotten here (released, failed) is dropped
    from the store; one whose hold ended early is written again (not held)."""

    def __init__(self, config: RouterConfig, send: Send):
        super().__init__(config.max_parents, config.parent_ttl_s, config.parent_pool_share)
        self._send = send
        #: Started here and not yet in the store: kept whatever the store says.
        self.unpublished: set[str] = set()

    def add(self, record: ParentRecord) -> None:
        super().add(record)
        self.unpublished.add(record.parent_id)

    def discard(self, parent_id: str) -> None:
        super().discard(parent_id)
        self.unpublished.discard(parent_id)
        self._send("drop_parent", parent_id)

    def unhold(self, record: ParentRecord) -> None:
        super().unhold(record)
        if record.state is ParentState.NOT_HELD and record.parent_id not in self.unpublished:
            self._send("put_parent", record.parent_id, parent_bytes(record))

    def local(self, parent_id: str) -> ParentRecord | None:
        return self._records.get(parent_id)

    def published(self) -> dict[str, bytes]:
        """What this replica writes back to a rebuilding store."""
        return {pid: parent_bytes(r) for pid, r in self._records.items()
                if r.done.is_set() and r.state is not ParentState.FAILED}

    def take(self, parent_id: str, data: bytes | None,
             find: Callable[[str], Endpoint | None]) -> None:
        """The store's word on ``parent_id`` (None: it has none) into the mirror. A record
        of this replica's stays as it is (live: a stage 1 or continuations running)."""
        local = self._records.get(parent_id)
        if data is None:
            if (local is not None and parent_id not in self.unpublished
                    and local.done.is_set() and not local.in_use):
                super().discard(parent_id)  # released or forgotten through another replica
        elif local is None:
            self._records[parent_id] = parent_of(data, find)


class SharedChunks(ChunkRegistry):
    """This replica's chunks. Chunks forgotten here (deleted, evicted, a failed
    registration) are dropped from the store."""

    def __init__(self, send: Send):
        super().__init__()
        self._send = send
        #: Registered here and not yet in the store: kept whatever the store says.
        self.unpublished: set[str] = set()

    def forget(self, records: list[ChunkRecord]) -> None:
        super().forget(records)
        self._send("drop_chunks", [r.chunk_id for r in records])

    def published(self) -> list[tuple[str, bytes, str, str, int]]:
        return [entry(r) for r in self.values() if r.ready]

    def take_all(self, data: list[bytes], find: Callable[[str], Endpoint | None]) -> None:
        """The store's chunks (in registration order: a chunk after the one it is under)
        into the mirror; ready chunks the store no longer has are forgotten here."""
        kept = set()
        for d in data:
            record = chunk_of(d, find)
            if record is None:
                continue
            kept.add(record.chunk_id)
            if record.chunk_id not in self:
                ChunkRegistry.add(self, record)
        gone = [r for r in self.values() if r.ready and r.chunk_id not in kept
                and r.chunk_id not in self.unpublished and not r.in_use]
        ChunkRegistry.forget(self, gone)


def entry(r: ChunkRecord) -> tuple[str, bytes, str, str, int]:
    """A chunk as ``RouterState.rebuild`` takes it."""
    return r.chunk_id, chunk_bytes(r), r.prefill.address, r.engine_id, r.num_blocks


class SharedRotation(LocalRotation):
    """Drains, on this replica's endpoints, sent to the store; the store's set is
    written on them before each call (:meth:`apply`)."""

    def __init__(self, endpoints: list[Endpoint], send: Send):
        self.endpoints, self._send = endpoints, send

    def drain(self, ep: Endpoint) -> None:
        super().drain(ep)
        self._send("set_drained", ep.address, True)

    def undo(self, ep: Endpoint) -> None:
        super().undo(ep)
        self._send("set_drained", ep.address, False)

    def apply(self, drained: list[str]) -> None:
        for ep in self.endpoints:
            ep.draining = ep.address in drained

    def drained(self) -> list[str]:
        return [ep.address for ep in self.endpoints if ep.draining]


class SharedState:
    """The store as one Router replica uses it. ``enabled`` False: the replica's own
    registries alone, as with one replica (what the tests' controls run)."""

    def __init__(self, app_name: str, config: RouterConfig,
                 rank: Callable[[], tuple[int, int]]):
        self.app_name, self.config, self._rank = app_name, config, rank
        self.enabled = True
        self.parents = SharedParents(config, self._send)
        self.chunks = SharedChunks(self._send)
        self.rotation = SharedRotation([], self._send)
        self._find: Callable[[str], Endpoint | None] = lambda address: None
        self._handle: Any = None
        #: The store's epoch this replica's mirror was last written back to.
        self._epoch: str | None = None

    def stores(self, prefill: Endpoint, decode: Endpoint) -> dict[str, Any]:
        """The router core's stores, over its two endpoints (``RouterAPI.over_stubs``)."""
        by_address = {ep.address: ep for ep in (prefill, decode)}
        self._find = by_address.get
        self.rotation.endpoints = [prefill, decode]
        return {"parents": self.parents, "chunk_store": self.chunks,
                "rotation": self.rotation}

    # ---- the actor ----------------------------------------------------------------------
    def _actor(self) -> Any:
        if self._handle is None:
            # Created by the first replica that needs it, found by the others; detached,
            # so it outlives every replica; restarted by Ray (then rebuilt) when it dies.
            # Placed on the head node (Ray's own resource naming it): the cluster's state
            # lives there already, and an engine or router node lost must not take the
            # store with it (seen in tests/test_ray_serve_two_nodes.py, D's node killed,
            # the store on it). A nominal share of that resource: it only places.
            self._handle = ray.remote(RouterState).options(
                name=NAME, namespace=namespace(self.app_name), lifetime="detached",
                get_if_exists=True, max_restarts=-1, num_cpus=0,
                resources={"node:__internal_head__": 0.001},
            ).remote(self.config.max_parents, self.config.parent_ttl_s,
                     rebuilding=True if self._epoch is not None else None)
        return self._handle

    def _send(self, method: str, *args: Any) -> None:
        """A write this replica does not wait for (a lost one is repaired by the rebuild,
        which writes this mirror back)."""
        if self.enabled and self._handle is not None:
            getattr(self._handle, method).remote(*args)

    async def call(self, method: str, *args: Any) -> Any:
        try:
            ref = getattr(self._actor(), method).remote(*args)
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), CALL_TIMEOUT_S)
        except (RayActorError, TimeoutError) as e:
            self._handle = None  # found (or made) again by the next call
            raise _unavailable(f"{type(e).__name__}: {e}"[:300]) from None

    # ---- around a call ------------------------------------------------------------------
    async def sync(self, parent_id: str = "", chunks: bool = False) -> None:
        """The store into the mirror before a call: drained engines, the parent named,
        every chunk (with ``chunks``). A store that restarted gets this mirror first; one
        still rebuilding cannot say a parent or a chunk is unknown: UNAVAILABLE."""
        if not self.enabled:
            return
        rank, world_size = self._rank()
        view = await self.call("view", rank, world_size, parent_id, chunks)
        if view["epoch"] != self._epoch:
            logger.info("router state %s: writing this replica's mirror back", view["epoch"])
            self._epoch = await self.call("rebuild", rank, self.parents.published(),
                                          self.chunks.published(), self.rotation.drained())
            view = await self.call("view", rank, world_size, parent_id, chunks)
        self.rotation.apply(view["drained"])
        if parent_id:
            if view["parent"] is None and view["rebuilding"]:
                raise _unavailable("restarted, and rebuilding from the Router replicas")
            self.parents.take(parent_id, view["parent"], self._find)
        if chunks:
            if view["rebuilding"]:
                raise _unavailable("restarted, and rebuilding from the Router replicas")
            self.chunks.take_all(view["chunks"], self._find)

    async def publish_parent(self, parent_id: str) -> None:
        """A parent whose stage 1 ended here, in the store before its client hears of it."""
        record = self.parents.local(parent_id)
        if not self.enabled or record is None or record.state is ParentState.FAILED:
            return
        await self.call("put_parent", parent_id, parent_bytes(record))
        self.parents.unpublished.discard(parent_id)

    async def reserve_chunk(self, chunk_id: str) -> bool:
        """Take ``chunk_id`` for a registration here (False: taken)."""
        if not self.enabled:
            return True
        if not await self.call("reserve_chunk", chunk_id):
            return False
        self.chunks.unpublished.add(chunk_id)
        return True

    async def publish_chunk(self, chunk_id: str) -> int | None:
        """A chunk registered here, in the store (None), unless the chunks registered
        meanwhile through other replicas fill its P's share: then the blocks they hold
        (the caller deletes it)."""
        if not self.enabled:
            return None
        self.chunks.unpublished.discard(chunk_id)
        record = self.chunks.find(chunk_id)
        if record is None:  # deleted or evicted meanwhile
            await self.call("drop_chunks", [chunk_id])
            return None
        _, data, where, engine_id, num_blocks = entry(record)
        cap = record.prefill.capacity
        share = int(cap.num_total_blocks * self.config.chunk_pool_share) if cap else 0
        return await self.call("put_chunk", chunk_id, data, where, engine_id, num_blocks,
                               share)

    async def unreserve_chunk(self, chunk_id: str) -> None:
        self.chunks.unpublished.discard(chunk_id)
        if self.enabled:
            await self.call("drop_chunks", [chunk_id])

    async def flush(self) -> None:
        """Returns once the writes sent before it are in the store."""
        if self.enabled:
            await self.call("ping")

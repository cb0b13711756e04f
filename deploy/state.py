"""The router state every Router replica of one Serve application shares: parents, named
KV chunks and drained engines, in one named, detached Ray actor (:class:`RouterState`)
that outlives any Router replica.

The actor keeps records as the replicas wrote them (opaque bytes: :func:`parent_bytes`,
:func:`chunk_bytes`; a parent's handoff inside as P's serialised ``Handoff``) and never
imports the router. Its methods run one at a time (a plain actor), so each is atomic:
the check-then-write steps that a race between replicas could get wrong are one call
each (``reserve_chunk``: a chunk id taken once; ``put_chunk``: the chunk counted
against its P's share only if it still fits).

A replica's own registries (``deploy.shared``) are its mirror: what it wrote and what it
fetched. When the actor starts again (Ray restarts it, or a replica creates it anew
after it was killed for good), it is empty and *rebuilding*: each replica that reaches it
writes its mirror back (``rebuild``), and until every rank of the deployment has done so
(or ``REBUILD_GRACE_S`` passed) a lookup it cannot answer says "rebuilding", which the
replica turns into UNAVAILABLE (retryable), never NOT_FOUND.
"""

from __future__ import annotations

import collections
import pickle
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvhandoff.v1 import common_pb2
from router.chunk_registry import ChunkRecord
from router.endpoint import Endpoint
from router.parents import ParentRecord, ParentState

#: The actor's name in its namespace (one namespace per application: :func:`namespace`).
NAME = "RouterState"
#: How long a restarted store waits for replicas that never write their mirror back.
REBUILD_GRACE_S = 30.0
#: A chunk id reserved by a registration that never finished (its replica died).
RESERVATION_S = 600.0


def namespace(app_name: str) -> str:
    return f"kvhandoff-state-{app_name}"


# ---- records as bytes (one writer and one reader each) --------------------------------
_PARENT_FIELDS = ("parent_id", "model", "prompt_ids", "adapter", "prefill",
                  "prefill_engine_id", "local", "held_until", "thinking_ids", "stage1",
                  "thinking_logprobs", "finish_reason", "approximation", "model_fingerprint",
                  "not_held_reason", "num_blocks", "stage1_ms", "error")
_CHUNK_FIELDS = ("chunk_id", "under", "token_ids", "chain_ids", "adapter", "engine_id",
                 "held_name", "num_blocks", "uses", "last_used", "prefill_ms",
                 "num_cached_tokens")


def parent_bytes(r: ParentRecord) -> bytes:
    """A finished parent as the store keeps it: its engines by address."""
    assert r.state is not ParentState.RUNNING, f"parent {r.parent_id} written while running"
    return pickle.dumps({
        **{f: getattr(r, f) for f in _PARENT_FIELDS}, "state": r.state.value,
        "decode": r.decode.address if r.decode is not None else None,
        "prefill_ep": r.prefill_ep.address if r.prefill_ep is not None else None,
        "handoff": r.handoff.SerializeToString() if r.handoff is not None else None})


def parent_of(data: bytes, find: Callable[[str], Endpoint | None]) -> ParentRecord:
    """A parent another replica wrote, in the state it wrote (its stage 1 ended), over
    this replica's endpoints (``find``: by address)."""
    d = pickle.loads(data)
    record = ParentRecord(
        **{f: d[f] for f in _PARENT_FIELDS}, state=ParentState(d["state"]),
        decode=find(d["decode"]) if d["decode"] else None,
        prefill_ep=find(d["prefill_ep"]) if d["prefill_ep"] else None,
        handoff=common_pb2.Handoff.FromString(d["handoff"]) if d["handoff"] else None)
    record.done.set()
    return record


def chunk_bytes(r: ChunkRecord) -> bytes:
    """A registered (ready) chunk as the store keeps it: its P by address."""
    assert r.ready, f"chunk {r.chunk_id} written before P holds it"
    return pickle.dumps({**{f: getattr(r, f) for f in _CHUNK_FIELDS},
                         "prefill": r.prefill.address})


def chunk_of(data: bytes, find: Callable[[str], Endpoint | None]) -> ChunkRecord | None:
    """A chunk another replica registered (None: its P is not one of this replica's)."""
    d = pickle.loads(data)
    prefill = find(d.pop("prefill"))
    if prefill is None:
        return None
    return ChunkRecord(**d, prefill=prefill, ready=True)


# ---- the actor ------------------------------------------------------------------------
class RouterState:
    """The shared records. Made a Ray actor by ``deploy.shared`` (named, detached,
    restarted by Ray when it dies); every method answers at once."""

    def __init__(self, max_parents: int, parent_ttl_s: float,
                 rebuilding: bool | None = None):
        """``rebuilding`` None: when Ray restarted this actor (a replica that makes it
        anew after the last one was killed for good passes True)."""
        #: Changes with every start: a replica that sees a new one writes its mirror back.
        self.epoch = uuid.uuid4().hex
        self.max_parents, self.parent_ttl_s = max_parents, parent_ttl_s
        self.started = time.monotonic()
        if rebuilding is None:
            import ray  # in the actor only: the replicas import this module too

            rebuilding = ray.get_runtime_context().was_current_actor_reconstructed
        #: Rebuilding after a restart (Ray's, or a replica's after it was killed).
        self.rebuilding = rebuilding
        self.reported: set[int] = set()
        #: parent id -> (bytes, last touched as time.monotonic()), least recent first.
        self.parents: collections.OrderedDict[str, tuple[bytes, float]] = \
            collections.OrderedDict()
        #: chunk id -> (bytes, P address, engine id, blocks); None while reserved.
        self.chunks: dict[str, tuple[bytes, str, str, int] | None] = {}
        self.reserved_at: dict[str, float] = {}
        self.drained: set[str] = set()

    def _is_rebuilding(self, world_size: int) -> bool:
        if self.rebuilding and (set(range(world_size)) <= self.reported
                                or time.monotonic() - self.started > REBUILD_GRACE_S):
            self.rebuilding = False
        return self.rebuilding

    def _sweep(self) -> None:
        oldest = time.monotonic() - self.parent_ttl_s
        while self.parents and (len(self.parents) > self.max_parents
                                or next(iter(self.parents.values()))[1] < oldest):
            self.parents.popitem(last=False)
        now = time.monotonic()
        for cid in [c for c, t in self.reserved_at.items() if t + RESERVATION_S < now]:
            self.reserved_at.pop(cid)
            if self.chunks.get(cid) is None:
                self.chunks.pop(cid, None)

    def view(self, rank: int, world_size: int, parent_id: str = "",
             chunks: bool = False) -> dict[str, Any]:
        """What a replica reads before a call: the epoch, the drained engines, whether
        the store is rebuilding, the parent named (None: none) and every registered
        chunk (with ``chunks``), in the order they were registered."""
        self._sweep()
        parent = None
        if parent_id and parent_id in self.parents:
            parent = self.parents[parent_id][0]
            self.parents[parent_id] = (parent, time.monotonic())
            self.parents.move_to_end(parent_id)
        return {"epoch": self.epoch, "drained": sorted(self.drained),
                "rebuilding": self._is_rebuilding(world_size), "parent": parent,
                "chunks": [v[0] for v in self.chunks.values() if v is not None]
                if chunks else None}

    def rebuild(self, rank: int, parents: dict[str, bytes],
                chunks: list[tuple[str, bytes, str, str, int]], drained: list[str]) -> str:
        """Replica ``rank`` writes back its mirror (after a restart; at its first call
        otherwise: then it has none). Records already here are kept."""
        now = time.monotonic()
        for pid, data in parents.items():
            self.parents.setdefault(pid, (data, now))
        for cid, data, where, engine_id, blocks in chunks:
            if self.chunks.get(cid) is None:
                self.chunks[cid] = (data, where, engine_id, blocks)
        self.drained |= set(drained)
        self.reported.add(rank)
        return self.epoch

    def put_parent(self, parent_id: str, data: bytes) -> None:
        self.parents[parent_id] = (data, time.monotonic())
        self.parents.move_to_end(parent_id)
        self._sweep()

    def drop_parent(self, parent_id: str) -> None:
        self.parents.pop(parent_id, None)

    def reserve_chunk(self, chunk_id: str) -> bool:
        """Take ``chunk_id`` for a registration (False: registered or being registered
        through some replica)."""
        self._sweep()
        if chunk_id in self.chunks:
            return False
        self.chunks[chunk_id] = None
        self.reserved_at[chunk_id] = time.monotonic()
        return True

    def put_chunk(self, chunk_id: str, data: bytes, where: str, engine_id: str,
                  num_blocks: int, share: int) -> int | None:
        """Keep a registered chunk, reserved before, if the chunks on its P engine
        (``where``, ``engine_id``) still fit in ``share`` blocks with it (None); else
        the blocks the others hold there, and the reservation is dropped."""
        held = sum(v[3] for c, v in self.chunks.items()
                   if v is not None and c != chunk_id and v[1:3] == (where, engine_id))
        if share and held + num_blocks > share:
            self.drop_chunks([chunk_id])
            return held
        self.chunks[chunk_id] = (data, where, engine_id, num_blocks)
        self.reserved_at.pop(chunk_id, None)
        return None

    def drop_chunks(self, chunk_ids: list[str]) -> None:
        for cid in chunk_ids:
            self.chunks.pop(cid, None)
            self.reserved_at.pop(cid, None)

    def set_drained(self, address: str, drained: bool) -> None:
        (self.drained.add if drained else self.drained.discard)(address)

    def ping(self) -> str:
        return self.epoch

"""The router state Serve's Router replicas share (``deploy.state``, ``deploy.shared``),
without a Ray cluster: the store actor's class called in process, two replicas' mirrors
over it. The same on Ray, through Serve's proxy: tests/test_serve_state.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

import grpc
import pytest
from ray.exceptions import RayActorError

from deploy.shared import SharedState
from deploy.state import RouterState, chunk_bytes, chunk_of, parent_bytes, parent_of
from kvhandoff.types import Stage1Params, TokenLogprob
from kvhandoff.v1 import common_pb2, engine_pb2
from router.chunk_registry import ChunkRecord
from router.config import RouterConfig
from router.endpoint import Endpoint
from router.errors import RouterError
from router.parents import ParentRecord, ParentState

CONFIG = RouterConfig(prefill=("serve:Prefill",), decode=("serve:Decode",), model="builtin")


class _Ref:
    def __init__(self, fn, args):
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            self._future.set_result(fn(*args))
        except Exception as e:
            self._future.set_exception(e)

    def future(self) -> concurrent.futures.Future:
        return self._future


class _Handle:
    """A Ray actor handle over a RouterState in this process (calls run at once, in
    order, as a plain actor runs one caller's); ``dead``: every call fails as Ray's
    do when the actor died."""

    def __init__(self, state: RouterState):
        self.state, self.dead = state, False

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _Method:
            @staticmethod
            def remote(*args):
                if handle.dead:
                    raise RayActorError()
                return _Ref(getattr(handle.state, method), args)
        return _Method


def _endpoints() -> tuple[Endpoint, Endpoint]:
    p = Endpoint("serve:Prefill", None, None, one_engine=False,
                 capacity=engine_pb2.Capacity(num_total_blocks=400, block_size=16))
    d = Endpoint("serve:Decode", None, None, one_engine=False,
                 capacity=engine_pb2.Capacity(num_total_blocks=400, block_size=16))
    return p, d


def _replica(handle: _Handle, rank: int, world_size: int = 2) -> tuple[SharedState, Any]:
    shared = SharedState("app", CONFIG, lambda: (rank, world_size))
    p, d = _endpoints()
    stores = shared.stores(p, d)
    shared._actor = lambda: handle  # noqa: SLF001 (the test's actor)
    shared._handle = handle  # noqa: SLF001
    asyncio.run(shared.sync())  # a replica's first call (its health check)
    return shared, {"stores": stores, "p": p, "d": d}


def _parent(p: Endpoint, d: Endpoint, parent_id: str = "par-1") -> ParentRecord:
    record = ParentRecord(parent_id, "builtin", [5, 6, 7], prefill=p.address, prefill_ep=p,
                          decode=d, stage1=Stage1Params(max_tokens=4, seed=3),
                          thinking_logprobs=[TokenLogprob(9, -0.5)])
    record.thinking_ids, record.prefill_engine_id = [9, 10], "p-engine-1"
    record.handoff = common_pb2.Handoff(request_id=f"{parent_id}-s1", num_blocks=2,
                                        lease_expires_at=time.time() + 60)
    record.held_until, record.num_blocks = record.handoff.lease_expires_at, 2
    return record


def test_a_parent_and_a_chunk_cross_as_bytes_over_the_other_replicas_endpoints():
    p, d = _endpoints()
    record = _parent(p, d)
    record.enter(ParentState.HELD)
    p2, d2 = _endpoints()
    find = {"serve:Prefill": p2, "serve:Decode": d2}.get
    copy = parent_of(parent_bytes(record), find)
    assert copy.prefill_ep is p2 and copy.decode is d2 and copy.done.is_set()
    assert copy.handoff == record.handoff and copy.state is ParentState.HELD
    assert (copy.thinking_ids, copy.stage1, copy.thinking_logprobs, copy.held) == \
        (record.thinking_ids, record.stage1, record.thinking_logprobs, True)
    chunk = ChunkRecord("sys", "", [1, 2], [1, 2], "", p, engine_id="e", held_name="h",
                        num_blocks=1, ready=True)
    again = chunk_of(chunk_bytes(chunk), find)
    assert again is not None and again.prefill is p2 and again.ready
    assert (again.chain_ids, again.held_name, again.engine_id) == ([1, 2], "h", "e")
    with pytest.raises(AssertionError, match="while running"):
        parent_bytes(_parent(p, d))  # a running parent is never written


def test_a_parent_started_on_one_replica_is_continued_through_the_other():
    """STEP 1: replica 0 runs a parent's stage 1 and publishes it. STEP 2: replica 1
    (empty mirror, as one Serve just started) reads it before the continuation, with its
    handoff, over its own endpoints. STEP 3: released through replica 1: replica 0's
    copy goes at its next read. Control: not shared, replica 1 never sees it."""
    handle = _Handle(RouterState(16, 300.0, rebuilding=False))
    a, ea = _replica(handle, 0)
    b, eb = _replica(handle, 1)
    record = _parent(ea["p"], ea["d"])
    ea["stores"]["parents"].add(record)  # STEP 1
    record.enter(ParentState.HELD)
    asyncio.run(a.publish_parent("par-1"))
    asyncio.run(b.sync(parent_id="par-1"))  # STEP 2
    got = eb["stores"]["parents"].get("par-1")
    assert got is not None and got.decode is eb["d"] and got.handoff == record.handoff
    assert not got.why_not_importable()
    eb["stores"]["parents"].discard("par-1")  # STEP 3 (what release_parent does)
    asyncio.run(a.sync(parent_id="par-1"))
    assert ea["stores"]["parents"].get("par-1") is None
    c, ec = _replica(handle, 1)  # the control
    c.enabled = False
    asyncio.run(c.sync(parent_id="par-1"))
    assert ec["stores"]["parents"].get("par-1") is None


def test_a_running_parent_is_kept_by_its_replica_whatever_the_store_says():
    handle = _Handle(RouterState(16, 300.0, rebuilding=False))
    a, ea = _replica(handle, 0)
    record = _parent(ea["p"], ea["d"])
    ea["stores"]["parents"].add(record)
    asyncio.run(a.sync(parent_id="par-1"))  # the store has none yet: still ours
    record.enter(ParentState.HELD)
    asyncio.run(a.sync(parent_id="par-1"))  # ended, not yet published: still ours
    assert ea["stores"]["parents"].get("par-1") is record


def test_a_drain_through_one_replica_is_seen_by_the_other_at_its_next_call():
    handle = _Handle(RouterState(16, 300.0, rebuilding=False))
    a, ea = _replica(handle, 0)
    b, eb = _replica(handle, 1)
    asyncio.run(a.sync())
    ea["stores"]["rotation"].drain(ea["d"])
    asyncio.run(b.sync())
    assert eb["d"].draining and not eb["d"].takes_work and not eb["p"].draining
    ea["stores"]["rotation"].undo(ea["d"])
    asyncio.run(b.sync())
    assert not eb["d"].draining
    b.enabled = False  # the control: not shared, replica 1 never sees the drain
    ea["stores"]["rotation"].drain(ea["d"])
    asyncio.run(b.sync())
    assert not eb["d"].draining


def test_chunks_ids_are_taken_once_and_the_share_is_counted_over_replicas():
    state = RouterState(16, 300.0, rebuilding=False)
    assert state.reserve_chunk("sys") and not state.reserve_chunk("sys")
    assert state.put_chunk("sys", b"x", "serve:Prefill", "e1", 60, 100) is None
    assert state.reserve_chunk("more")
    # 60 + 50 > 100 on the same engine: refused with what the others hold, id free again.
    assert state.put_chunk("more", b"y", "serve:Prefill", "e1", 50, 100) == 60
    assert state.reserve_chunk("more")
    assert state.put_chunk("more", b"y", "serve:Prefill", "e2", 50, 100) is None
    assert state.view(0, 1, chunks=True)["chunks"] == [b"x", b"y"]


def test_a_chunk_registered_through_one_replica_is_composed_through_the_other():
    handle = _Handle(RouterState(16, 300.0, rebuilding=False))
    a, ea = _replica(handle, 0)
    b, eb = _replica(handle, 1)
    assert asyncio.run(a.reserve_chunk("sys"))
    assert not asyncio.run(b.reserve_chunk("sys"))
    chunk = ChunkRecord("sys", "", [1, 2], [1, 2], "", ea["p"], engine_id="e",
                        held_name="h", num_blocks=1)
    ea["stores"]["chunk_store"].add(chunk)
    chunk.ready = True
    asyncio.run(b.sync(chunks=True))  # registered, not published yet: not there
    assert "sys" not in eb["stores"]["chunk_store"]
    assert asyncio.run(a.publish_chunk("sys")) is None
    asyncio.run(b.sync(chunks=True))
    got = eb["stores"]["chunk_store"].find("sys")
    assert got is not None and got.prefill is eb["p"] and got.ready
    eb["stores"]["chunk_store"].forget([got])  # deleted through replica 1
    asyncio.run(a.sync(chunks=True))
    assert "sys" not in ea["stores"]["chunk_store"]


def test_a_store_gone_is_unavailable_and_a_new_one_is_rebuilt_from_the_mirrors():
    """STEP 1: the store dies: a call that reads it fails UNAVAILABLE (retryable), with
    the reason. STEP 2: a new, empty store (rebuilding: the next replica makes it so) gets
    each replica's mirror at its next call; until both ranks wrote theirs, a parent it
    does not know is UNAVAILABLE, not NOT_FOUND. STEP 3: the parent replica 0 held is
    continued through replica 1. Control: a new store that does not wait for the
    replicas answers replica 1 "unknown" (what NOT_FOUND would say)."""
    handle = _Handle(RouterState(16, 300.0, rebuilding=False))
    a, ea = _replica(handle, 0)
    b, eb = _replica(handle, 1)
    record = _parent(ea["p"], ea["d"])
    ea["stores"]["parents"].add(record)
    record.enter(ParentState.HELD)
    asyncio.run(a.publish_parent("par-1"))
    asyncio.run(b.sync())
    handle.dead = True  # STEP 1
    with pytest.raises(RouterError) as e:
        asyncio.run(b.sync(parent_id="par-1"))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "RayActorError" in str(e.value)
    handle.state, handle.dead = RouterState(16, 300.0, rebuilding=True), False  # STEP 2
    with pytest.raises(RouterError) as e:
        asyncio.run(b.sync(parent_id="par-1"))
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "rebuilding" in str(e.value)
    asyncio.run(a.sync())
    asyncio.run(b.sync(parent_id="par-1"))  # STEP 3
    assert eb["stores"]["parents"].get("par-1") is not None
    handle.state = RouterState(16, 300.0, rebuilding=False)  # the control
    c, ec = _replica(handle, 1)
    asyncio.run(c.sync(parent_id="par-1"))
    assert ec["stores"]["parents"].get("par-1") is None

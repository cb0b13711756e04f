"""Which router replica owns an id (deploy.affinity) and how Serve is told
(deploy.request_router.OwnerRouter): unit tests with stand-in replicas; the end-to-end
test through two Router replicas is tests/test_ray_serve.py."""

from __future__ import annotations

import asyncio
import collections
import pickle
from types import SimpleNamespace

import pytest

from deploy.affinity import ID_FIELD, owned_id, owner, rendezvous, routing_key
from deploy.request_router import CapacityRouter, OwnerRouter
from kvhandoff.v1 import router_pb2


def _proxy_bytes(message) -> bytes:
    """What Serve's gRPC proxy passes a replica: its pickled gRPCRequest."""
    from ray.serve._private.proxy_request_response import gRPCRequest

    return pickle.dumps(gRPCRequest(user_request_proto=message))


def test_owner_is_stable_and_spreads_ids():
    ranks = collections.Counter(owner(f"parent-{i}", 2) for i in range(400))
    assert set(ranks) == {0, 1} and min(ranks.values()) > 150, ranks
    assert [owner("p-7", 3) for _ in range(5)] == [owner("p-7", 3)] * 5


@pytest.mark.parametrize("method,message,key", [
    ("Continue", router_pb2.ContinueRequest(request_id="c1", parent_id="p1"), "p1"),
    ("ReleaseParent", router_pb2.ReleaseParentRequest(parent_id="p2"), "p2"),
    ("StartParent", router_pb2.ParentRequest(request_id="p3"), "p3"),
    ("Move", router_pb2.MoveRequest(request_id="g4", to_endpoint="x"), "g4"),
    ("GenerateStream", router_pb2.GenerateRequest(request_id="g5"), "g5"),
    ("Generate", router_pb2.GenerateRequest(), ""),  # the router makes an id it owns
    ("Drain", router_pb2.DrainRequest(endpoint="a:1"), ""),
])
def test_the_routing_key_is_the_id_the_call_names(method, message, key):
    assert routing_key(method, [message]) == key  # a handle call
    assert routing_key(method, [_proxy_bytes(message)]) == key  # through the proxy
    assert (method in ID_FIELD) == (method != "Drain")


def test_ids_a_replica_makes_are_its_own():
    for rank in range(3):
        assert all(owner(owned_id(rank, 3), 3) == rank for _ in range(20))
    assert owned_id(0, 1)


def _replicas(*stats):
    return [SimpleNamespace(name=f"replica-{i}", routing_stats=s) for i, s in enumerate(stats)]


def _choose(replicas, method, message, **kwargs):
    pending = SimpleNamespace(metadata=SimpleNamespace(call_method=method),
                              args=[_proxy_bytes(message)] if message else [], kwargs=kwargs)
    return asyncio.run(OwnerRouter.choose_replicas(None, replicas, pending))


def test_a_call_naming_an_id_goes_to_its_owner_only():
    replicas = _replicas({"rank": 1, "world_size": 2}, {"rank": 0, "world_size": 2})
    for i in range(8):
        pid = f"parent-{i}"
        [chosen] = _choose(replicas, "Continue", router_pb2.ContinueRequest(parent_id=pid))
        assert [r.routing_stats["rank"] for r in chosen] == [owner(pid, 2)]
    # Calls naming nothing: any replica, Serve's own order.
    assert _choose(replicas, "Drain", router_pb2.DrainRequest()) == [replicas]
    assert _choose(replicas, "Generate", router_pb2.GenerateRequest()) == [replicas]


def test_a_call_waits_while_its_owner_is_unknown():
    """No rank reported yet, or the owner's replica gone (Serve replaces it): no replica
    is chosen (Serve's queue retries), never another replica's registry."""
    pid = next(f"p{i}" for i in range(100) if owner(f"p{i}", 2) == 1)
    request = router_pb2.ReleaseParentRequest(parent_id=pid)
    assert _choose(_replicas(None, None), "ReleaseParent", request) == [[]]
    lone = _replicas(None)  # one replica owns every id, reported or not
    assert _choose(lone, "ReleaseParent", request) == [lone]
    assert _choose(_replicas({"rank": 0, "world_size": 2}), "ReleaseParent", request) == [[]]
    one = _replicas({"rank": 0, "world_size": 1})
    assert _choose(one, "ReleaseParent", request) == [one]


def test_a_handle_call_naming_a_rank_goes_to_that_replica():
    replicas = _replicas({"rank": 1, "world_size": 2}, {"rank": 0, "world_size": 2})
    for rank in (0, 1):
        [chosen] = _choose(replicas, "inflight", None, rank=rank)
        assert [r.routing_stats["rank"] for r in chosen] == [rank]
    assert _choose(replicas, "inflight", None) == [replicas]


def test_rendezvous_keeps_a_key_on_its_item_and_moves_only_the_lost_ones_keys():
    names = ["d-a", "d-b", "d-c"]
    first = {k: rendezvous(f"parent-{k}", names, str)[0] for k in range(300)}
    assert min(collections.Counter(first.values()).values()) > 60, first  # spread
    assert all(rendezvous(f"parent-{k}", names, str)[0] == first[k] for k in range(300))
    # d-b goes: its keys move to their second choice, nobody else's move.
    without = {k: rendezvous(f"parent-{k}", ["d-a", "d-c"], str)[0] for k in range(300)}
    assert all(without[k] == first[k] for k in first if first[k] != "d-b")
    assert all(without[k] == rendezvous(f"parent-{k}", names, str)[1]
               for k in first if first[k] == "d-b")


def _d_replicas(*free_blocks):
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"d-{i}"),
                            routing_stats={"free_blocks": n})
            for i, n in enumerate(free_blocks)]


def _place(replicas, **kwargs):
    pending = SimpleNamespace(kwargs=kwargs)
    return asyncio.run(CapacityRouter.choose_replicas(None, replicas, pending))


def test_a_parents_continuations_go_to_its_own_d_while_it_has_room():
    """Decode's request router: a continuation (``affinity``: its parent id) goes to the
    parent's own D of those that fit (the same whichever router replica asks), the
    others after it; one that does not fit is passed over (a READ from P elsewhere, not
    a refusal); a call with no affinity goes by room alone. Control: the same calls with
    no affinity spread by room, not by parent."""
    replicas = _d_replicas(100, 90)
    mine = {}
    for k in range(40):
        pid = f"parent-{k}"
        [first], *later = _place(replicas, blocks_needed=10, affinity=pid)
        assert [first] == rendezvous(pid, replicas, lambda r: r.replica_id.unique_id)[:1]
        assert later == [[r for r in replicas if r is not first]]
        mine[pid] = first
    assert len(set(map(id, mine.values()))) == 2  # parents spread over both Ds
    # The parent's own D is full: the other fitting one takes it.
    pid = next(p for p, r in mine.items() if r is replicas[0])
    full = _d_replicas(5, 90)
    assert _place(full, blocks_needed=10, affinity=pid) == [[full[1]], [full[0]]]
    # No affinity (a two-stage Generate's handoff): most free blocks first.
    assert _place(replicas, blocks_needed=10) == [replicas, []]
    assert _place(replicas) == [replicas]


def _engines(*names):
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=f"d-{i}"),
                            routing_stats={"free_blocks": 50, "engine_id": name})
            for i, name in enumerate(names)]


def test_a_stop_goes_to_the_replica_running_its_engine_and_a_resume_elsewhere():
    """Decode's request router: a call naming an engine (a stage 2's Stop) goes to the
    replica reporting it, to any when none does (that engine is gone: the Stop is
    dropped wherever it lands); a resume (``avoid``: the engine that stopped it) goes
    to the others, and to that one only when it is alone. Control: the same Stop with
    no engine goes by Serve's order, to either replica."""
    replicas = _engines("eng-a", "eng-b")
    assert _place(replicas, engine="eng-b") == [[replicas[1]]]
    assert _place(replicas, engine="eng-a") == [[replicas[0]]]
    assert _place(replicas, engine="eng-gone") == [replicas]
    assert _place(replicas, avoid="eng-a") == [[replicas[1]]]
    assert _place(replicas, avoid="eng-b", blocks_needed=10) == [[replicas[0]], []]
    assert _place(replicas[:1], avoid="eng-a") == [replicas[:1]]
    assert _place(replicas, engine="") == [replicas]  # control: Serve's order

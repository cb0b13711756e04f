"""Router state shared by the Router replicas on Ray (``deploy.state``, ``deploy.shared``):
the application deployed once with the shipped config's two Router replicas (one P, one
D: small pools for a 2-core machine), calls sent through Serve's gRPC proxy and, where a
test must reach the replica that does not own an id, through the Router handle with
``rank=``. Each test has its control: the same scenario with the replica's sharing off
(``RouterServer.set_shared_state``), which shows the failure without the store. The
store alone, without Ray: tests/test_serve_state_unit.py."""

from __future__ import annotations

import itertools
import threading
import time

import grpc
import pytest

from deploy.affinity import owner
from kvhandoff.v1 import router_pb2, router_pb2_grpc
from tests.test_ray_serve import APP, ARGS, METADATA, ROUTERS
from tests.utils import assert_identical
from tools.client import make_request
from tools.serve_local import deploy, local_serve, wait_replicas

pytestmark = [pytest.mark.ray, pytest.mark.engines]

#: One P replica (the shared state is the router's: nothing here needs two).
STATE_ARGS = {**ARGS, "prefill": {**ARGS["prefill"], "num_replicas": 1}}


@pytest.fixture(scope="module")
def app():
    import ray

    assert ROUTERS == 2, "deploy/config.yaml runs two Router replicas"
    with local_serve() as serve:
        deploy(serve, STATE_ARGS)
        channel = grpc.insecure_channel(serve.grpc_address)
        yield {"ray": ray, "serve": serve, "proxy": router_pb2_grpc.RouterStub(channel),
               "router": serve.get_deployment_handle("Router", app_name=APP)}
        channel.close()


def _owned_by(rank: int, prefix: str) -> str:
    return next(i for i in (f"{prefix}-{n}" for n in itertools.count()) if owner(i, 2) == rank)


def _start_parent(proxy, parent_id: str, max_tokens: int = 16):
    req = router_pb2.ParentRequest(request_id=parent_id)
    req.prompt_token_ids.ids.extend(range(500, 580))
    req.stage1.max_tokens, req.stage1.temperature, req.stage1.seed = max_tokens, 1.0, 13
    *_, last = proxy.StartParent(req, metadata=METADATA, timeout=300)
    assert last.parent.parent_id == parent_id and last.parent.held, last.parent
    return last.parent


def _continue(router, parent_id: str, rank: int):
    cont = router_pb2.ContinueRequest(parent_id=parent_id)
    cont.beam.beam_width, cont.beam.max_tokens = 4, 3
    return router.Continue.remote(cont, rank=rank).result(timeout_s=300)


def _reference(proxy):
    """The parent and its continuation as one colocated request (one engine)."""
    return proxy.Generate(make_request(prompt=list(range(500, 580)), max_tokens=16, seed=13,
                                       beam_width=4, path="colocated"),
                          metadata=METADATA, timeout=300)


def _sharing(router, enabled: bool) -> None:
    for rank in range(ROUTERS):
        router.set_shared_state.remote(enabled, rank=rank).result(timeout_s=30)


def test_a_parent_started_through_one_replica_is_continued_through_the_other(app):
    """StartParent lands on the replica owning the id (rank 0); its Continue is sent to
    rank 1, which reads the parent from the store and imports it (not recomputed),
    identical to the colocated reference. Control: with sharing off, rank 1 answers
    NOT_FOUND (what it did before the store)."""
    proxy, router = app["proxy"], app["router"]
    pid = _owned_by(0, "cross")
    _start_parent(proxy, pid)
    got = _continue(router, pid, rank=1)
    assert not got.stats.recomputed and got.stats.num_imported_tokens > 0, got.stats
    assert_identical(got, _reference(proxy), found_on_d=True)
    assert pid in router.parent_ids.remote(rank=1).result(timeout_s=30)
    _sharing(router, False)
    try:
        control = _owned_by(0, "cross-control")
        _start_parent(proxy, control)
        with pytest.raises(Exception, match="is unknown: never served here"):
            _continue(router, control, rank=1)
    finally:
        _sharing(router, True)


def test_a_chunk_registered_through_one_replica_is_composed_through_the_other(app):
    """RegisterChunk through rank 0; a request composing it through rank 1 runs on its P
    and finds the chunk's blocks cached there; listed, then deleted through either
    replica: unknown to both after. Control: sharing off, RegisterChunk is refused as
    before (FAILED_PRECONDITION: a chunk would live in one replica's registry)."""
    proxy, router = app["proxy"], app["router"]
    req = router_pb2.ChunkRequest(chunk_id="shared-sys")
    req.token_ids.ids.extend(range(100, 164))
    assert router.RegisterChunk.remote(req, rank=0).result(timeout_s=120).num_blocks == 2
    gen = make_request(prompt=list(range(300, 340)), max_tokens=4, seed=1, beam_width=2,
                       path="handoff")
    gen.chunk_ids.append("shared-sys")
    got = router.Generate.remote(gen, rank=1).result(timeout_s=300)
    assert got.stats.num_cached_prompt_tokens >= 64, got.stats
    listing = proxy.ListChunks(router_pb2.ListChunksRequest(), metadata=METADATA, timeout=60)
    assert [c.chunk_id for c in listing.chunks] == ["shared-sys"]
    proxy.DeleteChunk(router_pb2.DeleteChunkRequest(chunk_id="shared-sys"),
                      metadata=METADATA, timeout=60)
    _sharing(router, False)
    try:
        with pytest.raises(grpc.RpcError) as e:
            proxy.RegisterChunk(req, metadata=METADATA, timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert "run one router replica" in e.value.details()
    finally:
        _sharing(router, True)
    with pytest.raises(Exception, match="is unknown here"):
        router.Generate.remote(gen, rank=0).result(timeout_s=300)  # deleted everywhere


def test_drain_with_two_router_replicas_is_seen_by_both(app):
    """Drain through one replica: both route no new work to the engine, then both take
    it back after the undo. Control: sharing off, Drain is refused as before."""
    proxy, router = app["proxy"], app["router"]
    drain = router_pb2.DrainRequest(endpoint="serve:Decode", timeout_ms=10_000)
    try:
        assert proxy.Drain(drain, metadata=METADATA, timeout=60).empty
        for rank in range(ROUTERS):
            assert router.drained.remote(rank=rank).result(timeout_s=30) == ["serve:Decode"]
    finally:
        undo = router_pb2.DrainRequest(endpoint="serve:Decode", undo=True)
        proxy.Drain(undo, metadata=METADATA, timeout=60)
    for rank in range(ROUTERS):
        assert router.drained.remote(rank=rank).result(timeout_s=30) == []
    _sharing(router, False)
    try:
        with pytest.raises(grpc.RpcError) as e:
            proxy.Drain(drain, metadata=METADATA, timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        assert "this deployment runs 2" in e.value.details()
    finally:
        _sharing(router, True)


def test_the_store_killed_refuses_retryably_then_answers_from_the_rebuilt_store(app):
    """A held parent; the store actor is killed, and Ray restarts it empty. Every
    Continue of the parent through the replica that does not own it is refused
    UNAVAILABLE (the reason says the store) or imports it, identical to the reference;
    never NOT_FOUND. The same after the store is killed for good (no restart): the
    next replica call makes a new one, rebuilt from the replicas. The control, a new
    store that does not wait for the replicas' mirrors (NOT_FOUND):
    tests/test_serve_state_unit.py."""
    from deploy.state import NAME, namespace

    ray, proxy, router = app["ray"], app["proxy"], app["router"]
    ref = _reference(proxy)
    for n, no_restart in enumerate((False, True)):
        pid = _owned_by(0, f"store-kill-{n}")
        _start_parent(proxy, pid)
        ray.kill(ray.get_actor(NAME, namespace=namespace(APP)), no_restart=no_restart)
        refusals, deadline = [], time.monotonic() + 120
        while True:
            try:
                got = _continue(router, pid, rank=1)
                break
            except Exception as e:  # noqa: BLE001 (the refusal is the subject)
                assert "router state shared by the Router replicas is unavailable" in str(e), e
                refusals.append(str(e))
                assert time.monotonic() < deadline, refusals[-3:]
                time.sleep(1.0)
        assert not got.stats.recomputed and got.stats.num_imported_tokens > 0, got.stats
        assert_identical(got, ref, found_on_d=True)
        # Killed for good, the first call finds it dead (Ray's restart may be seen or not).
        assert refusals or not no_restart, "no call was refused while the store was gone"


def test_a_router_replica_killed_between_start_parent_and_continue(app):
    """Rank 0 runs a parent's stage 1 and another, long one still streams when its
    replica is killed: the finished parent is continued through rank 1 and imports (not
    recomputed), identical to the reference. The stream fails with Serve's proxy's
    status for a replica that died, INTERNAL "The actor died unexpectedly" (Serve maps
    every RayActorError so, ray/serve/_private/grpc_util.py; not UNAVAILABLE: the
    replica that would set our status is gone); retrying it is the client's call."""
    ray, serve, proxy, router = app["ray"], app["serve"], app["proxy"], app["router"]
    ref = _reference(proxy)  # before the kill: a call Serve may still route to it
    pid = _owned_by(0, "killed-owner")
    _start_parent(proxy, pid)
    name = router.actor_name.remote(rank=0).result(timeout_s=30)
    streaming = _owned_by(0, "killed-inflight")
    req = router_pb2.ParentRequest(request_id=streaming)
    req.prompt_token_ids.ids.extend(range(600, 660))
    req.stage1.max_tokens, req.stage1.min_tokens = 400, 400
    started, failure = threading.Event(), []

    def stream() -> None:
        try:
            for _ in proxy.StartParent(req, metadata=METADATA, timeout=300):
                started.set()
        except grpc.RpcError as e:
            failure.append(e)
        started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120)
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    thread.join(120)
    assert failure, "the stream of the killed replica ended normally"
    assert failure[0].code() == grpc.StatusCode.INTERNAL, (failure[0].code(),
                                                           failure[0].details())
    assert "The actor died unexpectedly" in failure[0].details(), failure[0].details()
    got = _continue(router, pid, rank=1)
    assert not got.stats.recomputed and got.stats.num_imported_tokens > 0, got.stats
    assert_identical(got, ref, found_on_d=True)
    wait_replicas(serve, "Router", ROUTERS)

"""Shared fixtures. Engines are expensive (~30 s each on CPU): one P and one D for the
whole session, shared by every integration test, driven from one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

#: Test engines: fp32 blocks of 32 tokens are 128 KiB here. D's pool is as small as vLLM
#: allows (one 4096-token request plus vLLM's null block: 129 blocks, 128 usable) so
#: capacity refusals are reachable.
P_POOL_BYTES = 32 << 20
D_POOL_BYTES = (16 << 20) + (128 << 10)
#: Short enough that lease expiry is observable in a test, long enough for a slow CI.
LEASE_S = 10


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvhandoff.model import builtin_model_dir

    return str(builtin_model_dir())


@pytest.fixture(scope="session")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def run(loop):
    """Run a coroutine on the session loop (the engines' output handlers live there)."""

    def _run(coro: Coroutine[Any, Any, Any], timeout: float = 300.0) -> Any:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))

    return _run


@pytest.fixture(scope="session")
def pair(run, model_dir):
    """A real P and D on the built-in model, NIXL over loopback."""
    from kvhandoff.local import local_pair

    cm = local_pair(model_dir, lease_s=LEASE_S,
                    prefill_overrides={"kv_cache_memory_bytes": P_POOL_BYTES},
                    decode_overrides={"kv_cache_memory_bytes": D_POOL_BYTES})
    pair = run(cm.__aenter__())
    yield pair
    run(cm.__aexit__(None, None, None))


@pytest.fixture
def assert_pools_clean(pair, run):
    """Call after a lifecycle: P holds no exported block, D only cached blocks."""

    def _check(timeout_s: float = LEASE_S + 5.0) -> None:
        for name, engine in (("P", pair.p), ("D", pair.d)):
            snap = run(engine.wait_pool_clean(timeout_s))
            assert snap.is_clean, f"{name} pool not clean: {snap}"

    return _check


#: The gRPC cluster's D pool: 17 MiB = 136 blocks (135 usable), just above vLLM's minimum.
CLUSTER_D_MIB = 17
#: Separate server processes on 2 cores: a first READ was seen to take ~11 s.
CLUSTER_LEASE_S = 30


@pytest.fixture(scope="session")
def cluster(model_dir, tmp_path_factory):
    """P, D and the router as separate `kvhandoff serve` processes on loopback."""
    from kvhandoff.demo import local_cluster

    with local_cluster(model_dir, tmp_path_factory.mktemp("cluster-logs"),
                       decode_mib=CLUSTER_D_MIB, prefill_mib=64, lease_s=CLUSTER_LEASE_S) as c:
        yield c


@pytest.fixture(scope="session")
def router_client(cluster):
    from kvhandoff.client import RouterClient

    with RouterClient(cluster["router"]) as client:
        yield client


def engine_stub(address: str):
    import grpc

    from kvhandoff.v1 import engine_pb2_grpc

    return engine_pb2_grpc.EngineStub(grpc.insecure_channel(address))


@pytest.fixture
def assert_cluster_clean(cluster):
    """After a test: every engine server's pool holds no block and no request."""
    from kvhandoff.v1 import engine_pb2

    def _check(timeout_s: float = CLUSTER_LEASE_S + 5.0) -> None:
        import time

        for server in [cluster["prefill"], *cluster["decode"]]:
            stub = engine_stub(server.address)
            deadline = time.monotonic() + timeout_s
            while True:
                cap = stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=5)
                clean = (cap.num_free_blocks == cap.num_total_blocks
                         and not cap.num_running_reqs and not cap.num_waiting_reqs)
                if clean or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert clean, f"{server.role} {server.address} not clean: {cap}"

    return _check

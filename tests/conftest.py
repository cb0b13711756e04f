"""Shared fixtures. Engines are expensive (~30 s each on CPU), so the engine groups are
started once each: the in-process P+D ``pair``, the ``family`` and the ``cluster`` of
`kvhandoff serve` processes. Tests are ordered by the group they use (unit tests, pair,
tests with their own processes, family, cluster, then the Ray Serve tests, whose first
test also asks the cluster) and each group is shut down after its last test.

Two lanes run side by side (pytest-xdist, ``-n 2`` in pyproject.toml): an engine
computes on one thread, so one lane of tests keeps about one of the 2 cores busy (47-64 %
measured over a serial run's engine tests). Lane "groups" runs the shared
groups in the order above; lane "own" the unit tests and the tests that start (and
kill, freeze or cut off) processes of their own. Each lane is one xdist work unit, so
its order holds and each group starts once. The lanes pick free ports from halves of
the range (``KVHANDOFF_PORT_RANGE``), so a port one lane chose is never the other's."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Callable, Coroutine
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
    from kvhandoff.builtin.generate import builtin_model_dir

    return str(builtin_model_dir())


@pytest.fixture(scope="session")
def fingerprint(model_dir) -> str:
    """The built-in model's fingerprint, as P stamps it on every handoff."""
    from kvhandoff.model import model_fingerprint

    return model_fingerprint(model_dir)


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


class _Shared:
    """An engine group shared by consecutive tests; closed after the last of them."""

    def __init__(self) -> None:
        self._value: Any = None
        self._close: Callable[[], Any] | None = None

    def get(self, start: Callable[[], tuple[Any, Callable[[], Any]]]) -> Any:
        if self._close is None:
            self._value, self._close = start()
        return self._value

    def close(self) -> None:
        close, self._value, self._close = self._close, None, None
        if close is not None:
            close()


_GROUPS = {"pair": _Shared(), "cluster": _Shared(), "family": _Shared(),
           "vllm_peer": _Shared()}


def _port_slice(worker: str | None) -> None:
    """An xdist worker (``gw0``, ``gw1``, ...) takes its own slice of free_port's range,
    for itself and the servers it starts (they inherit the environment)."""
    from kvhandoff.ports import FREE_PORT_FLOOR, ephemeral_floor

    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or "KVHANDOFF_PORT_RANGE" in os.environ:
        return
    index = int(worker.removeprefix("gw"))
    width = (ephemeral_floor() - FREE_PORT_FLOOR) // count
    low = FREE_PORT_FLOOR + index * width
    os.environ["KVHANDOFF_PORT_RANGE"] = f"{low}-{low + width}"


_port_slice(os.environ.get("PYTEST_XDIST_WORKER"))


def _group_order(item: pytest.Item) -> int:
    names = set(getattr(item, "fixturenames", ()))
    if item.get_closest_marker("ray"):
        return 4  # after the cluster group (its first test compares with the cluster)
    if "pair" in names:
        return 1
    if "family" in names:
        return 2.5  # one group: tests/test_continuation.py, then tests/test_http.py
    if "cluster" in names:
        return 3
    return 2 if item.get_closest_marker("engines") else 0


#: Lane "own" (module docstring): the files whose tests start, kill, freeze or cut off
#: processes of their own, and unit-test files. Every other file runs in lane "groups"
#: (a file that uses a shared group must, so that the group starts once; a new file
#: lands there unless listed here, which is never wrong, only not parallel). The Ray
#: Serve files stay in "groups": tests there look for Serve's processes in this network
#: namespace, so no other Serve instance may run beside them there (docs/decisions.md,
#: "The suite, round four").
OWN_LANE_FILES = frozenset({
    "test_faults.py", "test_hosts.py", "test_model_variants.py",
    "test_install.py", "test_soak.py", "test_soak_verdict.py", "test_router_pick.py",
    "test_scheduler_side.py", "test_harness_bound.py", "test_deploy_args.py",
    "test_handoff_unit.py", "test_signing.py", "test_proto.py", "test_layers.py",
    "test_engine_config.py", "test_gpu_probe.py", "test_builtin_adapters.py",
    "test_bundle.py", "test_gpu_host.py", "test_nixl_probe.py", "test_auth.py",
    "test_cli_errors.py", "test_chunks_unit.py", "test_bench_chunks.py", "test_bench_cli.py",
    "test_stale_kv.py", "test_weights_identity.py", "test_model_identity_unit.py",
    "test_field_checks.py", "test_liveness_unit.py", "test_undecodable.py",
    "test_serve_state_unit.py", "test_autoscale_unit.py", "test_search_moves_unit.py",
    "test_leaving_unit.py",
    # One P, two Ds and a router of its own (module scope).
    "test_stage2_move.py",
    # A LoRA pair of its own (module scope).
    "test_adapters.py",
    # Processes of their own: the demo's P, D and router; the blend bench's engines.
    "test_demo.py", "test_bench_blend.py",
    # Ray, but on hosts of its own (tools/netns): its processes are told apart from the
    # other Serve tests' by their network namespace.
    "test_ray_serve_two_nodes.py",
})


def lane_of(nodeid: str) -> str:
    """The lane of a test by its node id (``tests/<file>::...``)."""
    return "own" if nodeid.split("::", 1)[0].rsplit("/", 1)[-1] in OWN_LANE_FILES \
        else "groups"


def pytest_xdist_make_scheduler(config, log):
    """Each lane is one xdist work unit: one worker runs it whole, in collection order.
    (Not ``--dist loadgroup``: pytest-xdist 3.8 renames node ids for it through an
    attribute pytest 9.2 no longer has, so its groups are silently ignored.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=_group_order)  # stable: file order within a group


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (``item.report_call``) for fixtures that add
    context to a failure (tests/test_faults.py prints its servers' warnings)."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Close each group the next test does not use: the ones on the session's event loop
    before the test's fixtures are torn down (the loop goes with the last test), the
    process family after them (its tests' teardown fixtures still check its pools)."""

    def unused(name: str) -> bool:
        return nextitem is None or name not in getattr(nextitem, "fixturenames", ())

    for name in ("pair", "cluster", "vllm_peer"):
        if unused(name):
            _GROUPS[name].close()
    result = yield
    if unused("family"):
        _GROUPS["family"].close()
    return result


def pytest_sessionfinish(session, exitstatus):
    for group in _GROUPS.values():
        group.close()


@pytest.fixture
def pair(run, model_dir):
    """A real P and D on the built-in model, NIXL over loopback, a second P (``p2``: the
    harness's moves between Ps) and a second D (``d2``: beam searches moved between Ds),
    each with the built-in catalog ``shop``. Fault
    injection is allowed (the negative controls of tests/test_harness.py and
    tests/test_catalog_engine.py); no other test names a fault."""
    from kvhandoff.builtin.generate import builtin_catalog
    from tools.local import local_pair

    def start():
        # Every engine of the group has the built-in shop (tests/test_catalog_engine.py).
        cm = local_pair(model_dir, lease_s=LEASE_S, fault_injection=True, second_prefill=True,
                        second_decode=True,
                        catalogs=(("shop", str(builtin_catalog(model_dir))),),
                        prefill_overrides={"kv_cache_memory_bytes": P_POOL_BYTES},
                        decode_overrides={"kv_cache_memory_bytes": D_POOL_BYTES})
        return run(cm.__aenter__()), lambda: run(cm.__aexit__(None, None, None))

    return _GROUPS["pair"].get(start)


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


@pytest.fixture
def cluster(model_dir, tmp_path_factory):
    """P, D and the router as separate `kvhandoff serve` processes on loopback; the
    engines take injected faults (``--fault-injection``: the end-to-end negative
    controls) and have the built-in catalog ``shop``, the router serves HTTP too
    (``http``: its base URL). The engines require an engine key (``engine_key_file``):
    while the cluster lives, ``$KVHANDOFF_ENGINE_KEY_FILE`` names it in this process, so
    the routers tests start against its engines, ``engine_stub`` and tools.launch's own
    calls send it, as an operator's environment would."""
    from kvhandoff.keys import ENGINE_KEY_FILE_ENV
    from kvhandoff.ports import free_port
    from tools.launch import local_cluster

    def start():
        http_port = free_port()
        log_dir = tmp_path_factory.mktemp("cluster-logs")
        key_file = log_dir / "engine.key"
        key_file.write_text(secrets.token_hex(32))
        key_file.chmod(0o600)
        before = os.environ.get(ENGINE_KEY_FILE_ENV)
        os.environ[ENGINE_KEY_FILE_ENV] = str(key_file)

        def restore_env():
            if before is None:
                os.environ.pop(ENGINE_KEY_FILE_ENV, None)
            else:
                os.environ[ENGINE_KEY_FILE_ENV] = before

        def close():
            try:
                cm.__exit__(None, None, None)
            finally:
                restore_env()

        cm = local_cluster(model_dir, log_dir,
                           decode_mib=CLUSTER_D_MIB, prefill_mib=64, lease_s=CLUSTER_LEASE_S,
                           engine_flags=("--fault-injection", "--catalog", "shop=builtin"),
                           router_flags=("--http-port", str(http_port)))
        try:
            value = {**cm.__enter__(), "http": f"http://127.0.0.1:{http_port}",
                     "engine_key_file": key_file}
        except BaseException:
            restore_env()
            raise
        return value, close

    return _GROUPS["cluster"].get(start)


@pytest.fixture
def vllm_peer(run, model_dir):
    """One more engine of the built-in model in this process, with the engines' default
    settings, for vLLM's own ``beam_search`` (tests/test_identity_e2e.py), with its
    tokenizer and ``</think>`` id; shared by consecutive tests."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from engine import EngineConfig
    from kvhandoff.model import ModelTokens
    from prefill_engine.engine import PrefillEngine

    async def start_engine():
        return PrefillEngine.start(EngineConfig(model=model_dir, role="prefill",
                                                kv_cache_memory_bytes=64 << 20))

    async def stop(engine):
        engine.shutdown()
        # Its cancelled output handler finishes on this loop (as tools.local's pair).
        await asyncio.sleep(0.1)

    def start():
        engine = run(start_engine(), timeout=300)
        peer = (engine, AutoTokenizer.from_pretrained(model_dir),
                ModelTokens.load(Path(model_dir)).think_end_id)
        return peer, lambda: run(stop(engine))

    return _GROUPS["vllm_peer"].get(start)


#: The family's lease: short, so a test can outlive it; long enough for a continuation on
#: 2 busy cores.
FAMILY_LEASE_S = 12
#: The ``hold`` router's --parent-hold-s: well below the family's lease (a hold that ended
#: at the lease instead is told apart), above the router's margin (LEASE_MARGIN_S, 2.5 s)
#: by seconds for a continuation that imports.
FAMILY_PARENT_HOLD_S = 7


@pytest.fixture
def family(model_dir, tmp_path_factory):
    """P, D and six routers over them (tests/test_continuation.py, tests/test_http.py):
    ``router`` with defaults and the HTTP front (``http``: its base URL); ``noshare``, no
    share of P's pool for held parents (its HTTP front: ``noshare_http``); ``small``, a
    registry of two parents that live 3 s (its HTTP front: ``small_http``); ``solo``, P
    alone (a deployment with a single engine); ``tight``, a share of P's pool that holds
    one parent; ``hold``, parents held ``FAMILY_PARENT_HOLD_S`` on P (its HTTP front:
    ``hold_http``)."""

    def start():
        from kvhandoff.ports import free_port
        from tools.launch import local_cluster, spawn, stop, wait_serving

        log_dir = tmp_path_factory.mktemp("family-logs")
        http_port = free_port()
        cm = local_cluster(model_dir, log_dir, decode_mib=32, prefill_mib=64,
                           lease_s=FAMILY_LEASE_S, router_flags=("--http-port", str(http_port)))
        cluster = cm.__enter__()
        engines = ["--model", model_dir, "--prefill", cluster["prefill"].address,
                   "--decode", cluster["decode"][0].address, "--no-warm-up"]
        noshare_http, small_http, hold_http = free_port(), free_port(), free_port()
        extra = [spawn("router", free_port(), [*engines, "--parent-pool-share", "0",
                                               "--http-port", str(noshare_http)], log_dir,
                       "router-noshare"),
                 spawn("router", free_port(), [*engines, "--max-parents", "2",
                                               "--parent-ttl-s", "3",
                                               "--http-port", str(small_http)], log_dir,
                       "router-small"),
                 spawn("router", free_port(), engines[:4] + ["--no-warm-up"], log_dir,
                       "router-solo"),
                 spawn("router", free_port(), [*engines, "--parent-pool-share", "0.012"],
                       log_dir, "router-tight"),
                 spawn("router", free_port(), [*engines, "--parent-hold-s",
                                               str(FAMILY_PARENT_HOLD_S),
                                               "--http-port", str(hold_http)], log_dir,
                       "router-hold")]

        def close():
            stop(extra)
            cm.__exit__(None, None, None)

        try:
            for r in extra:
                wait_serving(r.address, extra)
        except BaseException:
            close()
            raise
        return ({**cluster, "http": f"http://127.0.0.1:{http_port}",
                 "noshare": extra[0].address,
                 "noshare_http": f"http://127.0.0.1:{noshare_http}",
                 "small": extra[1].address,
                 "small_http": f"http://127.0.0.1:{small_http}",
                 "solo": extra[2].address, "tight": extra[3].address,
                 "tight_metrics": extra[3].metrics_url,
                 "small_metrics": extra[1].metrics_url,
                 "hold": extra[4].address,
                 "hold_http": f"http://127.0.0.1:{hold_http}"}, close)

    return _GROUPS["family"].get(start)


@pytest.fixture
def router_client(cluster):
    from tools.client import RouterClient

    with RouterClient(cluster["router"]) as client:
        yield client


def engine_stub(address: str):
    """A blocking stub of the engine server at ``address`` that sends the environment's
    engine key, if any (the ``cluster``'s while it lives)."""
    from kvhandoff.v1 import engine_pb2_grpc
    from tools.launch import engine_channel

    return engine_pb2_grpc.EngineStub(engine_channel(address))


@pytest.fixture
def assert_cluster_clean(cluster):
    """After a test: every engine server's pool holds no block and no request."""
    from tests.utils import assert_servers_clean

    # Two leases: a stage 1 that finished (and exported) just before a cancel or deadline
    # is held by P until its lease ends, and P reaps expired leases as it steps.
    def _check(timeout_s: float = 2 * CLUSTER_LEASE_S + 5.0) -> None:
        assert_servers_clean([cluster["prefill"], *cluster["decode"]], timeout_s)

    return _check

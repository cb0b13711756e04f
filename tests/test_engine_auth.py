"""Engines guarded like the router (kvhandoff.keys): with an engine key every Engine call
without it, or with another, is refused UNAUTHENTICATED before it runs, while health and
reflection stay open and the router that has the key is served; an engine without a key
takes the same calls (the control). An engine or router bound beyond loopback with
neither a key nor mutual TLS is refused at start (tests/test_cli_errors.py has the
one-line refusals)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvhandoff.keys import (
    ENGINE_KEY_ENV,
    ENGINE_KEY_FILE_ENV,
    check_exposure,
    guard_servicer,
    key_interceptors,
    load_engine_key,
    with_key,
)
from kvhandoff.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from server.engine_service import ENGINE_DESCRIPTOR, ENGINE_SERVICE, add_engine_service
from tests.conftest import engine_stub

KEY = "k" * 32
UNAUTH = grpc.StatusCode.UNAUTHENTICATED

#: One request of each Engine method (every one the service has: checked below).
CALLS = {
    "Stage1": engine_pb2.Stage1Request(request_id="auth-1", prompt_token_ids=[5, 6, 7],
                                       export=True, hold=True,
                                       sampling=common_pb2.Stage1Sampling(max_tokens=2)),
    "Stage2": engine_pb2.Stage2Request(request_id="auth-2", prompt_token_ids=[5, 6, 7],
                                       beam=common_pb2.BeamSearch(beam_width=2, max_tokens=2)),
    "Stage2Stream": engine_pb2.Stage2Request(
        request_id="auth-3", prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.Stage1Sampling(max_tokens=2)),
    "GetCapacity": engine_pb2.CapacityRequest(),
    "Release": engine_pb2.ReleaseRequest(prefixes=[""]),
    "Stop": engine_pb2.StopRequest(request_ids=["auth-1"]),
    "Abort": engine_pb2.AbortRequest(request_id="auth-1"),
}


def test_every_engine_method_has_a_call_here() -> None:
    assert set(CALLS) == {m.name for m in ENGINE_DESCRIPTOR.methods}


def _call(stub, name: str, timeout: float = 60.0) -> grpc.StatusCode:
    """The status of one call of ``name`` (streams read to their end)."""
    method = getattr(stub, name)
    try:
        if ENGINE_DESCRIPTOR.methods_by_name[name].server_streaming:
            list(method(CALLS[name], timeout=timeout))
        else:
            method(CALLS[name], timeout=timeout)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


class _Recorder(engine_pb2_grpc.EngineServicer):
    """Every method answers at once and records that it ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def Stage1(self, request, context):
        self.ran.append("Stage1")
        yield engine_pb2.Stage1Event(finish_reason="length")

    async def Stage2Stream(self, request, context):
        self.ran.append("Stage2Stream")
        yield engine_pb2.Stage2Event()

    async def Stage2(self, request, context):
        self.ran.append("Stage2")
        return engine_pb2.Stage2Response()

    async def GetCapacity(self, request, context):
        self.ran.append("GetCapacity")
        return engine_pb2.Capacity(role="prefill")

    async def Release(self, request, context):
        self.ran.append("Release")
        return engine_pb2.ReleaseResponse()

    async def Stop(self, request, context):
        self.ran.append("Stop")
        return engine_pb2.StopResponse()

    async def Abort(self, request, context):
        self.ran.append("Abort")
        return engine_pb2.AbortResponse()


@pytest.mark.parametrize("engine_key", [KEY, None])
def test_the_guard_refuses_every_call_without_the_key_before_it_runs(engine_key) -> None:
    """STEP 1: a server with ``engine_key`` (None: the control) serves the recorder.
    STEP 2: every method without a key and with a wrong one: UNAUTHENTICATED and nothing
    ran (the control: each ran). STEP 3: with the key, over blocking and asyncio
    channels, each runs. Health stays open."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from wire.grpc_server import start_server

    async def body():
        recorder = _Recorder()
        server, _, port = await start_server(
            lambda s: add_engine_service(recorder, s, engine_key), ENGINE_SERVICE,
            "127.0.0.1", 0)
        address = f"127.0.0.1:{port}"
        try:
            # STEP 2
            for channel in (grpc.insecure_channel(address),
                            with_key(grpc.insecure_channel(address), "w" * 32)):
                with channel:
                    stub = engine_pb2_grpc.EngineStub(channel)
                    codes = {name: await asyncio.to_thread(_call, stub, name, 10)
                             for name in CALLS}
                    health = await asyncio.to_thread(
                        health_pb2_grpc.HealthStub(channel).Check,
                        health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                if engine_key is None:
                    assert set(codes.values()) == {grpc.StatusCode.OK}, codes
                    assert sorted(recorder.ran) == sorted(CALLS)
                else:
                    assert set(codes.values()) == {UNAUTH}, codes
                    assert recorder.ran == []
                recorder.ran.clear()
            # STEP 3
            with with_key(grpc.insecure_channel(address), KEY) as channel:
                stub = engine_pb2_grpc.EngineStub(channel)
                codes = {name: await asyncio.to_thread(_call, stub, name, 10)
                         for name in CALLS}
            assert set(codes.values()) == {grpc.StatusCode.OK}, codes
            async with grpc.aio.insecure_channel(
                    address, interceptors=key_interceptors(KEY)) as channel:
                stub = engine_pb2_grpc.EngineStub(channel)
                assert (await stub.GetCapacity(engine_pb2.CapacityRequest())).role == "prefill"
                assert [e async for e in stub.Stage1(CALLS["Stage1"])]
            assert sorted(recorder.ran) == sorted([*CALLS, "GetCapacity", "Stage1"])
        finally:
            await server.stop(None)

    asyncio.run(body())


def test_the_guard_wraps_nothing_without_a_key() -> None:
    recorder = _Recorder()
    assert guard_servicer(recorder, ENGINE_DESCRIPTOR, None) is recorder


def test_the_engine_key_is_loaded_as_the_handoff_secret_is(tmp_path) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text(f"{KEY}\n")
    assert load_engine_key(None, {}) is None
    assert load_engine_key(None, {ENGINE_KEY_ENV: "", ENGINE_KEY_FILE_ENV: ""}) is None
    assert load_engine_key(str(key_file), {ENGINE_KEY_ENV: "e" * 20}) == KEY
    assert load_engine_key(None, {ENGINE_KEY_FILE_ENV: str(key_file)}) == KEY
    assert load_engine_key(None, {ENGINE_KEY_ENV: "e" * 20}) == "e" * 20
    with pytest.raises(ValueError, match="shorter than 16"):
        load_engine_key(None, {ENGINE_KEY_ENV: "short"})
    with pytest.raises(ValueError, match="without spaces"):
        load_engine_key(None, {ENGINE_KEY_ENV: "a key with spaces in it"})
    with pytest.raises(ValueError, match="/no/such/key"):
        load_engine_key("/no/such/key", {})


@pytest.mark.parametrize("host,guarded,insecure,refused", [
    ("127.0.0.1", False, False, False),
    ("localhost", False, False, False),
    ("::1", False, False, False),
    ("0.0.0.0", False, False, True),
    ("10.213.7.1", False, False, True),
    ("0.0.0.0", True, False, False),
    ("0.0.0.0", False, True, False),
])
def test_exposure_needs_a_guard_or_insecure(host, guarded, insecure, refused) -> None:
    if refused:
        with pytest.raises(ValueError, match="add --the-flag"):
            check_exposure(host, guarded=guarded, insecure=insecure, add="--the-flag")
    else:
        check_exposure(host, guarded=guarded, insecure=insecure, add="--the-flag")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("how", ["--engine-key-file", "--insecure"])
def test_an_engine_on_every_interface_with_a_key_or_insecure_starts(
        how, model_dir, tmp_path) -> None:
    """The refusal's positive side (tests/test_cli_errors.py: without either, exit 2):
    ``--host 0.0.0.0`` with a key file gets past the check and its gRPC server answers
    health (NOT_SERVING while the engine loads; stopped then). With ``--insecure`` the
    engine, which has no key, serves: the control of the refusals in this file (every
    Engine call without a key is answered, none UNAUTHENTICATED; a stage 1 and a
    capacity call succeed)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    key_file = tmp_path / "engine.key"
    key_file.write_text(KEY)
    flags = ["--engine-key-file", str(key_file)] if how == "--engine-key-file" else [how]
    port = free_port()
    server = spawn("prefill", port, ["--model", model_dir, "--host", "0.0.0.0", *flags],
                   tmp_path, env={ENGINE_KEY_FILE_ENV: "", ENGINE_KEY_ENV: ""})
    address = f"127.0.0.1:{port}"
    try:
        if how == "--engine-key-file":
            with grpc.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=240, wait_for_ready=True)
            assert server.proc.poll() is None, server.log_path.read_text()
            assert health.status in (health_pb2.HealthCheckResponse.NOT_SERVING,
                                     health_pb2.HealthCheckResponse.SERVING)
            return
        wait_serving(address, [server])
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            codes = {name: _call(stub, name) for name in CALLS}
        assert UNAUTH not in codes.values(), codes
        assert codes["Stage1"] == codes["GetCapacity"] == grpc.StatusCode.OK, codes
        # Only the gRPC and metrics ports (--host) are on every interface: the NIXL side
        # channel, the KV events and the engine's own sockets stay on loopback.
        listening = _listening(server.proc.pid)
        metrics_port = int(server.metrics_url.rsplit(":", 1)[1].split("/")[0])
        assert {listening.pop(port), listening.pop(metrics_port)} <= {"0.0.0.0", "::"}, \
            listening
        assert listening and set(listening.values()) == {"127.0.0.1"}, listening
    finally:
        stop([server])


def _listening(pid: int) -> dict[int, str]:
    """Port -> address of every listening socket of process ``pid`` and its children."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return {c.laddr.port: c.laddr.ip for p in procs for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_serve_deployments_refuse_a_side_channel_on_every_interface(host) -> None:
    from pydantic import ValidationError

    from deploy.args import AppArgs

    with pytest.raises(ValidationError, match="one interface"):
        AppArgs.model_validate({"prefill": {"engine": {"side_channel_host": host}}})


def test_the_side_channel_follows_host_and_never_every_interface() -> None:
    from cli.serve import side_channel_host

    assert side_channel_host(None, "127.0.0.1") == "127.0.0.1"
    assert side_channel_host(None, "10.213.7.2") == "10.213.7.2"
    assert side_channel_host(None, "0.0.0.0") == "127.0.0.1"
    assert side_channel_host("10.213.7.3", "0.0.0.0") == "10.213.7.3"
    with pytest.raises(ValueError, match="one interface"):
        side_channel_host("0.0.0.0", "10.213.7.2")


# ---- a real cluster: P, D and the router as processes, the engines keyed --------------

def _pool(cluster) -> tuple[int, int, int, int]:
    cap = engine_stub(cluster["prefill"].address).GetCapacity(engine_pb2.CapacityRequest(),
                                                              timeout=10)
    return (cap.num_free_blocks, cap.num_running_reqs, cap.num_waiting_reqs,
            cap.num_reserved_blocks)


@pytest.mark.engines
@pytest.mark.security
@pytest.mark.timeout(600)
def test_keyed_engines_refuse_callers_without_the_key_and_serve_the_router(
        cluster, router_client, assert_cluster_clean) -> None:
    """STEP 1: P's pool as it is. STEP 2: every Engine call to P and D without the key,
    or with another: UNAUTHENTICATED, and P's pool unchanged (nothing ran: no stage 1
    exported or held). STEP 3: the router, which has the key, runs a two-stage request
    by handoff (D imported P's KV)."""
    from tools.client import make_request

    # STEP 1
    before = _pool(cluster)
    # STEP 2
    for server in (cluster["prefill"], cluster["decode"][0]):
        for channel in (grpc.insecure_channel(server.address),
                        with_key(grpc.insecure_channel(server.address), "w" * 32)):
            with channel:
                stub = engine_pb2_grpc.EngineStub(channel)
                codes = {name: _call(stub, name) for name in CALLS}
            assert set(codes.values()) == {UNAUTH}, (server.role, codes)
    assert _pool(cluster) == before
    # STEP 3
    resp = router_client.generate(make_request(prompt=list(range(300, 370)), max_tokens=6,
                                               seed=3, beam_width=2, path="handoff"),
                                  timeout=180)
    assert resp.beams and resp.stats.num_imported_tokens > 0 and not resp.stats.recomputed, \
        resp.stats
    assert_cluster_clean()


@pytest.mark.engines
@pytest.mark.security
@pytest.mark.timeout(300)
def test_a_router_without_the_key_reaches_no_engine(cluster, tmp_path) -> None:
    """The router's side of STEP 3 above: started without the engine key (its
    environment's emptied), its GetCapacity calls are refused, so it never serves."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvhandoff.ports import free_port
    from tools.client import RouterClient, make_request
    from tools.launch import spawn, stop

    router = spawn("router", free_port(), [
        "--prefill", cluster["prefill"].address, "--decode", cluster["decode"][0].address,
        "--no-warm-up"], tmp_path, env={ENGINE_KEY_FILE_ENV: "", ENGINE_KEY_ENV: ""})
    try:
        with grpc.insecure_channel(router.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=120, wait_for_ready=True)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            for _ in range(20):
                time.sleep(1)
                assert router.proc.poll() is None, router.log_path.read_text()
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        # A request fails once no engine answered within --engine-silence-s (10 s),
        # naming the refusal; the log says it while the router waits.
        with RouterClient(router.address) as client, pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(prompt=list(range(40, 60)), max_tokens=2),
                            timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "missing or wrong engine key" in err.value.details(), err.value.details()
        assert "missing or wrong engine key" in router.log_path.read_text()
    finally:
        stop([router])

"""Security over the real `kvhandoff serve` cluster (P and D share a handoff secret):
handoffs only their decode engine can redeem, no secret in any log, loopback binds,
message size limits, and the router's bounded in-flight limit."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from kvhandoff.v1 import common_pb2, engine_pb2
from tests.conftest import engine_stub
from tools.client import RouterClient, make_request

pytestmark = [pytest.mark.engines, pytest.mark.security]


def _stage1(cluster, target: str, request_id: str, prompt: list[int]):
    p = engine_stub(cluster["prefill"].address)
    events = list(p.Stage1(engine_pb2.Stage1Request(
        request_id=request_id, prompt_token_ids=prompt, export=True, target_engine_id=target,
        sampling=common_pb2.Stage1Sampling(max_tokens=6, seed=4)), timeout=60))
    return events[-1].handoff, [t for e in events for t in e.new_token_ids]


def _stage2(cluster, handoff, prompt, request_id):
    d = engine_stub(cluster["decode"][0].address)
    return d.Stage2(engine_pb2.Stage2Request(
        request_id=request_id, handoff=handoff, prompt_token_ids=prompt,
        beam=common_pb2.BeamSearch(beam_width=2, max_tokens=2)), timeout=120)


def _d_target(cluster) -> str:
    cap = engine_stub(cluster["decode"][0].address).GetCapacity(engine_pb2.CapacityRequest(),
                                                                timeout=10)
    return cap.handoff_target


def test_handoff_is_signed_for_its_decode_engine_and_redeemable_there(cluster,
                                                                      assert_cluster_clean):
    target = _d_target(cluster)
    prompt = list(range(30, 100))
    handoff, thinking = _stage1(cluster, target, "sec-ok-1", prompt)
    assert handoff.target_engine_id == target and len(handoff.signature) == 64
    resp = _stage2(cluster, handoff, prompt + thinking + [3], "sec-ok-2")
    assert resp.num_imported_tokens == len(prompt) + len(thinking) - 1
    assert_cluster_clean()


def test_d_refuses_unsigned_tampered_or_misaddressed_handoffs(cluster, assert_cluster_clean):
    """Four attacks, each on a handoff of its own: PERMISSION_DENIED naming why. Then one
    wait for the pools (P's lease returns the four exports' blocks), not one per attack."""
    for attack in ("unsigned", "tampered_lease", "tampered_blocks", "other_target"):
        target = "decode-somewhere-else" if attack == "other_target" else _d_target(cluster)
        prompt = list(range(40, 110))
        handoff, thinking = _stage1(cluster, target, f"sec-{attack}-1", prompt)
        if attack == "unsigned":
            handoff.signature = ""
        elif attack == "tampered_lease":
            handoff.lease_expires_at += 3600
        elif attack == "tampered_blocks":
            handoff.remote_block_ids[0].ids[0] += 1
        with pytest.raises(grpc.RpcError) as err:
            _stage2(cluster, handoff, prompt + thinking + [3], f"sec-{attack}-2")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (attack,
                                                                       err.value.details())
        expected = {"unsigned": "not signed", "other_target": "addressed to engine"}.get(
            attack, "signature does not match")
        assert expected in err.value.details(), attack
    # D never contacts the P an unverified handoff names: P's lease returns the blocks.
    assert_cluster_clean()


def test_the_secrets_are_in_no_log(cluster, router_client):
    """Neither the handoff secret nor the engine key (which every call to the engines
    carries) appears in any server's log."""
    router_client.generate(make_request(prompt=list(range(10, 60)), max_tokens=4, seed=1,
                                        path="handoff"))
    secrets = [Path(cluster[name]).read_text().strip()
               for name in ("secret_file", "engine_key_file")]
    logs = [s.log_path for s in cluster["servers"]]
    assert logs and all(len(secret) >= 16 for secret in secrets)
    assert all(secret not in p.read_text(errors="replace") for p in logs for secret in secrets)


def test_servers_listen_on_loopback_only(cluster):
    import psutil

    ports = {}
    for server in cluster["servers"]:
        procs = [psutil.Process(server.proc.pid)]
        procs += procs[0].children(recursive=True)
        for proc in procs:
            for c in proc.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    ports[(server.role, proc.pid, c.laddr.port)] = c.laddr.ip
    assert ports, "no listening socket found"
    loopback = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
    exposed = {k: ip for k, ip in ports.items() if ip not in loopback}
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_oversized_request_is_refused_and_the_router_keeps_serving(router_client):
    with pytest.raises(grpc.RpcError) as err:
        router_client.generate(make_request(prompt="x" * (65 << 20), max_tokens=4))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    resp = router_client.generate(make_request(prompt=list(range(10, 40)), max_tokens=4,
                                               seed=2, path="colocated"))
    assert resp.beams


def test_router_refuses_beyond_its_in_flight_limit(cluster, tmp_path, assert_cluster_clean):
    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    router = spawn("router", free_port(), [
        "--prefill", cluster["prefill"].address,
        "--decode", ",".join(d.address for d in cluster["decode"]),
        "--max-inflight", "2"], tmp_path)
    try:
        wait_serving(router.address, [router])
        barrier = threading.Barrier(6)

        def one(i: int):
            req = make_request(prompt=list(range(20, 80)), max_tokens=24, seed=i,
                               beam_width=2, path="handoff", request_id=f"busy-{i}")
            with RouterClient(router.address) as client:
                barrier.wait()
                try:
                    return client.generate(req, timeout=120)
                except grpc.RpcError as e:
                    return e

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        refused = [r for r in results if isinstance(r, grpc.RpcError)]
        assert refused and len(refused) <= 4
        for e in refused:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "router busy: 2 requests in flight" in e.details()
        assert all(r.beams for r in results if not isinstance(r, grpc.RpcError))
    finally:
        stop([router])
    assert_cluster_clean()

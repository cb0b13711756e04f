"""The Ray Serve application on a Ray cluster of two nodes on two network hosts
(tools/netns.py): the head on one host with ``prefill_node`` and ``router_node``
resources, a worker node on the other with ``decode_node``; the config places P and the
router on the head and D on the worker (``resources``, the knob a multi-GPU deployment
uses), the engines read over the link (UCX over TCP), and clients call Serve's gRPC
proxy on the head. Then every process of the worker's host is killed and the node
started again. (Which transport UCX used is checked on the standalone engines,
tests/test_hosts.py: Ray kills the engines, and UCX's tables, written through stdio
buffers, are then lost.)"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import assert_handed_off, assert_identical, in_this_netns
from tools.netns import call, can_create, hosts

pytestmark = [pytest.mark.ray, pytest.mark.hosts, pytest.mark.engines,
              pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GRPC_PORT = 9000


def _ray_env(token: Path) -> dict[str, str]:
    # Token authentication, the token in a file of the test's (every node would get it).
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
            "RAY_USAGE_STATS_ENABLED": "0"}


def _ray_start(host, env, *args: str) -> None:
    out = subprocess.run([*host.run_prefix, str(BIN / "ray"), "start",
                          f"--node-ip-address={host.address}", "--num-cpus=2",
                          "--object-store-memory=100000000", "--disable-usage-stats", *args],
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def _config(model_dir: str, secret: Path) -> dict:
    def role(resource: str, **engine) -> dict:
        return {"num_replicas": 1, "num_cpus": 0.5, "resources": {resource: 1},
                "engine": {"kv_cache_mib": 64, "max_model_len": 4096, **engine},
                # Both nodes share this machine's kernel: UCX must be told to cross the
                # link (between machines it picks the network itself).
                "runtime_env": {"env_vars": {
                    "UCX_TLS": "tcp"}}}

    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "grpc_options": {"port": GRPC_PORT, "grpc_servicer_functions": [
            "kvhandoff.v1.router_pb2_grpc.add_RouterServicer_to_server"]},
        "applications": [{
            "name": "kvhandoff", "route_prefix": "/kvhandoff",
            "import_path": "deploy.app:build_app",
            "args": {"model": model_dir, "device": "cpu", "lease_s": 30,
                     "handoff_secret_file": str(secret),
                     "prefill": role("prefill_node"),
                     # The negative control faults D's import through the proxy.
                     "decode": role("decode_node", fault_injection=True),
                     # On the head: the node loss takes D only.
                     "router": {"num_cpus": 0.25, "resources": {"router_node": 1}}}}]}


#: What a request sent while D's node is gone ends with (UNAVAILABLE): the watch's
#: refusal of a call no replica takes (deploy/handles.py ``ReplicaWatch.gone``), Ray's
#: error for a call to the dead replica (``HandleStub._error``), or the router's pool
#: with no D left in rotation (router/errors.py ``none_in_rotation``).
D_LOST = ("no running replica of deployment 'Decode'", "engine replica unavailable",
          "no decode engine is reachable")


def _generate(address: str, request_bytes: bytes, timeout_s: float = 120.0) -> bytes:
    """Runs on the head's host: one request through Serve's gRPC proxy."""
    import grpc

    from kvhandoff.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        resp = router_pb2_grpc.RouterStub(channel).Generate(
            router_pb2.GenerateRequest.FromString(request_bytes), timeout=timeout_s,
            metadata=(("application", "kvhandoff"),))
    return resp.SerializeToString()


def _request(seed: int, path: str, prompt_len: int = 120, first: int = 40):
    from tools.client import make_request

    return make_request(prompt=list(range(first, first + prompt_len)), max_tokens=32,
                        seed=seed, beam_width=4, path=path,
                        request_id=f"ray-hosts-{path}-{seed}")


def _send(cluster, req, timeout_s: float = 120.0):
    from kvhandoff.v1 import router_pb2

    raw = call(cluster["head"], _generate, cluster["proxy"], req.SerializeToString(),
               timeout_s)
    return router_pb2.GenerateResponse.FromString(raw)


def _wait_answering(cluster, timeout_s: float, seed: int = 0):
    """The first handoff that succeeds through the proxy, waiting for Serve."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert cluster["serve"].poll() is None, cluster["serve_log"]()
        try:
            got = _send(cluster, _request(seed, "handoff"))
            if not got.stats.recomputed:
                return got
        except RuntimeError as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"no answer in {timeout_s:.0f}s: {e}\n"
                                     f"{cluster['serve_log']()}") from e
        time.sleep(5)


def _hosts_of(title: str) -> set[str]:
    """The network namespaces of the processes whose command line names ``title`` (Ray
    titles a replica's process ``ray::ServeReplica:<app>:<deployment>``)."""
    import psutil

    # Not this host's (the other lane's Serve tests run there, with the same titles).
    pids = [p.pid for p in psutil.process_iter(["cmdline"])
            if title in " ".join(p.info["cmdline"] or []) and not in_this_netns(p.pid)]
    return {subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                           text=True).stdout.strip() for pid in pids}


def _kill_matching(pattern: str) -> None:
    subprocess.run(["pkill", "-9", "-f", "--", pattern])


def _netns_pids(host) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True,
                          text=True).stdout.split()


def _kill_hosts_processes(*hosts_) -> None:
    """Every process left on ``hosts_``: Ray retitles some of its own (``ray::
    DashboardAgent``, ``ray::RuntimeEnvAgent``) and starts its client server without the
    session directory in their command lines, so ``_kill_matching`` missed them, and they
    outlived the test with their network namespace gone."""
    deadline = time.monotonic() + 15
    while (pids := [pid for host in hosts_ for pid in _netns_pids(host)]):
        assert time.monotonic() < deadline, f"processes outlive SIGKILL on the hosts: {pids}"
        subprocess.run(["kill", "-9", *pids], capture_output=True)
        time.sleep(0.5)


def _stop_serve(cluster) -> None:
    """Ctrl-C ``serve run``, SIGKILL after 15 s: the fixture kills every process of the
    cluster after it anyway (``serve run`` waited out 90 s here once a node had been lost;
    its own Ctrl-C shutdown is tests/test_ray_serve_documented.py's subject)."""
    serve = cluster["serve"]
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


@pytest.fixture(scope="module")
def two_nodes(model_dir, tmp_path_factory):
    why = can_create()
    if why:
        pytest.skip(why)
    import yaml

    work = tmp_path_factory.mktemp("ray-hosts")
    token, secret = work / "ray.token", work / "handoff.secret"
    for path in (token, secret):
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(_config(model_dir, secret)))
    # Ray's session files: short (socket paths are limited) and this run's own, so that
    # ending the cluster ends exactly its processes (``pkill -f``).
    temp_dir = f"/tmp/kvhr{os.getpid()}"
    env = _ray_env(token)
    serve = None
    with hosts(("head", "worker")) as h:
        head, worker = h["head"], h["worker"]
        try:
            _ray_start(head, env, "--head", "--port=6379", "--include-dashboard=false",
                       f"--temp-dir={temp_dir}",
                       '--resources={"prefill_node": 1, "router_node": 1}')
            worker_args = (f"--address={head.address}:6379", '--resources={"decode_node": 1}')
            _ray_start(worker, env, *worker_args)
            log_path = work / "serve-run.log"
            with log_path.open("w") as log:
                serve = subprocess.Popen(
                    [*head.run_prefix, str(BIN / "serve"), "run", "--address",
                     f"{head.address}:6379", str(config)], cwd=ROOT, env=env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True)
            cluster = {"head": head, "worker": worker, "proxy": f"{head.address}:{GRPC_PORT}",
                       "serve": serve, "env": env, "worker_args": worker_args,
                       "temp_dir": temp_dir,
                       "serve_log": lambda: log_path.read_text(errors="replace")[-3000:]}
            _wait_answering(cluster, 600)
            yield cluster
        finally:
            if serve is not None:
                _stop_serve({"serve": serve})
            _kill_matching(temp_dir)  # every process of this cluster, both nodes
            _kill_hosts_processes(head, worker)  # and what Ray started without its name
            shutil.rmtree(temp_dir, ignore_errors=True)


def test_p_and_d_on_two_nodes_answer_identically_over_the_link(two_nodes):
    """Through Serve's gRPC proxy: two handoffs, each on a prompt of its own, import their
    whole parent and equal their colocated twins (:func:`assert_identical`); the negative
    control, a third with D's import faulted through the proxy (block 0 zeroed), fails the
    same check. D's replica and its engine run on the worker's host, P's and the router's
    on the head's (the processes' network namespaces), so the KV crossed the link (UCX
    over TCP, the only path between the hosts)."""
    for seed, fault in ((1, ""), (2, ""), (3, "zero-block")):
        first = 40 + 200 * seed  # not the fixture's prompt: D imports the whole parent
        req = _request(seed, "handoff", first=first)
        req.fault = fault
        got = _send(two_nodes, req)
        ref = _send(two_nodes, _request(seed, "colocated", first=first))
        if not fault:
            assert_identical(got, ref)
            continue
        with pytest.raises(AssertionError, match="cum_logprob|beams differ"):
            assert_identical(got, ref)
        assert not got.stats.recomputed and got.stats.num_imported_tokens > 0, got.stats
    for title, host in (("ServeReplica:kvhandoff:Decode", two_nodes["worker"]),
                        ("ServeReplica:kvhandoff:Prefill", two_nodes["head"]),
                        ("ServeReplica:kvhandoff:Router", two_nodes["head"])):
        where = _hosts_of(title)
        assert where == {host.netns}, (title, where)


def test_the_worker_node_lost_and_back_serves_again(two_nodes):
    """D's node goes away: every process on the worker's host is killed (raylet, D's
    replica, its engine), as a machine powering off. Requests meanwhile end UNAVAILABLE
    for D's loss (:data:`D_LOST`; no D is left to recompute on: D's only replica needs
    the worker's ``decode_node``), well before the client's 90 s deadline (Serve would
    queue a call for a deployment with no running replica until the node returns:
    ``HandleStub``'s watch fails it); the node started again gets D back (its
    ``decode_node`` resource) and a handoff on a new prompt imports its whole parent."""
    worker = two_nodes["worker"]
    pids = subprocess.run(["ip", "netns", "pids", worker.netns], capture_output=True,
                          text=True, check=True).stdout.split()
    assert pids
    subprocess.run(["kill", "-9", *pids])
    outcomes = []
    for seed in (10, 11):
        sent = time.monotonic()
        try:
            got = _send(two_nodes, _request(seed, "handoff"), timeout_s=90)
        except RuntimeError as e:
            text = str(e)
        else:
            raise AssertionError(f"answered with D's node gone: {got.stats}")
        took = time.monotonic() - sent
        outcome = text.split("details = ")[-1].split("\n")[0][:160]
        assert "UNAVAILABLE" in text and any(why in text for why in D_LOST), text
        outcomes.append(f"{outcome} after {took:.0f}s")
        # Ended by the watch (two polls of Serve's status), not at the 90 s deadline:
        # 12 s and 5 s were seen here.
        assert took < 45, outcomes
    print(f"worker lost: {json.dumps(outcomes)}")
    time.sleep(2)
    _ray_start(worker, two_nodes["env"], *two_nodes["worker_args"])
    t1 = time.monotonic()
    _wait_answering(two_nodes, 420, seed=12)
    # A try of seed 12 that D recomputed while its engine came back left that parent in
    # D's prefix cache (one CI run then found all 128 tokens there, none imported): a
    # request on a prompt of its own shows the whole parent crossing the link again.
    got = _send(two_nodes, _request(13, "handoff", first=840))
    assert_handed_off(got)
    assert _hosts_of("ServeReplica:kvhandoff:Decode") == {worker.netns}
    print(f"worker back: a handoff imported again {time.monotonic() - t1:.0f}s after "
          "`ray start`")

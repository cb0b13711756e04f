"""Start and stop kvhandoff servers as separate processes: the public launcher the demo,
the bench, the soak and the tests use (``spawn``, ``stop``, ``wait_serving``,
``local_cluster``), and what they measure of them (``pool_state``, ``rss_mib``,
``paused``, ``CapacityProbe``).

Each server runs ``python -m cli.main serve`` in its own process group, so stopping
it also ends its engine core and workers: nothing is left running.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvhandoff.keys import load_engine_key, with_key
from kvhandoff.ports import free_port
from kvhandoff.tls import ChannelTLS
from tools.netns import Host


@dataclass
class ServerProcess:
    role: str
    address: str
    proc: subprocess.Popen
    log_path: Path
    #: Prometheus endpoint (http://host:port/metrics).
    metrics_url: str = ""


def spawn(role: str, port: int, extra: list[str], log_dir: Path,
           name: str | None = None, host: Host | None = None,
           env: dict[str, str] | None = None) -> ServerProcess:
    """``kvhandoff serve --role role`` on 127.0.0.1, or on ``host`` (tools.netns: in its
    namespace, serving and advertising the host's address), ``env`` added."""
    log_path = log_dir / f"{name or role}.log"
    metrics_port = free_port()
    address = host.address if host else "127.0.0.1"
    cmd = [*(host.run_prefix if host else []), sys.executable, "-m", "cli.main", "serve",
           "--role", role, "--port", str(port), "--metrics-port", str(metrics_port), *extra]
    if host:
        cmd += ["--host", address]
        if role != "router":
            cmd += ["--side-channel-host", address]
    if role != "router" and "--side-channel-port" not in extra:
        # Chosen here with the other ports, so no two servers started together share it.
        cmd += ["--side-channel-port", str(free_port())]
    with open(log_path, "w") as log:
        # Own process group: the engine's own processes die with it on shutdown
        # (``ip netns exec`` execs the server: the same process).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, **env} if env else None)
    return ServerProcess(role, f"{address}:{port}", proc, log_path,
                         f"http://{address}:{metrics_port}/metrics")


def stop(servers: list[ServerProcess], grace_s: float = 30.0) -> None:
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for s in servers:
        try:
            s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        # Whatever is left of the group (engine core, workers) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(s.proc.pid, signal.SIGKILL)
        s.proc.wait()


def wait_serving(address: str, servers: list[ServerProcess], timeout_s: float = 300.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            for s in servers:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.role} server exited ({s.proc.returncode}); "
                                       f"see {s.log_path}")
            with contextlib.suppress(grpc.RpcError):
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.5)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f}s")


def _wait_serving_tls(address: str, timeout_s: float, tls: ChannelTLS | None) -> None:
    wait_serving(address, [], timeout_s, tls.credentials() if tls else None)


def wait_serving_on(host: Host, address: str, servers: list[ServerProcess],
                    timeout_s: float = 300.0, tls: ChannelTLS | None = None) -> None:
    """:func:`wait_serving` run on ``host`` (the only place that reaches ``address``),
    in windows of 20 s between which the servers are checked from here."""
    from tools.netns import call

    deadline = time.monotonic() + timeout_s
    while True:
        for s in servers:
            if s.proc.poll() is not None:
                raise RuntimeError(f"{s.role} server exited ({s.proc.returncode}); "
                                   f"see {s.log_path}")
        window = min(20.0, deadline - time.monotonic())
        if window <= 0:
            raise TimeoutError(f"{address} not serving after {timeout_s:.0f}s")
        try:
            return call(host, _wait_serving_tls, address, window, tls, timeout_s=window + 60)
        except RuntimeError as e:
            if "TimeoutError" not in str(e):
                raise


#: Hosts of one machine share its kernel, so UCX would READ through shared memory (cma)
#: between them; TCP makes a handoff cross the link as it would between machines.
HOSTS_UCX_TLS = "tcp"


@contextlib.contextmanager
def local_cluster(model: str | None, log_dir: Path, *, decode_mib: int = 64,
                  prefill_mib: int = 128, lease_s: int = 30,
                  extra_decode: int = 0,
                  extra_prefill: int = 0,
                  engine_flags: tuple[str, ...] = (),
                  router_flags: tuple[str, ...] = (),
                  signed: bool = True,
                  on_hosts: dict[str, Host] | None = None,
                  server_flags: dict[str, tuple[str, ...]] | None = None,
                  client_tls: ChannelTLS | None = None,
                  engine_key_file: Path | None = None) -> Iterator[dict[str, object]]:
    """P, D (and ``extra_prefill`` more Ps, ``extra_decode`` more Ds) and a router, each
    its own process (the router lists P first). With
    ``signed``, P and D share a fresh secret (a 0600 file in ``log_dir``): P signs each
    handoff for its D and D refuses any other. With ``on_hosts`` (tools.netns hosts
    ``p``, ``d``, ``r``), P, the Ds and the router run on those hosts, the engines with
    ``UCX_TLS=HOSTS_UCX_TLS`` and UCX's protocol tables in ``log_dir/<name>.<pid>.ucx.log``
    (tools.ucx_report); clients must then run on a host too (tools.netns.call).
    ``server_flags`` adds flags per server name ("prefill", "decode", "decode1", ...,
    "router": e.g. each one's TLS certificate); ``client_tls`` is how this waits for the
    router when it serves TLS. ``engine_key_file``: the engines require that engine key
    and the router sends it (without it, the servers take the environment's, if any:
    ``kvhandoff.keys``). On hosts, engines without mutual TLS get a fresh key (a 0600 file
    in ``log_dir``), and a router without mutual TLS or an API key is ``--insecure``: its
    clients run on hosts only this machine reaches."""
    from tools.ucx_report import ucx_env

    log_dir.mkdir(parents=True, exist_ok=True)
    model_args = ["--model", model] if model else []
    engine_args = [*model_args, "--lease-s", str(lease_s), *engine_flags]
    secret_file = None
    if signed:
        secret_file = _secret_file(log_dir / "handoff.secret")
        engine_args += ["--handoff-secret-file", str(secret_file)]
    more = server_flags or {}
    if on_hosts and engine_key_file is None and not any(
            "--tls-client-ca" in flags for name, flags in more.items() if name != "router"):
        engine_key_file = _secret_file(log_dir / "engine.key")
    key_args = ["--engine-key-file", str(engine_key_file)] if engine_key_file else []
    engine_args += key_args
    router_args = list(key_args)
    if on_hosts and not {"--tls-client-ca", "--api-key"} & {*router_flags,
                                                          *more.get("router", ())}:
        router_args.append("--insecure")
    h = on_hosts or {}

    def engine_env(name: str) -> dict[str, str] | None:
        if not on_hosts:
            return None
        for old in log_dir.glob(f"{name}.*.ucx.log"):
            old.unlink()
        return {"UCX_TLS": HOSTS_UCX_TLS, **ucx_env(str(log_dir / f"{name}.%p.ucx.log"))}

    servers: list[ServerProcess] = []
    try:
        p = spawn("prefill", free_port(), [*engine_args, "--kv-cache-mib", str(prefill_mib),
                                           *more.get("prefill", ())],
                  log_dir, host=h.get("p"), env=engine_env("prefill"))
        servers.append(p)
        prefills = [p]
        for i in range(1, 1 + extra_prefill):
            prefills.append(spawn("prefill", free_port(),
                                  [*engine_args, "--kv-cache-mib", str(prefill_mib),
                                   *more.get(f"prefill{i}", ())],
                                  log_dir, name=f"prefill{i}", host=h.get("p"),
                                  env=engine_env(f"prefill{i}")))
        servers.extend(prefills[1:])
        decodes = []
        for i in range(1 + extra_decode):
            name = f"decode{i}" if i else "decode"
            d = spawn("decode", free_port(), [*engine_args, "--kv-cache-mib", str(decode_mib),
                                              *more.get(name, ())],
                      log_dir, name=name if i else None, host=h.get("d"), env=engine_env(name))
            decodes.append(d)
        servers.extend(decodes)
        router = spawn("router", free_port(), [*model_args, "--prefill",
                                               ",".join(x.address for x in prefills), "--decode",
                                               ",".join(d.address for d in decodes),
                                               *router_args, *router_flags,
                                               *more.get("router", ())],
                       log_dir, host=h.get("r"))
        servers.append(router)
        if on_hosts:
            wait_serving_on(on_hosts["r"], router.address, servers, tls=client_tls)
        else:
            wait_serving(router.address, servers,
                         credentials=client_tls.credentials() if client_tls else None)
        yield {"router": router.address, "prefill": p, "prefills": prefills, "decode": decodes,
               "servers": servers,
               "router_metrics": router.metrics_url, "secret_file": secret_file,
               "engine_key_file": engine_key_file}
    finally:
        stop(servers)


def _secret_file(path: Path) -> Path:
    """A fresh random secret in ``path``, readable by its owner only."""
    path.touch()
    path.chmod(0o600)
    path.write_text(secrets.token_hex(32))
    return path


def engine_channel(address: str, tls: ChannelTLS | None = None) -> grpc.Channel:
    """A blocking channel to the engine server at ``address`` whose calls send the
    environment's engine key, if any (``kvhandoff.keys.load_engine_key``), as a router
    started in this environment does."""
    channel = (grpc.insecure_channel(address) if tls is None
               else grpc.secure_channel(address, tls.credentials()))
    return with_key(channel, load_engine_key())


def pool_state(address: str, timeout_s: float = 5.0, tls: ChannelTLS | None = None):
    """(clean, capacity) of the engine server at ``address``: clean = no block held and
    no request running, waiting or reserved."""
    from kvhandoff.v1 import engine_pb2, engine_pb2_grpc

    with engine_channel(address, tls) as channel:
        cap = engine_pb2_grpc.EngineStub(channel).GetCapacity(engine_pb2.CapacityRequest(),
                                                              timeout=timeout_s)
    clean = (cap.num_free_blocks == cap.num_total_blocks and not cap.num_running_reqs
             and not cap.num_waiting_reqs and not cap.num_reserved_blocks)
    return clean, cap


def wait_pool_clean(address: str, timeout_s: float, tls: ChannelTLS | None = None):
    """Poll ``pool_state`` until clean or ``timeout_s``; returns the last (clean, cap)."""
    deadline = time.monotonic() + timeout_s
    while True:
        clean, cap = pool_state(address, tls=tls)
        if clean or time.monotonic() > deadline:
            return clean, cap
        time.sleep(0.1)


def rss_mib(server: ServerProcess) -> float:
    """Resident memory of a server and all its processes (engine core, workers)."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def rss_by_process_mib(server: ServerProcess) -> dict[str, float]:
    """Resident memory of each of a server's processes, by ``name:pid`` (the server, its
    engine core, any worker), and their unique set size (``uss``, not shared with
    another process): which one grows, where ``rss_mib`` only says that one does."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    out = {}
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
            out[f"{p.name()}:{p.pid}"] = round(info.rss / 2**20, 1)
            out[f"{p.name()}:{p.pid}:uss"] = round(info.uss / 2**20, 1)
        except psutil.Error:  # gone between the listing and the read
            continue
    return out


def cpu_s(server: ServerProcess) -> float:
    """CPU seconds (user + system) a server and its live processes have used so far."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


@contextlib.contextmanager
def paused(server: ServerProcess) -> Iterator[None]:
    """SIGSTOP a server and all its processes for the block, then SIGCONT them: a host
    too busy to run it, as seen from outside (its sockets accept, nothing answers)."""
    import psutil

    proc = psutil.Process(server.proc.pid)
    procs = [proc, *proc.children(recursive=True)]
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)


class CapacityProbe:
    """Calls GetCapacity on each engine every ``interval_s`` from a thread, as the
    router's poller does, and keeps the round-trip times: how promptly the control plane
    answers under load (``percentiles``)."""

    def __init__(self, servers: list[ServerProcess], interval_s: float = 0.1,
                 timeout_s: float = 5.0):
        self.servers, self.interval_s, self.timeout_s = servers, interval_s, timeout_s
        self.seconds: dict[str, list[float]] = {s.role: [] for s in servers}
        self.failures: dict[str, int] = {s.role: 0 for s in servers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capacity-probe", daemon=True)

    def __enter__(self) -> CapacityProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from kvhandoff.v1 import engine_pb2, engine_pb2_grpc

        channels = [engine_channel(s.address) for s in self.servers]
        stubs = [engine_pb2_grpc.EngineStub(c) for c in channels]
        try:
            while not self._stop.wait(self.interval_s):
                for server, stub in zip(self.servers, stubs):
                    t0 = time.perf_counter()
                    try:
                        stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=self.timeout_s)
                    except grpc.RpcError:
                        self.failures[server.role] += 1
                    self.seconds[server.role].append(time.perf_counter() - t0)
        finally:
            for c in channels:
                c.close()

    def percentiles(self) -> dict[str, dict[str, float]]:
        """Per role: calls, p50, p99 and max round trip in ms, and failed calls."""
        return {role: {"calls": len(xs), "p50_ms": round(percentile(xs, 0.50) * 1e3, 1),
                       "p99_ms": round(percentile(xs, 0.99) * 1e3, 1),
                       "max_ms": round(max(xs) * 1e3, 1), "failed": self.failures[role]}
                for role, xs in self.seconds.items() if xs}


def percentile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank; 0.0 for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0

"""The kvhandoff application on a local Ray instance, for the benches and the Ray tests:
Ray started with logical CPUs, Serve with its gRPC proxy, and the waits until the
application's replicas run and the proxy routes it. Whoever starts Ray here shuts it
down (``serve.shutdown``, ``ray.shutdown``): the replicas' engine processes go with it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import grpc

#: The application's name, and the gRPC metadata that routes a call to it.
APP = "kvhandoff"
METADATA = (("application", APP),)


def ray_init(ray: Any, num_cpus: int = 8) -> None:
    """A local Ray instance with ``num_cpus`` logical CPUs (Ray only accounts them; the
    engines share the machine's cores). Started again once if its raylet did not
    register within Ray's own 30 s: seen once on this 2-core machine with the other
    lane busy, a start that takes no part in what is measured."""
    import psutil

    for attempt in (1, 2):
        before = {c.pid for c in psutil.Process().children(recursive=True)}
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
            return
        except Exception as e:
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            print(f"ray.init: {e}; starting Ray again")
            ray.shutdown()
            # The failed start's processes (GCS, raylet, reaper): ours to end.
            for child in psutil.Process().children(recursive=True):
                if child.pid not in before:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()


def wait_healthy(serve: Any, deployments: tuple[str, ...], timeout_s: float = 600.0, *,
                 app: str = APP) -> None:
    """Until each of ``deployments`` is HEALTHY with a replica running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and all(
                d in status.deployments and status.deployments[d].status == "HEALTHY"
                and status.deployments[d].replica_states.get("RUNNING", 0) >= 1
                for d in deployments):
            return
        time.sleep(1.0)
    raise TimeoutError(f"{deployments} not healthy after {timeout_s:.0f}s: {serve.status()}")


def wait_replicas(serve: Any, deployment: str, n: int, timeout_s: float = 300.0, *,
                  app: str = APP) -> None:
    """Until ``n`` replicas of ``deployment`` run."""
    deadline = time.monotonic() + timeout_s
    while serve.status().applications[app].deployments[deployment].replica_states.get(
            "RUNNING", 0) < n:
        assert time.monotonic() < deadline, f"{deployment}: fewer than {n} replicas run"
        time.sleep(1.0)


def wait_proxy_routes(address: str, timeout_s: float = 120.0, *, app: str = APP) -> None:
    """Until Serve's gRPC proxy at ``address`` lists ``app``."""
    from ray.serve.generated import serve_pb2, serve_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = serve_pb2_grpc.RayServeAPIServiceStub(channel)
        while True:
            try:
                if app in stub.ListApplications(serve_pb2.ListApplicationsRequest(),
                                                timeout=5).application_names:
                    return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)


@contextlib.contextmanager
def local_serve(num_cpus: int = 8) -> Iterator[Any]:
    """Ray and Serve started here (gRPC proxy on a free loopback port, HTTP on another),
    shut down at exit; yields ``serve`` with ``.grpc_address`` and ``.http_address``."""
    import ray
    from ray import serve

    from deploy.app import GRPC_SERVICER_FUNCTIONS
    from kvhandoff.ports import free_port

    grpc_port, http_port = free_port(), free_port()
    ray_init(ray, num_cpus)
    try:
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": http_port},
                    grpc_options={"port": grpc_port,
                                  "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS})
        serve.grpc_address = f"127.0.0.1:{grpc_port}"
        serve.http_address = f"http://127.0.0.1:{http_port}"
        yield serve
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(serve: Any, args: dict[str, Any], *, app: str = APP) -> None:
    """``build_app(args)`` run as ``app`` (route prefix ``/kvhandoff``); returns once
    every replica it asks for runs and the gRPC proxy routes it."""
    from deploy.app import build_app

    serve.run(build_app(args), name=app, route_prefix="/kvhandoff", blocking=False)
    wait_deployed(serve, args, app=app)


def wait_deployed(serve: Any, args: dict[str, Any], *, app: str = APP) -> None:
    """Until every replica ``args`` asks for runs and the gRPC proxy routes ``app``."""
    wait_healthy(serve, ("Prefill", "Decode", "Router"), app=app)
    for role, name in (("prefill", "Prefill"), ("decode", "Decode"), ("router", "Router")):
        wait_replicas(serve, name, int(args.get(role, {}).get("num_replicas", 1)), app=app)
    wait_proxy_routes(serve.grpc_address, app=app)

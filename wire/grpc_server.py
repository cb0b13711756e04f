"""What every kvhandoff gRPC server shares (engine servers and routers): message limits,
the start-up sequence (health NOT_SERVING until the caller says otherwise, reflection,
the port with or without TLS), and waiting for a shutdown signal. Light: grpc only."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvhandoff.tls import ServerTLS, add_port
from wire.undecodable import RefuseUndecodable

#: Engine messages carry token lists; 64 MiB is far above any valid request.
MAX_MESSAGE_BYTES = 64 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # The router pings every 10 s, also between calls (router.core.CHANNEL_OPTIONS):
    # accepted down to every 5 s, where gRPC's default (5 min) would answer GOAWAY.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]):
    """Register gRPC health (NOT_SERVING until ``set_serving``) and reflection."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME,
                                         reflection.SERVICE_NAME], server)
    return health_servicer


async def wait_for_shutdown_signal(engine_failed: Callable[[], bool] | None = None,
                                   poll_s: float = 1.0) -> bool:
    """Wait for SIGTERM/SIGINT, or for ``engine_failed()`` to turn true. True = signal."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    while not stop.is_set():
        if engine_failed is not None and engine_failed():
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    return True


async def start_server(add_servicer: Callable[[grpc.aio.Server], None], service: str,
                       host: str, port: int, tls: ServerTLS | None = None
                       ) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start a gRPC server for one service (``add_servicer`` registers it): returns the
    server, its health servicer (every name NOT_SERVING until :func:`set_serving`) and
    the port it bound. A request that does not parse is INVALID_ARGUMENT
    (``wire.undecodable``)."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=[RefuseUndecodable()])
    add_servicer(server)
    health_servicer = add_health_and_reflection(server, [service])
    bound = add_port(server, f"{host}:{port}", tls)
    await server.start()
    await set_serving(health_servicer, service, False)
    return server, health_servicer, bound


async def set_serving(health_servicer: health.aio.HealthServicer, service: str,
                      serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", service):
        await health_servicer.set(name, status)


#: Buckets of ``kvhandoff_event_loop_lag_seconds``: a control RPC answered within 100 ms
#: needs the loop's lag well below that.
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def loop_lag_histogram(registry):
    """``kvhandoff_event_loop_lag_seconds{loop}`` on ``registry`` (prometheus_client)."""
    from prometheus_client import Histogram

    return Histogram("kvhandoff_event_loop_lag_seconds",
                     "How late the server's asyncio loop ran a timer (what a control RPC "
                     "such as GetCapacity waits before it is even read)", ["loop"],
                     buckets=LOOP_LAG_BUCKETS, registry=registry)


async def watch_loop_lag(histogram, loop_name: str, interval_s: float = 0.05) -> None:
    """Observe, every ``interval_s`` until cancelled, how late this loop woke a sleeper."""
    child = histogram.labels(loop_name)
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(interval_s)
        child.observe(max(0.0, time.perf_counter() - t0 - interval_s))

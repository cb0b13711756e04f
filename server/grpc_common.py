"""What every kvhandoff gRPC server shares (engine servers and routers): message limits,
health and reflection, and waiting for a shutdown signal. Light: grpc only."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

#: Engine messages carry token lists; 64 MiB is far above any valid request.
MAX_MESSAGE_BYTES = 64 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
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

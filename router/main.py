"""``kvhandoff serve --role router``: the router's process. It wires the parts and the
fronts: one :class:`~router.core.Router`, one :class:`~router.api.RouterAPI` (one guard
for every front), the gRPC service, optionally the HTTP front and the Prometheus
endpoint; serves until SIGTERM/SIGINT and then stops the fronts first, the engines'
channels last."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any

from kvhandoff.tls import ServerTLS
from router.api import RouterAPI
from router.auth import Credentials
from router.config import RouterConfig
from router.core import Router
from router.http import HttpFront
from router.metrics import RouterMetrics
from router.service import SERVICE_NAME, add_router_service
from wire.grpc_server import set_serving, start_server, wait_for_shutdown_signal, watch_loop_lag

logger = logging.getLogger(__name__)


async def serve_http(api: RouterAPI, host: str, port: int, tls: ServerTLS | None = None):
    """Start the HTTP front on this loop (HTTPS with ``tls``, the gRPC server's
    certificate; its client CA, if any, makes client certificates required); returns
    (uvicorn server, task, bound port)."""
    import uvicorn

    front = HttpFront(api)
    ssl_args: dict[str, Any] = {}
    if tls is not None:
        ssl_args = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
        if tls.client_ca:
            ssl_args.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(front.app, host=host, port=port, log_level="warning",
                            lifespan="off", timeout_graceful_shutdown=2, **ssl_args)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the router handles SIGTERM/SIGINT
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start (e.g. the port is taken)
            raise RuntimeError("the HTTP front stopped before it started")
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, task, bound


async def _wait_for_engines(router: Router, report_every_s: float = 10.0) -> None:
    """Until a P (and a D, if any are configured) answers; engines that are down are
    skipped until they answer. Every ``report_every_s`` it logs why each engine is not
    in rotation (down, or refusing this router: a missing engine key)."""
    waited_s = 0.0
    while True:
        await router.refresh_capacity()
        if any(ep.capacity for ep in router.prefill) and (
                not router.decode or any(ep.capacity for ep in router.decode)):
            return
        await asyncio.sleep(0.5)
        waited_s += 0.5
        if waited_s % report_every_s == 0:
            logger.warning("not serving yet, after %gs: %s", waited_s, "; ".join(
                f"{ep.address}: {ep.out_reason}" for ep in (*router.prefill, *router.decode)
                if ep.capacity is None))


async def serve_router(config: RouterConfig, host: str, port: int,
                       metrics_port: int | None = None, tls: ServerTLS | None = None,
                       http_port: int | None = None,
                       credentials: Credentials | None = None) -> None:
    """Serve the Router over gRPC (and, with ``http_port``, the OpenAI-compatible HTTP
    front, with the same ``tls``), both guarded by ``credentials`` (``router.auth``),
    until SIGTERM/SIGINT."""
    router = Router(config)
    metrics = RouterMetrics()
    metrics.track_engines(router)
    credentials = credentials or Credentials()
    api = RouterAPI(router, metrics, credentials)
    if metrics_port is not None:
        bound_metrics = metrics.serve(host, metrics_port)
        print(f"kvhandoff router metrics on http://{host}:{bound_metrics}/metrics", flush=True)
    router.chunks.hold_registrations()  # until an earlier run's chunks are released
    server, health, bound = await start_server(
        lambda s: add_router_service(api, s), SERVICE_NAME, host, port, tls)
    # SERVING once a prefill engine (and a decode engine, if any) answers.
    await _wait_for_engines(router)
    await router.chunks.release_leftovers()
    if config.warm_up:
        await router.warm_up()
    poller = asyncio.create_task(router.poll_capacity())
    lag = asyncio.create_task(watch_loop_lag(metrics.loop_lag, "router"))
    http = None
    if http_port is not None:
        http, http_task, bound_http = await serve_http(api, host, http_port, tls)
        scheme = "https" if tls is not None else "http"
        print(f"kvhandoff router HTTP (OpenAI-compatible) on {scheme}://{host}:{bound_http}",
              flush=True)
    await set_serving(health, SERVICE_NAME, True)
    guard = ("open: no keys" if credentials.open else
             f"client key {'required' if credentials.client_key else 'not required'}, "
             f"operator calls {'by key' if credentials.operator_key else 'off'}")
    guard += ", engine key sent" if config.engine_key else ", no engine key"
    print(f"kvhandoff router serving on {host}:{bound} ({guard})", flush=True)
    try:
        await wait_for_shutdown_signal()
    finally:
        if http is not None:
            http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(http_task, 5)
        await health.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        for task in (poller, lag):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await router.close()

"""The Router deployment as Serve's HTTP ingress, without a Ray cluster: the ASGI app a
replica builds (``RouterServer.__serve_build_asgi_app__``) is the standalone router's
HTTP front over that replica's :class:`~deploy.replica_api.ReplicaAPI`, so it wants the
router's keys and shares the replica's one admission with the gRPC front; a handler
Serve cancels (its client gone) cancels its request. The engines
are never called (their snapshots are given); the shared store is the store actor's
class called in process (tests/test_serve_state_unit.py's handle), the one fake part.
On Ray, with the ``openai`` client through Serve's HTTP proxy: tests/test_ray_serve.py."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import httpx

from deploy.replica_api import ReplicaAPI
from deploy.router_server import RouterServer
from deploy.shared import SharedState
from deploy.state import RouterState
from kvhandoff.model import resolve_model
from kvhandoff.v1 import engine_pb2
from router.auth import Credentials
from tests.test_serve_state_unit import CONFIG, _Handle

KEY, OPERATOR_KEY = "client-key", "operator-key"


def _replica_api(max_inflight: int) -> ReplicaAPI:
    """One replica's API (rank 0 of 2) over a store in this process, its engines
    already checked and their snapshots taken (as after its first health check)."""
    config = dataclasses.replace(CONFIG, model=str(resolve_model("builtin")),
                                 max_inflight=max_inflight)
    shared = SharedState("app", config, lambda: (0, 2))
    handle = _Handle(RouterState(16, 300.0, rebuilding=False))
    api = ReplicaAPI.over_stubs(config, None, None, credentials=Credentials(KEY, OPERATOR_KEY),
                                stores=shared.stores, shared=shared, engines=(None, None),
                                max_beam_width=32, rank=lambda: (0, 2))
    shared._actor = lambda: handle  # noqa: SLF001 (the test's store)
    shared._handle = handle  # noqa: SLF001
    api._checked = True  # noqa: SLF001 (P and D agree: nothing to ask them)
    for ep in api.router.pool.endpoints:
        ep.capacity = engine_pb2.Capacity(num_total_blocks=400, num_free_blocks=400,
                                          block_size=16, vocab_size=1024,
                                          max_model_len=4096)
    return api


def _app(api: ReplicaAPI):
    """What Serve does with a replica of the deployment, once constructed (here: only
    its API): build its ASGI app."""
    return RouterServer.func_or_class.__serve_build_asgi_app__(SimpleNamespace(api=api))


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                             base_url="http://replica")


def test_the_router_deployment_is_an_http_ingress_that_keeps_its_grpc_methods():
    """Serve's HTTP proxy calls the ASGI app; its gRPC proxy calls methods by the RPC's
    name: both on the one deployment."""
    from ray.serve._private.http_util import ASGIAppReplicaWrapper

    cls = RouterServer.func_or_class
    assert issubclass(cls, ASGIAppReplicaWrapper)
    for rpc in ("Generate", "GenerateStream", "StartParent", "Continue", "ReleaseParent",
                "Move", "RegisterChunk", "ListChunks", "DeleteChunk", "Drain"):
        assert callable(getattr(cls, rpc)), rpc
    api = _replica_api(max_inflight=4)
    routes = {getattr(r, "path", "") for r in _app(api).routes}
    assert {"/v1/completions", "/v1/chunks", "/v1/models", "/health"} <= routes, routes


def test_the_http_front_wants_the_key_and_shares_the_replicas_admission():
    """STEP 1: without the client key, 401 as OpenAI answers (and as the standalone
    front does); listing chunks wants the operator's key (403 with the client's).
    STEP 2: with one request admitted through the gRPC front (max_inflight 1), a
    completion over HTTP is refused 429 at once with Retry-After: one guard per replica
    for both fronts. STEP 3: the request gone, listing chunks (read from the shared
    store first) answers, with the operator's key."""
    api = _replica_api(max_inflight=1)
    app = _app(api)
    completion = {"prompt": [5, 6, 7, 8], "max_tokens": 4}

    async def calls():
        async with _client(app) as http:
            # STEP 1
            assert (await http.get("/v1/models")).status_code == 401
            refused = await http.post("/v1/completions", json=completion)
            assert refused.status_code == 401, refused.text
            client = {"Authorization": f"Bearer {KEY}"}
            models = await http.get("/v1/models", headers=client)
            assert models.status_code == 200 and models.json()["data"][0]["id"]
            assert (await http.get("/v1/chunks", headers=client)).status_code == 403
            # STEP 2
            with api.admission.admit("serve"):
                busy = await http.post("/v1/completions", json=completion, headers=client)
            assert busy.status_code == 429 and busy.headers["retry-after"], busy.text
            assert "router busy: 1 requests in flight" in busy.json()["error"]["message"]
            assert api.inflight == 0
            # STEP 3
            listed = await http.get("/v1/chunks",
                                    headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
            assert listed.status_code == 200 and listed.json()["data"] == [], listed.text

    asyncio.run(calls())


def test_a_handler_cancelled_by_serve_cancels_its_request():
    """Serve cancels a replica's HTTP handler when its client goes away (uvicorn, in the
    standalone router, reports a disconnect instead): the request's work is cancelled
    with the handler, which frees P and D, not left running behind it."""
    import pytest

    from router.http import _cancel_on_disconnect

    started, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    class Connected:
        """The request as the handler sees it: its client never reported gone."""

        async def is_disconnected(self) -> bool:
            return False

    async def main() -> None:
        handler = asyncio.ensure_future(_cancel_on_disconnect(work(), Connected()))
        await started.wait()
        handler.cancel()  # what Serve does
        with pytest.raises(asyncio.CancelledError):
            await handler
        await asyncio.wait_for(cancelled.wait(), 1.0)

    asyncio.run(main())

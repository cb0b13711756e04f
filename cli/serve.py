"""``kvhandoff serve``: an engine server (``--role prefill|decode``) or the router
(``--role router``), its flags and their checks before anything starts."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from cli.args import model_arg, tls_channel_args
from kvhandoff.keys import ENGINE_KEY_ENV, ENGINE_KEY_FILE_ENV
from router.auth import API_KEY_ENV, OPERATOR_KEY_ENV


def _serve(args: argparse.Namespace) -> int:
    from connector.signing import load_secret
    from kvhandoff.keys import check_exposure, load_engine_key
    from kvhandoff.tls import channel_tls, server_tls

    try:
        tls = server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        engine_key = load_engine_key(args.engine_key_file)
        if args.role != "router":
            load_secret(args.handoff_secret_file)  # fail here, not in the engine process
            check_exposure(args.host, guarded=engine_key is not None or _client_ca(tls),
                           insecure=args.insecure,
                           add=f"--engine-key-file PATH (or ${ENGINE_KEY_FILE_ENV})")
            args.side_channel_host = side_channel_host(args.side_channel_host, args.host)
    except (ValueError, OSError) as e:
        print(f"kvhandoff serve: {e}", file=sys.stderr)
        return 2
    if args.role == "router":
        from kvhandoff.model import resolve_model
        from router import RouterConfig
        from router.auth import Credentials
        from router.main import serve_router

        try:
            credentials = Credentials(
                args.api_key or os.environ.get(API_KEY_ENV) or None,
                args.operator_key or os.environ.get(OPERATOR_KEY_ENV) or None)
            check_exposure(args.host, guarded=credentials.client_key is not None
                           or _client_ca(tls), insecure=args.insecure,
                           add=f"--api-key KEY (or ${API_KEY_ENV})")
        except ValueError as e:
            print(f"kvhandoff serve: {e}", file=sys.stderr)
            return 2

        try:
            config = RouterConfig(
                prefill=tuple(a for a in args.prefill.split(",") if a),
                decode=tuple(a for a in (args.decode or "").split(",") if a),
                model=str(resolve_model(args.model)),
                colocated_below_tokens=args.colocated_below,
                positional_sampling=args.sampling == "positional",
                warm_up=not args.no_warm_up,
                channel_tls=channel_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key),
                engine_key=engine_key,
                kv_events_key_file=args.kv_events_key,
                **{name: getattr(args, name) for name in ROUTER_FLAGS_AS_CONFIG},
            )
        except ValueError as e:  # a bad setting, or an unreadable events key
            print(f"kvhandoff serve: {e}", file=sys.stderr)
            return 2
        metrics_port = None if args.metrics_port < 0 else args.metrics_port
        http_port = None if args.http_port < 0 else args.http_port
        asyncio.run(serve_router(config, args.host, args.port, metrics_port, tls, http_port,
                                 credentials))
    else:
        from cli.engine_args import check_engine_kwargs, engine_kwargs
        from server.engine_service import serve_engine

        try:
            # A bad model path, catalog or adapter is one line here, not a traceback
            # from inside the engine's start.
            kwargs = engine_kwargs(args)
            check_engine_kwargs(args.role, kwargs)
        except (ValueError, OSError) as e:
            print(f"kvhandoff serve: {e}", file=sys.stderr)
            return 2
        metrics_port = None if args.metrics_port < 0 else args.metrics_port
        asyncio.run(serve_engine(args.role, kwargs, args.host, args.port, metrics_port, tls,
                                 engine_key))
    return 0


def _client_ca(tls: Any) -> bool:
    """Mutual TLS: only callers with a certificate of the client CA connect."""
    return tls is not None and tls.client_ca is not None


def side_channel_host(flag: str | None, host: str) -> str:
    """Where an engine's NIXL side channel listens: ``--side-channel-host``, else the
    interface ``--host`` names, else (``--host`` on every interface) 127.0.0.1. Never
    every interface: it hands out the KV pool's NIXL registration (docs/security.md)."""
    from kvhandoff.keys import is_wildcard

    if flag is not None:
        if is_wildcard(flag):
            raise ValueError(f"--side-channel-host {flag!r}: the NIXL side channel "
                             "listens on one interface; name the address Ds reach this "
                             "engine at")
        return flag
    return "127.0.0.1" if is_wildcard(host) else host


def add_serve_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run an engine server or the router (gRPC)")
    serve.add_argument("--role", choices=["prefill", "decode", "router"], required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    model_arg(serve)
    serve.add_argument("--kv-cache-mib", type=int, default=0, help="KV pool size (MiB)")
    serve.add_argument("--block-size", type=int, default=32)
    serve.add_argument("--max-model-len", type=int, default=4096)
    serve.add_argument("--max-num-seqs", type=int, default=0,
                       help="prefill/decode: the most sequences one engine step runs, each "
                            "beam slot counted (0: the widest beam, 512); at least the "
                            "widest beam group, whose slots run in one batch")
    serve.add_argument("--lease-s", type=int, default=30)
    serve.add_argument("--load-format", default=None)
    serve.add_argument("--dtype", default=None,
                       help="the dtype to run in (default: the one the model was saved in)")
    serve.add_argument("--fault-injection", action="store_true",
                       help="prefill/decode: accept requests that name an injected fault of "
                            "connector.faults (negative controls of the tests and the "
                            "harness; a request naming one is refused without this flag)")
    serve.add_argument("--catalog", action="append", default=[], metavar="NAME=PATH",
                       help="prefill/decode: a catalog of items beams may be constrained "
                            "to (one item per line: its token ids); PATH 'builtin' is the "
                            "built-in model's shop; repeat for several")
    serve.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                       help="prefill/decode: a LoRA adapter requests may name (PEFT's "
                            "files in PATH; 'builtin:SEED': a random one for the built-in "
                            "model); repeat for several. Turns vLLM's LoRA on")
    serve.add_argument("--side-channel-host", default=None,
                       help="NIXL side channel address (a node IP across hosts); default: "
                            "--host, or 127.0.0.1 when --host is every interface; never "
                            "0.0.0.0")
    serve.add_argument("--kv-events", default="loopback", metavar="loopback|off|HOST",
                       help="engines: where vLLM's KV-cache events (every prompt's token ids; "
                            "the router's cache-aware placement reads them) are published: "
                            "loopback (default: a router on this host), off, or an address "
                            "of this host (needs --kv-events-key)")
    serve.add_argument("--kv-events-key", default=None, metavar="FILE",
                       help="engines and router: a secret file (>= 16 bytes) shared by the "
                            "engines and their routers; the events are then ZMQ CURVE "
                            "(encrypted, only holders of the file read them)")
    serve.add_argument("--side-channel-port", type=int, default=0,
                       help="NIXL side channel port (0 = a free one)")
    serve.add_argument("--ucx-net-devices", default=None, metavar="DEVS",
                       help="UCX_NET_DEVICES for NIXL (e.g. eth1, mlx5_0:1; 'all' = UCX's "
                            "choice); default lo when the side channel is on 127.x, else all")
    serve.add_argument("--nixl-progress-delay-us", type=int, default=500,
                       help="NIXL progress thread sleep between sweeps (µs); 0 = NIXL's "
                            "busy-spinning thread, -1 = no thread (the engine polls)")
    _add_router_flags(serve)
    serve.add_argument("--handoff-secret-file", default=None, metavar="PATH",
                       help="P and D: sign (P) and require (D) handoffs with the shared "
                            "secret in this file (or set KVHANDOFF_HANDOFF_SECRET_FILE)")
    serve.add_argument("--engine-key-file", default=None, metavar="PATH",
                       help="P and D: every Engine call wants 'authorization: Bearer <the "
                            "key in this file>' (UNAUTHENTICATED without it); router: sends "
                            f"it to its engines. Default: ${ENGINE_KEY_FILE_ENV}, else "
                            f"${ENGINE_KEY_ENV}, else none")
    serve.add_argument("--insecure", action="store_true",
                       help="serve on a --host other than loopback with neither a key "
                            "(engines: --engine-key-file, router: --api-key) nor mutual "
                            "TLS: only on a network nothing else reaches")
    serve.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS")
    serve.add_argument("--tls-key", default=None, metavar="PEM")
    serve.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    tls_channel_args(serve, "router: ")
    serve.set_defaults(func=_serve)


#: The router's flags that are RouterConfig's fields by the same name and value.
ROUTER_FLAGS_AS_CONFIG = ("max_inflight", "decode_queue_limit", "decode_wait_s",
                          "engine_silence_s", "max_parents", "parent_ttl_s",
                          "parent_pool_share", "chunk_pool_share", "chunk_namespace",
                          "parent_hold_s", "placement",
                          "on_handoff_failure")


def _add_router_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--prefill", default="", help="router: P endpoints host:port,...")
    serve.add_argument("--decode", default="", help="router: D endpoints host:port,...")
    serve.add_argument("--metrics-port", type=int, default=-1,
                       help="serve Prometheus /metrics on this port (0 = any; default: off)")
    serve.add_argument("--colocated-below", type=int, default=0,
                       help="router: run requests whose parent is shorter colocated on P")
    serve.add_argument("--max-inflight", type=int, default=256,
                       help="router: requests run at once over all its fronts (gRPC, HTTP); "
                            "beyond, RESOURCE_EXHAUSTED / HTTP 429")
    serve.add_argument("--decode-queue-limit", type=int, default=64,
                       help="router: requests that may wait for room on a D (0 = refuse "
                            "at once); beyond, RESOURCE_EXHAUSTED")
    serve.add_argument("--decode-wait-s", type=float, default=30.0,
                       help="router: longest wait for room on a D, then RESOURCE_EXHAUSTED")
    serve.add_argument("--engine-silence-s", type=float, default=10.0,
                       help="router: an engine that has not answered for this long leaves "
                            "rotation (late answers alone keep it in; a refused connection "
                            "takes it out at once); requests wait for one that answered "
                            "within it")
    serve.add_argument("--http-port", type=int, default=-1,
                       help="router: also serve the OpenAI-compatible HTTP API (/v1/completions "
                            "with continuation_of, /v1/models, /health, /metrics) on this port "
                            "(0 = any; default: off); HTTPS with --tls-cert/--tls-key")
    serve.add_argument("--api-key", default=None,
                       help="router: every request, gRPC and HTTP, wants 'authorization: "
                            "Bearer <key>' (UNAUTHENTICATED / 401 without it); default: "
                            f"${API_KEY_ENV}, else none")
    serve.add_argument("--operator-key", default=None,
                       help="router: the key Drain, Move, ReleaseParent and requests naming a "
                            "fault want (PERMISSION_DENIED / 403 with the client's key); "
                            f"default: ${OPERATOR_KEY_ENV}; without it those calls are off "
                            "whenever --api-key is set")
    serve.add_argument("--max-parents", type=int, default=256,
                       help="router: parents (StartParent) kept for continuations; the least "
                            "recently used is forgotten first")
    serve.add_argument("--parent-ttl-s", type=float, default=300.0,
                       help="router: a parent is forgotten this long after its last use")
    serve.add_argument("--parent-pool-share", type=float, default=0.25,
                       help="router: the share of P's KV pool held parents may keep; a "
                            "parent beyond it is not held (its continuations recompute)")
    serve.add_argument("--chunk-pool-share", type=float, default=0.25,
                       help="router: the share of P's KV pool named KV chunks may hold; "
                            "beyond it the least recently used are evicted")
    serve.add_argument("--chunk-namespace", default="default",
                       help="router: what its named KV chunks are called on the Ps; at its "
                            "start it releases every chunk there under it (routers sharing "
                            "Ps need their own)")
    serve.add_argument("--parent-hold-s", type=float, default=0.0,
                       help="router: how long P holds a parent's blocks for continuations "
                            "(seconds, at most P's --lease-s; 0 = P's lease)")
    serve.add_argument("--placement", choices=["load", "cache"], default="cache",
                       help="router: where requests go: 'cache' (the default: what each "
                            "engine's prefix cache holds, from its KV events, weighed "
                            "against its queue: router.placement) or 'load' (the P with "
                            "the fewest requests outstanding, the D with the most room)")
    serve.add_argument("--sampling", choices=["positional", "vllm"], default="positional",
                       help="router: how stage 1 samples unless a request says: positional "
                            "(each token a function of seed, position and logits: the same "
                            "on any engine; unseeded requests get a seed) or vLLM's own")
    serve.add_argument("--on-handoff-failure", choices=["recompute", "fail"],
                       default="recompute",
                       help="router: when D cannot complete a handoff (UNAVAILABLE, or "
                            "FAILED_PRECONDITION: P's lease ended first), recompute stage 2 "
                            "from token ids on a live D, or fail")
    serve.add_argument("--no-warm-up", action="store_true",
                       help="router: serve without a warm-up handoff per (P, D) pair")

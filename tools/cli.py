"""The ``kvhandoff`` command: verify, serve, client, drain, bench, demo, soak, bundle."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from connector.faults import FAULTS
from connector.logs import LEVEL_ENV
from router.auth import API_KEY_ENV, OPERATOR_KEY_ENV


# Each subcommand imports what it runs inside its function: ``kvhandoff client`` and the
# router then start without loading vLLM, torch or Ray.
def _verify(args: argparse.Namespace) -> int:
    from tools.harness import main_verify

    return main_verify(args.model, args.quick, args.json, args.inject, args.hosts,
                       beam_width=args.beam_width, adapters=args.adapters)


def _serve(args: argparse.Namespace) -> int:
    from connector.signing import load_secret
    from kvhandoff.tls import channel_tls, server_tls

    try:
        tls = server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
        if args.role != "router":
            load_secret(args.handoff_secret_file)  # fail here, not in the engine process
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
        except ValueError as e:
            print(f"kvhandoff serve: {e}", file=sys.stderr)
            return 2

        config = RouterConfig(
            prefill=tuple(a for a in args.prefill.split(",") if a),
            decode=tuple(a for a in (args.decode or "").split(",") if a),
            model=str(resolve_model(args.model)),
            colocated_below_tokens=args.colocated_below,
            max_inflight=args.max_inflight,
            decode_queue_limit=args.decode_queue_limit,
            decode_wait_s=args.decode_wait_s,
            engine_silence_s=args.engine_silence_s,
            max_parents=args.max_parents,
            parent_ttl_s=args.parent_ttl_s,
            parent_pool_share=args.parent_pool_share,
            parent_hold_s=args.parent_hold_s,
            positional_sampling=args.sampling == "positional",
            placement=args.placement,
            on_handoff_failure=args.on_handoff_failure,
            warm_up=not args.no_warm_up,
            channel_tls=channel_tls(args.tls_ca, args.tls_client_cert, args.tls_client_key),
        )
        metrics_port = None if args.metrics_port < 0 else args.metrics_port
        http_port = None if args.http_port < 0 else args.http_port
        asyncio.run(serve_router(config, args.host, args.port, metrics_port, tls, http_port,
                                 credentials))
    else:
        from server.engine_service import serve_engine
        from tools.engine_args import check_engine_kwargs, engine_kwargs

        try:
            # A bad model path, catalog or adapter is one line here, not a traceback
            # from inside the engine's start.
            kwargs = engine_kwargs(args)
            check_engine_kwargs(args.role, kwargs)
        except (ValueError, OSError) as e:
            print(f"kvhandoff serve: {e}", file=sys.stderr)
            return 2
        metrics_port = None if args.metrics_port < 0 else args.metrics_port
        asyncio.run(serve_engine(args.role, kwargs, args.host, args.port, metrics_port, tls))
    return 0


def _client(args: argparse.Namespace) -> int:
    from tools.client import main_client

    return main_client(args)


def _drain(args: argparse.Namespace) -> int:
    from tools.client import main_drain

    return main_drain(args)


def _bench(args: argparse.Namespace) -> int:
    from tools.bench import main_bench

    return main_bench(args)


def _demo(args: argparse.Namespace) -> int:
    from tools.demo import main_demo

    return main_demo(args)


def tls_channel_args(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help=f"{who}connect with TLS, verifying the server with this CA")
    p.add_argument("--tls-client-cert", default=None, metavar="PEM",
                   help=f"{who}client certificate for mutual TLS")
    p.add_argument("--tls-client-key", default=None, metavar="PEM")


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory, or a generated model: 'builtin' "
                        "(the default), 'bench', or a variant of another architecture "
                        "('qwen2-gqa-tied', 'llama-mqa-bf16')")


def _add_verify(sub: Any) -> None:
    verify = sub.add_parser(
        "verify", help="prove the P->D handoff gives the same tokens as one engine")
    _model_arg(verify)
    verify.add_argument("--json", default=None, metavar="PATH", help="write the full report here")
    verify.add_argument("--quick", action="store_true", help="a smaller case set")
    verify.add_argument(
        "--inject", default=None, metavar="FAULT", choices=sorted(FAULTS),
        help="negative control: inject FAULT into the real connector on every handoff "
             "(engines started with fault injection; off otherwise, at no cost). The "
             "harness must then FAIL and name what differs, except for the fault listed "
             "as invisible by design. FAULT: " + "; ".join(
                 f"{f.name} ({f.what})" for f in FAULTS.values()))
    verify.add_argument("--beam-width", type=int, default=None, metavar="W",
                        help="run every case with beam width W (D's pool sized so the "
                             "fill case still needs all of it)")
    verify.add_argument("--adapters", action="store_true",
                        help="the adapter cases instead: P and D serve the built-in LoRA "
                             "adapters a and b; under each (and none) the handoff must "
                             "equal one engine, and a parent under a imported into a "
                             "stage 2 under b (or none) must be refused by D "
                             "(--inject accept-any-adapter: the negative control)")
    verify.add_argument("--hosts", choices=["netns"], default=None,
                        help="netns: the Ps' and D's engine processes on separate network "
                             "hosts (network namespaces joined by veth pairs; needs root), "
                             "the KV read over the link by TCP; the report names the "
                             "transport UCX chose (UCX's tables in out/verify-logs)")
    verify.set_defaults(func=_verify)


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run an engine server or the router (gRPC)")
    serve.add_argument("--role", choices=["prefill", "decode", "router"], required=True)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    _model_arg(serve)
    serve.add_argument("--kv-cache-mib", type=int, default=0, help="KV pool size (MiB)")
    serve.add_argument("--block-size", type=int, default=32)
    serve.add_argument("--max-model-len", type=int, default=4096)
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
    serve.add_argument("--side-channel-host", default="127.0.0.1",
                       help="NIXL side channel address (a node IP across hosts)")
    serve.add_argument("--kv-events", default="loopback", metavar="loopback|off|HOST",
                       help="engines: where vLLM's KV-cache events (every prompt's token ids, "
                            "unauthenticated ZMQ; the router's cache-aware placement reads "
                            "them) are published: loopback (default: a router on this host), "
                            "off, or an address of this host (plaintext to anyone who "
                            "reaches it: a trusted network only)")
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
    serve.add_argument("--tls-cert", default=None, metavar="PEM", help="serve TLS")
    serve.add_argument("--tls-key", default=None, metavar="PEM")
    serve.add_argument("--tls-client-ca", default=None, metavar="PEM",
                       help="require client certificates signed by this CA (mutual TLS)")
    tls_channel_args(serve, "router: ")
    serve.set_defaults(func=_serve)


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


def _add_client(sub: Any) -> None:
    client = sub.add_parser("client", help="send one two-stage request to a router")
    client.add_argument("--router", default="127.0.0.1:50051")
    client.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help=f"the router's client key (default: ${API_KEY_ENV})")
    tls_channel_args(client, "")
    client.add_argument("--prompt", default=None, help="prompt text")
    client.add_argument("--prompt-ids", default=None, help="prompt token ids, comma-separated")
    client.add_argument("--max-tokens", type=int, default=64)
    client.add_argument("--temperature", type=float, default=1.0)
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--beam-width", type=int, default=4)
    client.add_argument("--beam-tokens", type=int, default=3)
    client.add_argument("--catalog", default=None, metavar="NAME",
                        help="keep the beams in this catalog of the engines' (--catalog at "
                             "their start)")
    client.add_argument("--path", choices=["auto", "handoff", "colocated"], default="auto")
    client.add_argument("--stream", action="store_true")
    client.add_argument("--timeout", type=float, default=120.0)
    client.set_defaults(func=_client)


def _add_drain(sub: Any) -> None:
    drain = sub.add_parser(
        "drain", help="drain an engine through the router: no new work goes to it, its "
                      "running stage 1s move to their D, the rest finish; returns when empty")
    drain.add_argument("--router", default="127.0.0.1:50051")
    drain.add_argument("--operator-key", default=os.environ.get(OPERATOR_KEY_ENV) or None,
                       help=f"the router's operator key (default: ${OPERATOR_KEY_ENV})")
    drain.add_argument("--engine", required=True, metavar="HOST:PORT",
                       help="the engine's address as the router knows it")
    drain.add_argument("--undo", action="store_true",
                       help="put a drained engine back into rotation")
    drain.add_argument("--timeout", type=float, default=300.0,
                       help="seconds to wait for the engine to empty (exit 1 if it does not)")
    tls_channel_args(drain, "")
    drain.set_defaults(func=_drain)


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="measure the handoff against the alternatives")
    bench.add_argument("--model", default=None,
                       help="model directory (default: the ~100M bench model, seeded weights)")
    bench.add_argument("--quick", action="store_true", help="a few requests, two sweep points")
    bench.add_argument("--prompt-tokens", type=int, default=None)
    bench.add_argument("--stage1-tokens", type=int, default=None)
    bench.add_argument("--beam-width", type=int, default=None)
    bench.add_argument("--beam-tokens", type=int, default=None)
    bench.add_argument("--requests", type=int, default=None)
    bench.add_argument("--concurrency", default=None, help="e.g. 1,4,16")
    bench.add_argument("--sweep", default=None, help="parent lengths, e.g. 256,1024,4096")
    bench.add_argument("--seed", type=int, default=None)
    bench.add_argument("--json", default=None, metavar="PATH")
    bench.add_argument("--plot", default=None, metavar="PATH", help="PNG")
    bench.add_argument("--router-only", action="store_true",
                       help="only the router's own time per request, with P, D and the router "
                            "as separate processes (built-in model unless --model)")
    bench.add_argument("--http-two-calls", action="store_true",
                       help="the two-call client over the router's HTTP front: stage 2 as a "
                            "text round trip vs as a continuation (built-in model unless "
                            "--model; --requests, --concurrency, --prompt-tokens, "
                            "--stage1-tokens, --beam-width)")
    bench.add_argument("--moves", action="store_true",
                       help="the cost of moving a running request P -> D by parent length "
                            "(256 to 3968 tokens), and a drain of --requests (8) running "
                            "requests against waiting for them (built-in model unless --model)")
    bench.add_argument("--beams", action="store_true",
                       help="stage 2's beam search inside D against its floor and against "
                            "vLLM's beam_search, W in --widths (4,32,128,512) x T in 3,8, "
                            "with the slots' steps and D's peak memory; then open vs "
                            "constrained to a synthetic catalog at W 32 and 512 (bench "
                            "model unless --model; --prompt-tokens, --stage1-tokens)")
    bench.add_argument("--widths", default=None, help="with --beams: e.g. 4,32")
    bench.add_argument("--read", action="store_true",
                       help="a handoff's READ under vLLM's descriptors and under the runs "
                            "(connector.runs), one pair each: cold at the --sweep lengths "
                            "(default 1024,2048,4096) and in a churned pool, against raw "
                            "one-descriptor NIXL")
    bench.add_argument("--fleet", action="store_true",
                       help="least-loaded against cache-aware placement on 2 P and 2 D "
                            "(processes, fresh for each): users whose histories grow "
                            "behind a shared prefix, second continuations; prefix hits, "
                            "KV read, first token and first beam, throughput, identity "
                            "(default model: the built-in one; --requests: users, "
                            "--concurrency: users at a time)")
    bench.add_argument("--hosts-link", action="store_true",
                       help="the link between two network hosts (namespaces; root): a TCP "
                            "copy, a NIXL READ over TCP, over UCX's choice (cma) and on "
                            "loopback, 16-256 MiB; then the first handoffs (handshake "
                            "included) on loopback and across three hosts (built-in model "
                            "unless --model)")
    bench.set_defaults(func=_bench)


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser("demo", help="start P, D and the router; send requests; verify")
    _model_arg(demo)
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--beam-width", type=int, default=8)
    demo.add_argument("--hosts", choices=["netns"], default=None,
                      help="netns: P, D and the router on separate network hosts "
                           "(network namespaces joined by veth pairs; needs root), the KV "
                           "read over the link by TCP")
    demo.add_argument("--json", default=None, metavar="PATH")
    demo.set_defaults(func=_demo)


def _add_bundle(sub: Any) -> None:
    from deploy.bundle.cli import add_arguments, run

    bundle = sub.add_parser("bundle", help="an offline install bundle for an air-gapped "
                                           "host: download, split into parts, install")
    add_arguments(bundle)
    bundle.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get(LEVEL_ENV, "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)
    from tools.soak import add_soak_parser

    for add in (_add_verify, _add_serve, _add_client, _add_drain, _add_bench, _add_demo,
                add_soak_parser, _add_bundle):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # vLLM's own INFO lines drown the output; keep them unless asked.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.log_level.upper())
    # Our code inside the engine processes logs at the same level (connector/logs.py).
    os.environ[LEVEL_ENV] = args.log_level.upper()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

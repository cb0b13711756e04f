"""The ``kvhandoff`` command: verify, serve, client, drain, bench, demo, soak, bundle."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from cli.args import model_arg, tls_channel_args
from connector.faults import FAULTS
from connector.logs import LEVEL_ENV
from router.auth import API_KEY_ENV, OPERATOR_KEY_ENV


# Each subcommand imports what it runs inside its function: ``kvhandoff client`` and the
# router then start without loading vLLM, torch or Ray.
def _verify(args: argparse.Namespace) -> int:
    if args.fuzz is not None:
        from tools.fuzz_local import main_fuzz

        return main_fuzz(args.model, args.fuzz, args.fuzz_seed, args.json)
    if args.search_moves:
        import asyncio

        from tools.harness.search_moves import verify_search_moves

        return 0 if asyncio.run(verify_search_moves(args.model, quick=args.quick,
                                                    json_path=args.json)) else 1
    from tools.harness import main_verify

    return main_verify(args.model, args.quick, args.json, args.inject, args.hosts,
                       beam_width=args.beam_width, adapters=args.adapters)


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


def _add_verify(sub: Any) -> None:
    verify = sub.add_parser(
        "verify", help="prove the P->D handoff gives the same tokens as one engine")
    model_arg(verify)
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
    verify.add_argument("--search-moves", action="store_true",
                        help="instead of the cases: beam searches moved from one D to a "
                             "second D at step k (W 4, 32, 512; T 3, 8; k 1 and T-1; with "
                             "and without a catalog; --quick: W 4, 32), each against the "
                             "unmoved search and vLLM's beam_search, and controls that "
                             "must fail (tools.harness.search_moves)")
    verify.add_argument("--fuzz", type=int, default=None, metavar="N",
                        help="instead of the cases: throw N malformed handoffs and engine "
                             "calls (tools.fuzz; 0 = the single-field cases only) at a P "
                             "and D without a handoff secret, then at a pair with one; "
                             "FAIL on any unclear status, dead engine, leaked block, or a "
                             "good request that no longer matches the colocated reference")
    verify.add_argument("--fuzz-seed", type=int, default=None, metavar="S",
                        help="the corpus's random compositions (default: a fresh seed, "
                             "printed)")
    verify.set_defaults(func=_verify)


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
    client.add_argument("--chunks", default=None, metavar="ID,ID",
                        help="the prompt starts with these named KV chunks (a chain "
                             "registered with RegisterChunk, root first); --prompt is "
                             "what follows them")
    client.add_argument("--recompute-share", type=float, default=None, metavar="S",
                        help="compose --chunks by position even where they are not a chain "
                             "(approximate: keys moved, the last S of their tokens "
                             "computed; the answer says so)")
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
    bench.add_argument("--search-moves", action="store_true",
                       help="the cost of moving a running beam search D -> D' after 4 of 8 "
                            "beam steps, W 4, 32, 512 x parents of 256 to 3072 tokens: the "
                            "KV read, the import, the beams' tokens recomputed, the resumed "
                            "search against the unmoved one's rest (engines in this process)")
    bench.add_argument("--beams", action="store_true",
                       help="stage 2's beam search inside D against its floor and against "
                            "vLLM's beam_search, W in --widths (4,32,128,512) x T in 3,8, "
                            "with the slots' steps and D's peak memory; then open vs "
                            "constrained to a synthetic catalog at W 32 and 512 (bench "
                            "model unless --model; --prompt-tokens, --stage1-tokens). "
                            "With --concurrency C,C: C searches at once instead, QPS and "
                            "p50/p99 of ours and vLLM's beam_search side by side and the "
                            "floor at concurrency, W in --widths (50,128,512), T "
                            "--beam-tokens (3); exit 1 if any beams differ")
    bench.add_argument("--e2e", action="store_true",
                       help="two-stage requests per second through the router at "
                            "--concurrency (1,4,8,32), handoff and colocated paths, "
                            "against vLLM alone (stage 1, then vLLM's beam_search as a new "
                            "request) on an engine of the same model; first beam p50/p99; "
                            "exit 1 if any answer differs from vLLM alone's (bench model "
                            "unless --model; --prompt-tokens 500, --stage1-tokens 64, "
                            "--beam-width 32, --beam-tokens 3)")
    bench.add_argument("--widths", default=None, help="with --beams: e.g. 4,32")
    bench.add_argument("--d-pool-mib", type=int, default=None,
                       help="with --beams --concurrency: D's KV pool (4096; W=512 at C=8 "
                            "needs about 4.7 GiB of the bench model's)")
    bench.add_argument("--read", action="store_true",
                       help="a handoff's READ under vLLM's descriptors and under the runs "
                            "(connector.runs), one pair each: cold at the --sweep lengths "
                            "(default 1024,2048,4096) and in a churned pool, against raw "
                            "one-descriptor NIXL")
    bench.add_argument("--chunks", nargs="?", const="all", default=None,
                       choices=["all", "exact", "approximate", "speed", "quality"],
                       help="named KV chunks (default: all). exact: two-stage requests "
                            "whose prompt starts with a registered chunk against the same "
                            "prompt sent whole (cold) at 1k, 4k and 7.9k tokens of context: "
                            "time to first token and to first beam, identity. approximate: "
                            "speed (chunks prefilled apart and composed, by recomputed "
                            "share, against the prompt sent whole at the same contexts) and "
                            "quality (the built-in model, by recomputed share: top-beam "
                            "agreement with full prefill and the corpus rule, logprob gap; "
                            "the unrotated control). Default model for exact and speed: "
                            "bench; --requests: pairs (rounds) per context")
    bench.add_argument("--fleet", action="store_true",
                       help="least-loaded against cache-aware placement on 2 P and 2 D "
                            "(processes, fresh for each): users whose histories grow "
                            "behind a shared prefix, second continuations; prefix hits, "
                            "KV read, first token and first beam, throughput, identity "
                            "(default model: the built-in one; --requests: users, "
                            "--concurrency: users at a time)")
    bench.add_argument("--serve-routers", default=None, metavar="N,N",
                       help="two-stage requests a second through Ray Serve (one P, one D) "
                            "with each count of Router replicas in turn, e.g. 1,2, at "
                            "--concurrency (32), --requests (160) each: is the router the "
                            "bottleneck (built-in model unless --model)")
    bench.add_argument("--hosts-link", action="store_true",
                       help="the link between two network hosts (namespaces; root): a TCP "
                            "copy, a NIXL READ over TCP, over UCX's choice (cma) and on "
                            "loopback, 16-256 MiB; then the first handoffs (handshake "
                            "included) on loopback and across three hosts (built-in model "
                            "unless --model)")
    bench.add_argument("--serve-scale", action="store_true",
                       help="the Ray Serve application autoscaled by its P:D policy "
                            "(deploy/autoscale.py) under a load ramping 0.2 -> 1 -> 0.2 -> 0 "
                            "sessions a second (about 7 minutes, local Ray, built-in "
                            "model): P and D "
                            "replicas over time, calls served, lost, recomputed (--plot PNG)")
    bench.add_argument("--no-drain", action="store_true",
                       help="with --serve-scale: the control, engine replicas stop at once "
                            "on a scale-down (drain_s 0)")
    bench.set_defaults(func=_bench)


def _add_demo(sub: Any) -> None:
    demo = sub.add_parser("demo", help="start P, D and the router; send requests; verify")
    model_arg(demo)
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
    from cli.serve import add_serve_parser
    from tools.soak.run import add_soak_parser

    for add in (_add_verify, add_serve_parser, _add_client, _add_drain, _add_bench, _add_demo,
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

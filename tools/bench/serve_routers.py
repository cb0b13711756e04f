"""``kvhandoff bench --serve-routers 1,2``: two-stage requests a second through Ray Serve
with one Router replica and with two, at a concurrency (32 by default): is the router
the bottleneck?

Per Router replica count, in the order given, on a fresh application (one P, one D, the
Serve suite's small pools, the built-in model by default: empty prefix caches each
time) on one local Ray instance: a warm-up of a few requests, then ``requests``
two-stage requests (``Generate`` on the handoff path: stage 1 on P, exported, imported
and searched on D) through Serve's gRPC proxy, ``concurrency`` at a time, each on a
prompt of its own. Reported: requests a second over the run, latency p50/p99 as the
client sees it, the router's own time per request (``timings.router_overhead_ms``:
the router replica's time less its waits on P and D) p50/p99, and failures and
recomputes (both must be 0). The Router replicas, P and D share this machine's cores:
on a 2-core host the engines bound the rate, and equal rates with one and two Router
replicas say the router is not what limits it.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from kvhandoff.v1 import router_pb2_grpc
from tools.client import make_request
from tools.serve_local import METADATA, deploy, local_serve

#: The application: the Serve suite's small pools (tests/test_ray_serve.py).
ENGINE = {"kv_cache_mib": 64, "max_model_len": 2048}


def app_args(model: str, routers: int, max_inflight: int) -> dict[str, Any]:
    return {"model": model, "device": "cpu", "lease_s": 60,
            "prefill": {"num_cpus": 1, "num_replicas": 1, "engine": ENGINE},
            "decode": {"num_cpus": 1, "num_replicas": 1, "engine": ENGINE},
            "router": {"num_cpus": 0.5, "num_replicas": routers,
                       "max_inflight": max_inflight}}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _run(stub: Any, prompts: list[list[int]], concurrency: int, stage1_tokens: int,
         beam_width: int, tag: str) -> dict[str, Any]:
    def one(i: int) -> tuple[float, Any]:
        t0 = time.perf_counter()
        try:
            resp = stub.Generate(make_request(
                prompt=prompts[i], max_tokens=stage1_tokens, seed=i, beam_width=beam_width,
                path="handoff", request_id=f"{tag}-{i}"), metadata=METADATA, timeout=600)
        except grpc.RpcError as e:
            return time.perf_counter() - t0, e
        return time.perf_counter() - t0, resp

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(one, range(len(prompts))))
    wall = time.perf_counter() - t0
    ok = [(s, r) for s, r in done if not isinstance(r, grpc.RpcError)]
    failed = [f"{r.code().name}: {r.details()}" for _, r in done if isinstance(r, grpc.RpcError)]
    latency = [s * 1e3 for s, _ in ok]
    overhead = [r.timings.router_overhead_ms for _, r in ok]
    return {"requests": len(prompts), "wall_s": wall, "qps": len(ok) / wall,
            "latency_p50_ms": _pct(latency, 0.5), "latency_p99_ms": _pct(latency, 0.99),
            "router_overhead_p50_ms": _pct(overhead, 0.5),
            "router_overhead_p99_ms": _pct(overhead, 0.99),
            "router_overhead_mean_ms": statistics.fmean(overhead) if overhead else 0.0,
            "failed": len(failed), "failures": failed[:5],
            "recomputed": sum(r.stats.recomputed for _, r in ok),
            "imported_tokens": sum(r.stats.num_imported_tokens for _, r in ok)}


def measure_serve_routers(model: str | None = None, routers: tuple[int, ...] = (1, 2),
                          requests: int = 160, concurrency: int = 32,
                          prompt_tokens: int = 64, stage1_tokens: int = 8,
                          beam_width: int = 4, seed: int = 0) -> dict[str, Any]:
    model = model or "builtin"
    rng = random.Random(seed)
    # One prompt per request, the same in every run (a run's own cache state only).
    prompts = [[rng.randrange(10, 1000) for _ in range(prompt_tokens)] for _ in range(requests)]
    warm = [[rng.randrange(10, 1000) for _ in range(prompt_tokens)] for _ in range(4)]
    runs = []
    with local_serve() as serve:
        channel = grpc.insecure_channel(serve.grpc_address)
        stub = router_pb2_grpc.RouterStub(channel)
        for n in routers:
            t0 = time.perf_counter()
            deploy(serve, app_args(model, n, max_inflight=max(256, concurrency)))
            started_s = time.perf_counter() - t0
            _run(stub, warm, min(4, concurrency), stage1_tokens, beam_width, f"warm{n}")
            run = _run(stub, prompts, concurrency, stage1_tokens, beam_width, f"r{n}")
            runs.append({"router_replicas": n, "deploy_s": started_s, **run})
            print(format_run(runs[-1]), flush=True)
            serve.delete("kvhandoff")
        channel.close()
    return {"model": model, "concurrency": concurrency, "requests": requests,
            "prompt_tokens": prompt_tokens, "stage1_tokens": stage1_tokens,
            "beam_width": beam_width, "runs": runs}


def format_run(run: dict[str, Any]) -> str:
    return (f"{run['router_replicas']} Router replica(s): {run['qps']:.2f} req/s "
            f"({run['requests']} in {run['wall_s']:.1f} s), latency p50 "
            f"{run['latency_p50_ms']:.0f} / p99 {run['latency_p99_ms']:.0f} ms, router's own "
            f"p50 {run['router_overhead_p50_ms']:.1f} / p99 {run['router_overhead_p99_ms']:.1f}"
            f" ms, failed {run['failed']}, recomputed {run['recomputed']}")


def format_serve_routers(result: dict[str, Any]) -> str:
    head = (f"Serve, two-stage requests at concurrency {result['concurrency']} "
            f"({result['requests']} requests, {result['prompt_tokens']}-token prompts, "
            f"stage 1 {result['stage1_tokens']} tokens, W={result['beam_width']} T=3, "
            f"model {result['model']}; one P, one D):")
    runs = result["runs"]
    lines = [head, *("  " + format_run(r) for r in runs)]
    if len(runs) > 1 and runs[0]["qps"]:
        lines.append("  req/s against the first: " + ", ".join(
            f"{r['router_replicas']}: {r['qps'] / runs[0]['qps']:.2f}x" for r in runs))
    return "\n".join(lines)

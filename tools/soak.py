"""``kvhandoff soak``: P, D and the router as processes under a steady mixed load for N
minutes, with per-minute memory, pool usage, latency and error counts (JSON and a plot).

The mix: prompts of 16-600 tokens, stage 1 of 4-64 tokens, beam widths 1-32, unary and
streaming calls, and a share of requests that are meant to fail: cancelled by the client
after their first stage-1 tokens, deadlines too short to make, and bad input. Those fail
with their own status (CANCELLED, DEADLINE_EXCEEDED, INVALID_ARGUMENT) and are counted as
intended; any other failure is an error. The verdict (``verdict``): every process's RSS at
the end within ``RSS_DRIFT`` of its value after ``baseline_minutes``, both pools clean
once the load stops, and no error other than the intended ones.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tools.client import RouterClient, make_request
from tools.launch import local_cluster, percentile, pool_state, rss_mib, wait_pool_clean

#: Largest growth of a process's RSS after the baseline minute that is not a leak.
RSS_DRIFT = 0.05
BEAM_WIDTHS = (1, 2, 4, 8, 16, 32)
#: The status each deliberate failure must get (else it counts as an error).
INTENDED = {"cancel": "CANCELLED", "deadline": "DEADLINE_EXCEEDED", "bad": "INVALID_ARGUMENT"}
#: Shares of the mix (the rest are unary calls).
SHARES = {"stream": 0.2, "cancel": 0.05, "deadline": 0.05, "bad": 0.05}


@dataclass
class Interval:
    """What happened in one sampling interval."""

    outcomes: collections.Counter = field(default_factory=collections.Counter)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, address: str, concurrency: int, seed: int):
        self.address, self.concurrency, self.seed = address, concurrency, seed
        self.current = Interval()
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def _request(self, rng: random.Random, i: int, kind: str):
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(16, 600))]
        req = make_request(prompt=prompt, max_tokens=rng.randint(4, 64), seed=i,
                           beam_width=rng.choice(BEAM_WIDTHS), beam_tokens=rng.randint(2, 3),
                           path="handoff", request_id=f"soak-{kind}-{i}")
        if kind == "bad":
            # One field wrong at a time, each a documented INVALID_ARGUMENT.
            which = rng.randrange(3)
            if which == 0:
                req.beam.beam_width = 0
            elif which == 1:
                req.prompt_token_ids.ids[0] = 10**9  # outside the vocabulary
            else:
                req.stage1.temperature = -1.0
        return req

    def _one(self, client: RouterClient, rng: random.Random, i: int) -> tuple[str, str, float]:
        """(kind, outcome, seconds): outcome "ok", "intended" or "error: CODE details"."""
        x, kind = rng.random(), "unary"
        for name, share in SHARES.items():
            if x < share:
                kind = name
                break
            x -= share
        req = self._request(rng, i, kind)
        t0 = time.perf_counter()
        try:
            if kind == "unary" or kind == "bad":
                client.generate(req, timeout=300)
            elif kind == "deadline":
                client.generate(req, timeout=rng.uniform(0.02, 0.3))
            else:
                call = client.generate_stream(req, timeout=300)
                for event in call:
                    if kind == "cancel" and event.HasField("stage1_tokens"):
                        call.cancel()
        except grpc.RpcError as e:
            seconds = time.perf_counter() - t0
            if INTENDED.get(kind) == e.code().name:
                return kind, "intended", seconds
            return kind, f"error: {e.code().name} {e.details()}", seconds
        seconds = time.perf_counter() - t0
        if kind == "bad":
            return kind, "error: a bad request was served", seconds
        return kind, "ok", seconds

    def _worker(self, w: int) -> None:
        rng = random.Random(self.seed * 1000 + w)
        i = w
        with RouterClient(self.address) as client:
            while not self.stop.is_set():
                kind, outcome, seconds = self._one(client, rng, i)
                i += self.concurrency
                with self.lock:
                    cur = self.current
                    cur.outcomes[f"{kind}:{outcome.split(':')[0]}"] += 1
                    if outcome == "ok":
                        cur.latencies.append(seconds)
                    elif outcome.startswith("error"):
                        cur.errors.append(f"soak-{kind}-{i - self.concurrency}: {outcome}")

    def take(self) -> Interval:
        with self.lock:
            done, self.current = self.current, Interval()
        return done

    def start(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._worker, args=(w,), daemon=True)
                   for w in range(self.concurrency)]
        for t in threads:
            t.start()
        return threads


def verdict(minutes: list[dict[str, Any]], baseline_minutes: int, pools_clean: bool
            ) -> dict[str, Any]:
    """Pass/fail of a soak from its per-minute records (each with ``rss_mib`` by process
    and ``errors``): RSS at the end within RSS_DRIFT of the baseline minute, pools clean,
    no unintended error."""
    base = minutes[min(baseline_minutes, len(minutes)) - 1]["rss_mib"]
    end = minutes[-1]["rss_mib"]
    drift = {p: (end[p] - base[p]) / base[p] for p in base}
    errors = [e for m in minutes for e in m["errors"]]
    problems = [f"{p} RSS grew {d:+.1%} after minute {baseline_minutes} "
                f"({base[p]:.0f} -> {end[p]:.0f} MiB)" for p, d in drift.items()
                if d > RSS_DRIFT]
    if not pools_clean:
        problems.append("a pool was not clean after the load")
    if errors:
        problems.append(f"{len(errors)} unintended errors, e.g. {errors[:3]}")
    return {"ok": not problems, "problems": problems,
            "rss_drift": {p: round(d, 4) for p, d in drift.items()},
            "unintended_errors": len(errors)}


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    log_dir = Path(args.log_dir)
    with local_cluster(args.model, log_dir) as cluster:
        engines = [cluster["prefill"], *cluster["decode"]]
        processes = cluster["servers"]
        soak = Soak(cluster["router"], args.concurrency, args.seed)
        threads = soak.start()
        minutes: list[dict[str, Any]] = []
        t_start = time.monotonic()
        try:
            for n in range(1, args.minutes + 1):
                time.sleep(max(0.0, t_start + n * args.interval_s - time.monotonic()))
                done = soak.take()
                pools = {}
                for e in engines:
                    _, cap = pool_state(e.address)
                    pools[e.role] = {"used": cap.num_total_blocks - cap.num_free_blocks,
                                     "total": cap.num_total_blocks,
                                     "running": cap.num_running_reqs}
                record = {
                    "minute": n,
                    "rss_mib": {s.role: round(rss_mib(s), 1) for s in processes},
                    "pools": pools,
                    "outcomes": dict(done.outcomes),
                    "served": len(done.latencies),
                    "p50_s": round(percentile(done.latencies, 0.50), 3),
                    "p95_s": round(percentile(done.latencies, 0.95), 3),
                    "p99_s": round(percentile(done.latencies, 0.99), 3),
                    "errors": done.errors,
                }
                minutes.append(record)
                intended = sum(v for k, v in done.outcomes.items() if k.endswith(":intended"))
                print(f"minute {n}: {record['served']} served (p50 {record['p50_s']:.2f}s, "
                      f"p95 {record['p95_s']:.2f}s), {intended} intended failures, "
                      f"{len(done.errors)} errors; RSS MiB {record['rss_mib']}; pools "
                      f"{ {r: p['used'] for r, p in pools.items()} }", flush=True)
        finally:
            soak.stop.set()
            for t in threads:
                t.join(timeout=330)
        # Leases end (30 s) on exports a cancelled or late request left behind.
        clean = [wait_pool_clean(e.address, 65.0) for e in engines]
        pools_clean = all(c for c, _ in clean)
    result = {"minutes": minutes, "pools_clean": pools_clean,
              "config": {"minutes": args.minutes, "interval_s": args.interval_s,
                         "concurrency": args.concurrency, "seed": args.seed,
                         "baseline_minutes": args.baseline_minutes},
              "verdict": verdict(minutes, args.baseline_minutes, pools_clean)}
    return result


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = result["minutes"]
    xs = [m["minute"] for m in minutes]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for proc in minutes[0]["rss_mib"]:
        ax1.plot(xs, [m["rss_mib"][proc] for m in minutes], marker=".", label=proc)
    ax1.set_ylabel("RSS (MiB)")
    ax1.legend()
    for q in ("p50_s", "p95_s", "p99_s"):
        ax2.plot(xs, [m[q] for m in minutes], marker=".", label=q.removesuffix("_s"))
    ax2.set_ylabel("end to end (s)")
    ax2.legend()
    ax3.plot(xs, [m["served"] for m in minutes], marker=".", label="served")
    ax3.plot(xs, [len(m["errors"]) for m in minutes], marker=".", label="errors")
    ax3.set_ylabel("per interval")
    ax3.set_xlabel(f"interval ({result['config']['interval_s']:g} s)")
    ax3.legend()
    fig.suptitle(f"kvhandoff soak: {result['config']['minutes']} intervals at concurrency "
                 f"{result['config']['concurrency']}")
    fig.tight_layout()
    fig.savefig(path)


def main_soak(args: argparse.Namespace) -> int:
    result = run_soak(args)
    v = result["verdict"]
    print(f"soak: {'PASS' if v['ok'] else 'FAIL'}; RSS drift after minute "
          f"{args.baseline_minutes}: {v['rss_drift']}; pools clean: {result['pools_clean']}; "
          f"unintended errors: {v['unintended_errors']}")
    for p in v["problems"]:
        print(f"  {p}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0 if v["ok"] else 1


def add_soak_parser(sub: Any) -> None:
    soak = sub.add_parser("soak", help="P, D and the router under a steady mixed load for "
                                       "N minutes: memory, pools, latency, errors")
    soak.add_argument("--model", default=None,
                      help="Hugging Face model directory (default: the built-in model)")
    soak.add_argument("--minutes", type=int, default=30)
    soak.add_argument("--interval-s", type=float, default=60.0,
                      help="length of a 'minute' (sampling interval; shorter for tests)")
    soak.add_argument("--baseline-minutes", type=int, default=5,
                      help="RSS at the end is compared with RSS after this many intervals")
    soak.add_argument("--concurrency", type=int, default=8)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", default=None, metavar="PATH")
    soak.add_argument("--plot", default=None, metavar="PATH", help="PNG")
    soak.add_argument("--log-dir", default="out/soak-logs", help="the servers' logs")
    soak.set_defaults(func=main_soak)

"""``kvhandoff soak``: P, D and the router as processes under a steady mixed load
(``tools.soak.load``) for N minutes, with per-minute memory, pool usage, latency, error and
recompute counts (JSON and a plot), and a verdict over them (``tools.soak.verdict``:
throughput and p99 held, RSS of each process, pools clean, no error, no recompute).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tools.launch import (
    ServerProcess,
    cpu_s,
    local_cluster,
    percentile,
    pool_state,
    rss_by_process_mib,
    rss_mib,
    wait_pool_clean,
)
from tools.soak.load import Interval, Soak
from tools.soak.verdict import Bounds, Verdict, verdict

#: Reasons kept per minute in a record (the count keeps them all).
RECOMPUTED_KEPT = 5
#: Seconds between RSS samples within a minute: a minute's RSS is the lowest of them.
RSS_EVERY_S = 5.0


class CpuMeter:
    """CPU seconds each process (and this one, the clients: ``"client"``) used since the
    last ``take``: where the time per served request goes, minute by minute; and how fast
    the machine itself ran (``machine``)."""

    def __init__(self, processes: list[ServerProcess]):
        self.processes = processes
        self.last = self._now()
        self.last_steal = _steal_s()

    def _now(self) -> dict[str, float]:
        import psutil

        now = {s.role: cpu_s(s) for s in self.processes}
        now["client"] = sum(psutil.Process().cpu_times()[:2])
        return now

    def take(self) -> dict[str, float]:
        now = self._now()
        used = {role: round(now[role] - self.last[role], 1) for role in now}
        self.last = now
        return used

    def machine(self) -> dict[str, float]:
        """``yardstick_ms``: CPU milliseconds a fixed piece of Python takes now (best of
        five; it does the same work every time, so a rise means each instruction costs
        more: a slower clock, cache or memory contention); ``steal_s``: CPU seconds the
        hypervisor gave to others since the last call (``/proc/stat``)."""
        best = min(_yardstick() for _ in range(5))
        steal = _steal_s()
        stolen, self.last_steal = steal - self.last_steal, steal
        return {"yardstick_ms": round(best * 1e3, 2), "steal_s": round(stolen, 1)}


def _yardstick() -> float:
    """CPU seconds of this thread (not the clients') for a fixed loop."""
    t0 = time.thread_time()
    total = 0
    for i in range(200_000):
        total += i * i % 7
    return time.thread_time() - t0


def _steal_s() -> float:
    """The machine's steal time so far, in seconds (0 where /proc/stat has none)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss_floor(processes: list[ServerProcess], until: float) -> dict[str, tuple[float, int]]:
    """Until ``until`` (monotonic): each server's lowest RSS of samples taken every
    ``RSS_EVERY_S`` (at least one, at the end), and how many samples. The floor is what
    a leak raises; one sample's RSS also holds whatever the requests in flight and the
    allocator's free pages held at that instant (P's swung by +-40 MiB a minute, which
    made an hour's slope out of a 9-minute window of noise)."""
    floor: dict[str, tuple[float, int]] = {}
    while True:
        left = until - time.monotonic()
        time.sleep(max(0.0, min(left, RSS_EVERY_S)))
        for s in processes:
            low, count = floor.get(s.role, (float("inf"), 0))
            floor[s.role] = (min(low, rss_mib(s)), count + 1)
        if left <= RSS_EVERY_S:
            return floor


def _record(n: int, done: Interval, processes: list[ServerProcess],
            engines: list[ServerProcess], cpu: dict[str, float],
            machine: dict[str, float],
            floor: dict[str, tuple[float, int]]) -> dict[str, Any]:
    """Minute ``n``'s record: what the verdict reads (served, p99_s, errors, recomputed,
    rss_mib: the minute's lowest RSS, ``_rss_floor``) and what a reader of the JSON
    wants besides (``cpu_s`` by process, and per request served or failed on purpose,
    ``cpu_ms_per_request``)."""
    handled = len(done.latencies) + sum(v for k, v in done.outcomes.items()
                                         if k.endswith(":intended"))
    pools = {}
    for e in engines:
        _, cap = pool_state(e.address)
        pools[e.role] = {"used": cap.num_total_blocks - cap.num_free_blocks,
                         "total": cap.num_total_blocks, "running": cap.num_running_reqs}
    return {
        "minute": n,
        "rss_mib": {role: round(low, 1) for role, (low, _) in floor.items()},
        "rss_samples": {role: count for role, (_, count) in floor.items()},
        "rss_end_mib": {s.role: round(rss_mib(s), 1) for s in processes},
        "rss_by_process_mib": {s.role: rss_by_process_mib(s) for s in processes},
        "cpu_s": cpu,
        "cpu_ms_per_request": {role: round(1e3 * c / max(handled, 1), 2)
                               for role, c in cpu.items()},
        "machine": machine,
        "pools": pools,
        "outcomes": dict(done.outcomes),
        "served": len(done.latencies),
        "p50_s": round(percentile(done.latencies, 0.50), 3),
        "p95_s": round(percentile(done.latencies, 0.95), 3),
        "p99_s": round(percentile(done.latencies, 0.99), 3),
        "errors": done.errors,
        "recomputed": len(done.recomputed),
        "recomputed_why": done.recomputed[:RECOMPUTED_KEPT],
    }


def _pools_end(engines: list[ServerProcess]) -> dict[str, dict[str, Any]]:
    """Each engine's pool once the load stopped: clean, and what it still held if not."""
    pools = {}
    for e in engines:
        # Leases end (30 s) on exports a cancelled or late request left behind.
        clean, cap = wait_pool_clean(e.address, 65.0)
        pools[e.role] = {"clean": clean, "used": cap.num_total_blocks - cap.num_free_blocks,
                         "running": cap.num_running_reqs, "waiting": cap.num_waiting_reqs,
                         "reserved": cap.num_reserved_blocks}
    return pools


def run_soak(args: argparse.Namespace, bounds: Bounds) -> tuple[dict[str, Any], Verdict]:
    """The soak's JSON (every minute, the pools at the end, the config, the verdict) and
    its verdict."""
    log_dir = Path(args.log_dir)
    with local_cluster(args.model, log_dir) as cluster:
        engines = [cluster["prefill"], *cluster["decode"]]
        processes = cluster["servers"]  # P, D and the router
        soak = Soak(cluster["router"], args.concurrency, args.seed)
        meter = CpuMeter(processes)
        threads = soak.start()
        minutes: list[dict[str, Any]] = []
        t_start = time.monotonic()
        try:
            for n in range(1, args.minutes + 1):
                floor = _rss_floor(processes, t_start + n * args.interval_s)
                record = _record(n, soak.take(), processes, engines, meter.take(),
                                 meter.machine(), floor)
                minutes.append(record)
                intended = sum(v for k, v in record["outcomes"].items()
                               if k.endswith(":intended"))
                print(f"minute {n}: {record['served']} served (p50 {record['p50_s']:.2f}s, "
                      f"p99 {record['p99_s']:.2f}s), {record['recomputed']} recomputed, "
                      f"{intended} intended failures, {len(record['errors'])} errors; "
                      f"RSS MiB {record['rss_mib']}; CPU ms per request "
                      f"{record['cpu_ms_per_request']}; machine {record['machine']}; pools "
                      f"{ {r: p['used'] for r, p in record['pools'].items()} }", flush=True)
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM (main_soak): no verdict; the servers stop below, and the
            # load's threads (daemons) are not waited for.
            soak.stop.set()
            raise
        finally:
            soak.stop.set()
            for t in threads:
                t.join(timeout=330 if not sys.exc_info()[0] else 5)
        pools_end = _pools_end(engines)
    clean = {role: p["clean"] for role, p in pools_end.items()}
    v = verdict(minutes, args.baseline_minutes, clean, bounds, args.interval_s)
    return {"minutes": minutes, "pools_end": pools_end, "pools_clean": all(clean.values()),
            "config": {"minutes": args.minutes, "interval_s": args.interval_s,
                       "concurrency": args.concurrency, "seed": args.seed,
                       "baseline_minutes": args.baseline_minutes,
                       "bounds": asdict(bounds)},
            "verdict": v.as_dict()}, v


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
    ax3.plot(xs, [m["recomputed"] for m in minutes], marker=".", label="recomputed")
    ax3.set_ylabel("per interval")
    ax3.set_xlabel(f"interval ({result['config']['interval_s']:g} s)")
    ax3.legend()
    fig.suptitle(f"kvhandoff soak: {result['config']['minutes']} intervals at concurrency "
                 f"{result['config']['concurrency']}")
    fig.tight_layout()
    fig.savefig(path)


def main_soak(args: argparse.Namespace) -> int:
    # Refused before the cluster starts, not after the minutes of load.
    try:
        bounds = Bounds(**{name: getattr(args, name) for name in BOUND_FLAGS})
        if not 1 <= args.baseline_minutes < args.minutes:
            raise ValueError(f"--baseline-minutes ({args.baseline_minutes}) must be at least "
                             f"1 and leave a minute after it within --minutes "
                             f"({args.minutes})")
    except ValueError as e:
        print(f"kvhandoff soak: {e}", file=sys.stderr)
        return 2
    # SIGTERM as Ctrl-C: the cluster's servers (their own sessions) are stopped, not
    # left behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        result, v = run_soak(args, bounds)
    except KeyboardInterrupt:
        print("kvhandoff soak: interrupted; servers stopped, no verdict", file=sys.stderr)
        return 130
    print(f"soak: {'PASS' if v.ok else 'FAIL'}"
          + (f" ({', '.join(v.failed)})" if v.failed else ""))
    for line in v.lines():
        print(f"  {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0 if v.ok else 1


#: ``Bounds``' fields, each the soak's flag of the same name, with its help.
BOUND_FLAGS = {
    "level_minutes": "intervals averaged into the reference level (the first after the "
                     "baseline) and the end level (the last) of throughput and p99; fewer "
                     "where the run is too short for both",
    "max_throughput_drop": "largest fall of requests served per interval, end level "
                           "against reference level (share)",
    "max_p99_rise": "largest rise of the p99 latency, end level against reference level "
                    "(share)",
    "max_rss_growth": "largest RSS growth of P, D or the router after the baseline (share)",
    "max_rss_slope_mib_h": "largest RSS slope of P, D or the router over the last third of "
                           "the run, after the warm-up (MiB an hour, least squares)",
    "max_recompute_share": "largest share of served requests whose handoff the router "
                           "recomputed (0: none may be)",
}


def add_soak_parser(sub: Any) -> None:
    d = Bounds()
    soak = sub.add_parser("soak", help="P, D and the router under a steady mixed load for "
                                       "N minutes: memory, pools, latency, errors, recomputes")
    soak.add_argument("--model", default=None,
                      help="Hugging Face model directory (default: the built-in model)")
    soak.add_argument("--minutes", type=int, default=30)
    soak.add_argument("--interval-s", type=float, default=60.0,
                      help="length of a 'minute' (sampling interval; shorter for tests)")
    soak.add_argument("--baseline-minutes", type=int, default=5,
                      help="warm-up: RSS at the end is compared with RSS after this many "
                           "intervals, throughput and p99 with the intervals after them")
    for name, text in BOUND_FLAGS.items():
        default = getattr(d, name)
        soak.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                          help=text)
    soak.add_argument("--concurrency", type=int, default=8)
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--json", default=None, metavar="PATH")
    soak.add_argument("--plot", default=None, metavar="PATH", help="PNG")
    soak.add_argument("--log-dir", default="out/soak-logs", help="the servers' logs")
    soak.set_defaults(func=main_soak)

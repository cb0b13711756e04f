"""``kvhandoff bench --fleet``: least-loaded against cache-aware placement, on a fleet.

Two Ps, two Ds and a router run as processes (``local_cluster``), once with
``--placement load`` and once with ``--placement cache``, each on fresh engines (empty
prefix caches), with the same requests in the same order per user. The workload: users
whose histories grow from call to call behind a prefix every user shares (a system
prompt); each call is a parent (``StartParent``: stage 1 on a P, exported to a D) and a
continuation (``Continue``, W=4), and every other call a second continuation of the
same parent (W=8). Users run ``concurrency`` at a time, each user's calls in order.

Per placement: each P's prefix-cache hit rate over the run (the engine's own counters,
read before and after), parent tokens D found in its own cache and KV bytes it read per
continuation, stage 1's time to its first token and to its end, stage 2's first beam
step, calls a second, and the router's placements that found a cached prefix. Identity:
every continuation's beams (token ids exactly, cumulative logprobs within the harness's
floor) equal across the two runs; a difference is reported and fails the bench.
"""

from __future__ import annotations

import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.v1 import router_pb2, router_pb2_grpc
from tools.harness.report import LOGPROB_TOLERANCE
from tools.launch import local_cluster

PLACEMENTS = ("load", "cache")


@dataclass(frozen=True)
class FleetConfig:
    users: int = 16
    calls: int = 4
    #: Tokens every prompt starts with (a system prompt).
    shared_tokens: int = 256
    #: A user's history at the first call, and what each later call adds to it.
    history_tokens: int = 384
    growth_tokens: int = 192
    stage1_tokens: int = 16
    concurrency: int = 4
    seed: int = 0


def workload(cfg: FleetConfig) -> list[list[list[int]]]:
    """Per user, the prompt of each call: the shared prefix, then the user's history as
    it stands at that call (each call's prompt extends the one before)."""
    rng = random.Random(cfg.seed)
    shared = [rng.randrange(10, 1000) for _ in range(cfg.shared_tokens)]
    users = []
    for _ in range(cfg.users):
        longest = cfg.history_tokens + (cfg.calls - 1) * cfg.growth_tokens
        history = [rng.randrange(10, 1000) for _ in range(longest)]
        users.append([shared + history[:cfg.history_tokens + k * cfg.growth_tokens]
                      for k in range(cfg.calls)])
    return users


def _samples(url: str) -> list[Any]:
    """A Prometheus endpoint's samples."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _engine_counters(url: str) -> dict[str, float]:
    wanted = {"kvhandoff_engine_prefix_cache_hits", "kvhandoff_engine_prefix_cache_queries"}
    return {s.name.removesuffix("_total"): s.value for s in _samples(url)
            if s.name.removesuffix("_total") in wanted}


def _router_placements(url: str) -> dict[str, float]:
    """Placements per (role, cached prefix found or not), from the router's metrics."""
    out: dict[str, float] = {}
    for s in _samples(url):
        if s.name == "kvhandoff_router_placements_total":
            key = f"{s.labels['role']}_{'hit' if s.labels['hit'] == 'yes' else 'miss'}"
            out[key] = out.get(key, 0.0) + s.value
    return out


def _call(stub, user: int, k: int, prompt: list[int], cfg: FleetConfig) -> dict[str, Any]:
    """One call: the parent, its continuation(s), the parent released."""
    rid = f"fleet-u{user}-c{k}"
    req = router_pb2.ParentRequest(request_id=rid)
    req.prompt_token_ids.ids.extend(prompt)
    req.stage1.max_tokens, req.stage1.temperature = cfg.stage1_tokens, 1.0
    req.stage1.seed = cfg.seed * 1000 + user * 10 + k
    t0 = time.perf_counter()
    first_token_s, parent = None, None
    for event in stub.StartParent(req, timeout=300):
        if event.HasField("stage1_tokens") and first_token_s is None:
            first_token_s = time.perf_counter() - t0
        elif event.HasField("parent"):
            parent = event.parent
    stage1_s = time.perf_counter() - t0
    assert parent is not None, rid
    continuations = []
    try:
        for width in (4, 8) if k % 2 == 0 else (4,):
            creq = router_pb2.ContinueRequest(parent_id=parent.parent_id, request_id=f"{rid}-w{width}")
            creq.beam.beam_width, creq.beam.max_tokens = width, 3
            resp = stub.Continue(creq, timeout=300)
            continuations.append({
                "width": width,
                "decode": resp.stats.decode_endpoint,
                "recomputed": resp.stats.recomputed,
                "bytes_read": resp.stats.num_bytes_moved,
                "imported_tokens": resp.stats.num_imported_tokens,
                "found_on_d_tokens": resp.stats.num_found_on_d_tokens,
                "first_beam_ms": resp.timings.stage2_first_step_ms,
                "beams": [(list(b.token_ids), b.cum_logprob) for b in resp.beams],
            })
    finally:
        stub.ReleaseParent(router_pb2.ReleaseParentRequest(parent_id=parent.parent_id),
                           timeout=30)
    return {"id": rid, "prefill": parent.prefill_endpoint, "prompt_tokens": len(prompt),
            "first_token_ms": (first_token_s or stage1_s) * 1e3, "stage1_ms": stage1_s * 1e3,
            "thinking": list(parent.thinking_token_ids), "continuations": continuations}


def run_placement(model: str | None, placement: str, cfg: FleetConfig,
                  log_dir: Path) -> dict[str, Any]:
    """The workload through a fresh fleet placing by ``placement``."""
    users = workload(cfg)
    with local_cluster(model, log_dir / placement, extra_prefill=1, extra_decode=1,
                       router_flags=("--placement", placement)) as c:
        prefills = c["prefills"]
        before = [_engine_counters(p.metrics_url) for p in prefills]
        placed_before = _router_placements(c["router_metrics"])
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(c["router"]))

        def user_calls(u: int) -> list[dict[str, Any]]:
            return [_call(stub, u, k, prompt, cfg) for k, prompt in enumerate(users[u])]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(cfg.concurrency) as pool:
            calls = [c for per_user in pool.map(user_calls, range(cfg.users)) for c in per_user]
        wall_s = time.perf_counter() - t0
        after = [_engine_counters(p.metrics_url) for p in prefills]
        placed_after = _router_placements(c["router_metrics"])
    hits = sum(a["kvhandoff_engine_prefix_cache_hits"] - b["kvhandoff_engine_prefix_cache_hits"]
               for a, b in zip(after, before))
    queries = sum(a["kvhandoff_engine_prefix_cache_queries"]
                  - b["kvhandoff_engine_prefix_cache_queries"] for a, b in zip(after, before))
    conts = [x for call in calls for x in call["continuations"]]
    return {
        "placement": placement,
        "calls": calls,
        "wall_s": wall_s,
        "calls_per_s": len(calls) / wall_s,
        "p_prefix_hit_rate": hits / queries if queries else 0.0,
        "p_prefix_hit_tokens": hits,
        "p_prompt_tokens": queries,
        "stage1_first_token_ms_p50": statistics.median(c["first_token_ms"] for c in calls),
        "stage1_ms_p50": statistics.median(c["stage1_ms"] for c in calls),
        "stage2_first_beam_ms_p50": statistics.median(x["first_beam_ms"] for x in conts),
        "kv_bytes_read_per_continuation": statistics.mean(x["bytes_read"] for x in conts),
        "found_on_d_tokens_per_continuation": statistics.mean(x["found_on_d_tokens"]
                                                             for x in conts),
        "recomputed": sum(x["recomputed"] for x in conts),
        "placements": {k: placed_after.get(k, 0.0) - placed_before.get(k, 0.0)
                       for k in set(placed_after) | set(placed_before)},
    }


def identity(runs: dict[str, dict[str, Any]]) -> list[str]:
    """What differs between the placements' answers (empty: the same everywhere)."""
    a, b = (runs[p] for p in PLACEMENTS)
    by_id = {c["id"]: c for c in b["calls"]}
    diffs = []
    for call in a["calls"]:
        other = by_id[call["id"]]
        if call["thinking"] != other["thinking"]:
            diffs.append(f"{call['id']}: stage-1 tokens differ")
        for x, y in zip(call["continuations"], other["continuations"]):
            if [t for t, _ in x["beams"]] != [t for t, _ in y["beams"]]:
                diffs.append(f"{call['id']} W={x['width']}: beams differ")
            elif any(abs(p - q) > LOGPROB_TOLERANCE
                     for (_, p), (_, q) in zip(x["beams"], y["beams"])):
                diffs.append(f"{call['id']} W={x['width']}: cumulative logprobs differ")
    return diffs


def run_fleet(model: str | None, cfg: FleetConfig, log_dir: Path = Path("out/bench-fleet"),
              progress: Any = print) -> dict[str, Any]:
    runs = {}
    for placement in PLACEMENTS:
        progress(f"placement {placement}: starting 2 P, 2 D and the router")
        runs[placement] = run_placement(model, placement, cfg, log_dir)
    return {"config": cfg.__dict__, "runs": runs, "identity_differences": identity(runs)}


def format_fleet(result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows = [("P prefix-hit rate", "p_prefix_hit_rate", "{:.1%}"),
            ("stage 1 first token p50 (ms)", "stage1_first_token_ms_p50", "{:.0f}"),
            ("stage 1 p50 (ms)", "stage1_ms_p50", "{:.0f}"),
            ("stage 2 first beam p50 (ms)", "stage2_first_beam_ms_p50", "{:.0f}"),
            ("KV bytes read / continuation", "kv_bytes_read_per_continuation", "{:,.0f}"),
            ("parent tokens found on D / continuation", "found_on_d_tokens_per_continuation",
             "{:.0f}"),
            ("calls / s", "calls_per_s", "{:.2f}"),
            ("recomputed", "recomputed", "{}")]
    lines = [f"{'':42s}{'load':>14s}{'cache':>14s}"]
    for label, key, fmt in rows:
        lines.append(f"{label:42s}" + "".join(f"{fmt.format(runs[p][key]):>14s}"
                                              for p in PLACEMENTS))
    for p in PLACEMENTS:
        placed = runs[p]["placements"]
        lines.append(f"router placements ({p}): " + ", ".join(
            f"{k} {int(v)}" for k, v in sorted(placed.items())))
    diffs = result["identity_differences"]
    lines.append("identity: " + ("the same answers under both placements" if not diffs
                                 else f"{len(diffs)} differ: " + "; ".join(diffs[:5])))
    return "\n".join(lines)


def plot_fleet(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    panels = [("P prefix-hit rate", "p_prefix_hit_rate", 100, "%"),
              ("stage 1 first token p50", "stage1_first_token_ms_p50", 1, "ms"),
              ("stage 2 first beam p50", "stage2_first_beam_ms_p50", 1, "ms"),
              ("KV read / continuation", "kv_bytes_read_per_continuation", 1 / 1024, "KiB"),
              ("calls / s", "calls_per_s", 1, "")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3.2))
    for ax, (title, key, scale, unit) in zip(axes, panels):
        ax.bar(list(PLACEMENTS), [runs[p][key] * scale for p in PLACEMENTS],
               color=["tab:gray", "tab:blue"])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(unit)
    fig.suptitle("least-loaded vs cache-aware placement (2 P, 2 D; same requests)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""``kvhandoff bench --read``: a handoff's READ under each descriptor scheme, in one run.

For each scheme (vLLM's own descriptors, blocks in LRU order; then the project's runs,
``connector.runs``) a fresh P+D pair on the bench model, with D's pool sized to a few
of the largest parents so that it churns:

1. **cold**: for each parent length, ``repeats`` cold handoffs (both prefix caches
   emptied before each; the free queue keeps whatever order earlier requests left), the
   median by READ time reported: descriptors NIXL posted, bytes, READ ms and GB/s;
2. **churn**: ``churn`` handoffs of distinct parents one after another without emptying
   anything, so D's pool fills with cached blocks and each import evicts some; the last
   half is reported (descriptors and GB/s per READ), with the cached blocks the runs
   evicted out of LRU order (what the runs cost prefix caching).

The raw one-descriptor NIXL rate of the same bytes (``tools.bench.nixl_probe.RawReader``,
an owner process alive through the whole run) is taken right after each cold handoff,
the engines up and idle, and each handoff's ratio is its READ's rate over that raw
rate: this machine's memory copy rate drifts by up to 2x within a minute, so a raw rate
taken once, at another time, moves the ratio by as much. Like for like: the engine's
figure is the median of ``repeats`` handoffs, the raw one the median of three READs
(their best, the probe's older figure, ~15 % higher here, is kept as ``raw_best_gbps``).
The best raw rate once the engines are gone (``raw_after_gbps``) is kept beside it.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from kvhandoff.model import DTYPE_BYTES, kv_bytes_per_block, model_dtype, resolve_model
from kvhandoff.types import BeamParams
from tools.bench.modes import Bench, make_prompts
from tools.bench.nixl_probe import RawReader, measure_transfer
from tools.bench.types import BenchConfig
from tools.local import local_pair

SCHEMES = ("vllm", "runs")


def _row(s: Any, post_ms: float | None = None) -> dict[str, Any]:
    """A handoff's READ: NIXL's telemetry, from posting until the worker saw it complete
    (``read_ms``), and the posting alone (``post_ms``: over UCX ``cma`` the copy runs
    inside it, so the rest is the wait for the worker's next completion check)."""
    ms = s.transfer_ms or 0.0
    return {"parent_tokens": s.parent_tokens, "kv_bytes": s.kv_bytes,
            "descriptors": s.descriptors, "read_ms": round(ms, 3),
            "read_gbps": round(s.kv_bytes / ms / 1e6, 3) if ms else None,
            "post_ms": None if post_ms is None else round(post_ms, 3)}


async def _handoff(bench: Bench, prompt: list[int], seed: int, beam: BeamParams,
                   d_cache: str) -> tuple[Any, float | None]:
    """One handoff and its READ's posting time (NIXL's telemetry, D's latest READ)."""
    before = bench.d.counters.transfers
    s = await bench.one("handoff", prompt, seed, stage1_tokens=1, beam=beam, d_cache=d_cache)
    records = bench.d.counters.recent_transfers
    post = records[-1].post_seconds * 1e3 if bench.d.counters.transfers > before else None
    return s, post


def _cold_row(runs: list[tuple[Any, float | None, tuple[float, float]]]) -> dict[str, Any]:
    """The median handoff by READ time, with the raw rate taken right after it (the
    median of its READs, like for like with the engine's median; its best beside it),
    and the median over every handoff of its READ's rate over its raw median."""
    s, post, (raw, raw_best) = sorted(runs, key=lambda r: r[0].transfer_ms or 0.0)[len(runs) // 2]
    row = {**_row(s, post), "raw_nixl_gbps": raw, "raw_best_gbps": raw_best,
           "raw_range_gbps": [min(r[2][0] for r in runs), max(r[2][0] for r in runs)]}
    ratios = [r[0].kv_bytes / r[0].transfer_ms / 1e6 / r[2][0] for r in runs
              if r[0].transfer_ms]
    if ratios:
        row["read_vs_raw"] = round(statistics.median(ratios), 3)
    return row


async def _scheme(scheme: str, cfg: BenchConfig, sweep: tuple[int, ...], repeats: int,
                  churn: int, churn_tokens: int, raw: RawReader,
                  progress: Any) -> dict[str, Any]:
    largest = max(*sweep, churn_tokens) + 64
    model_dir = resolve_model(cfg.model)
    block_bytes = kv_bytes_per_block(model_dir, 32, DTYPE_BYTES[model_dtype(model_dir)])
    pool = 4 * (-(-largest // 32)) * block_bytes
    max_len = largest + 64
    async with local_pair(str(model_dir), kv_runs=scheme == "runs", lease_s=60,
                          max_model_len=max_len + (-max_len % 32),
                          decode_overrides={"kv_cache_memory_bytes": pool},
                          prefill_overrides={"kv_cache_memory_bytes": 2 * pool}) as pair:
        bench = Bench(pair, cfg)
        beam = BeamParams(beam_width=4, max_tokens=2)
        await bench.one("handoff", make_prompts(bench.tok, 1, 64, 1)[0], 1, stage1_tokens=2)
        cold = []
        for i, n in enumerate(sweep):
            prompt = make_prompts(bench.tok, 1, n - 1, cfg.seed + 7 + i)[0]
            runs = []
            for k in range(repeats):
                s, post = await _handoff(bench, prompt, cfg.seed + k, beam, "cold")
                runs.append((s, post, raw.gbps(s.kv_bytes)))
            cold.append(_cold_row(runs))
            progress(f"{scheme}: cold {n}")
        await bench.empty_caches()
        before = dataclasses.replace(pair.d.counters)
        prompts = make_prompts(bench.tok, churn, churn_tokens - 1, cfg.seed + 300)
        samples = [await _handoff(bench, prompt, cfg.seed + k, beam, "churn")
                   for k, prompt in enumerate(prompts)]
        progress(f"{scheme}: churn")
        after = pair.d.counters
        tail = [_row(*s) for s in samples[churn // 2:]]
        return {"scheme": scheme, "d_pool_blocks": pool // block_bytes, "cold": cold,
                "churn": {"handoffs": churn, "parent_tokens": churn_tokens,
                          "reported": len(tail),
                          "descriptors_median": statistics.median(r["descriptors"] for r in tail),
                          "read_gbps_median": statistics.median(r["read_gbps"] or 0.0
                                                                for r in tail),
                          "d_allocations_in_runs": after.runs_arranged - before.runs_arranged,
                          "d_evicted_out_of_lru_order":
                              after.runs_out_of_lru_order - before.runs_out_of_lru_order,
                          "d_blocks_read": sum(-(-(s.tokens_read) // s.block_size)
                                               for s, _ in samples)}}


async def run_read(cfg: BenchConfig, sweep: tuple[int, ...] = (1024, 2048, 4096),
                   repeats: int = 3, churn: int = 24, churn_tokens: int = 1024,
                   progress: Any = print) -> dict[str, Any]:
    """Both schemes (vLLM's first, then the runs), a raw rate beside every cold READ,
    then the raw rates once the engines are gone."""
    result: dict[str, Any] = {"sweep": list(sweep), "repeats": repeats,
                              "order": list(SCHEMES), "schemes": {}}
    model_dir = resolve_model(cfg.model)
    block_bytes = kv_bytes_per_block(model_dir, 32, DTYPE_BYTES[model_dtype(model_dir)])
    with RawReader(-(-max(sweep) // 32) * block_bytes) as raw:
        for scheme in SCHEMES:
            result["schemes"][scheme] = await _scheme(scheme, cfg, sweep, repeats, churn,
                                                      churn_tokens, raw, progress)
    sizes = sorted({r["kv_bytes"] for s in result["schemes"].values() for r in s["cold"]})
    after = {row["bytes"]: row["nixl_gbps"] for row in measure_transfer(sizes)["sizes"]}
    for s in result["schemes"].values():
        for r in s["cold"]:
            r["raw_after_gbps"] = after.get(r["kv_bytes"])
    vllm, runs = (result["schemes"][s]["cold"] for s in SCHEMES)
    result["descriptor_cut"] = [round(a["descriptors"] / max(1, b["descriptors"]), 1)
                                for a, b in zip(vllm, runs)]
    return result


def format_read(result: dict[str, Any]) -> str:
    lines = ["scheme  parent  MiB  descriptors  READ ms  (posting)  GB/s  raw 1-desc GB/s  "
             "ratio  (raw after)"]
    for name, s in result["schemes"].items():
        for r in s["cold"]:
            lines.append(f"{name:<7} {r['parent_tokens']:>6} {r['kv_bytes'] / 2**20:>4.0f} "
                         f"{r['descriptors']:>12} {r['read_ms']:>8.2f} "
                         f"{r['post_ms'] or 0:>10.2f} "
                         f"{r['read_gbps'] or 0:>5.2f} {r['raw_nixl_gbps'] or 0:>16.2f} "
                         f"{r.get('read_vs_raw', 0):>6.2f} {r.get('raw_after_gbps') or 0:>11.2f}")
    lines.append(f"descriptors cut (vLLM's / runs): {result['descriptor_cut']}")
    for name, s in result["schemes"].items():
        c = s["churn"]
        lines.append(f"churn {name}: D pool {s['d_pool_blocks']} blocks, last {c['reported']} "
                     f"of {c['handoffs']} {c['parent_tokens']}-token handoffs: descriptors "
                     f"{c['descriptors_median']}, {c['read_gbps_median']:.2f} GB/s; cached "
                     f"blocks evicted out of LRU order {c['d_evicted_out_of_lru_order']} of "
                     f"{c['d_blocks_read']} blocks read")
    return "\n".join(lines)

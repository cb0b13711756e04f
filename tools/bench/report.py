"""The benchmark's numbers as people read them: percentiles, per-mode summaries, the
printed report and the plot."""

from __future__ import annotations

import statistics
from typing import Any

from tools.bench.types import MODES, Sample
from tools.harness.report import LOGPROB_TOLERANCE


def nearest_rank(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values`` (not empty)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return round(values[k], 3)


def summarize(samples: list[Sample]) -> dict[str, Any]:
    first = [s.stage2_first_beam_ms for s in samples]
    total = [s.stage2_total_ms for s in samples]
    e2e = [s.end_to_end_ms for s in samples]
    out: dict[str, Any] = {
        "n": len(samples),
        "stage2_first_beam_ms_p50": pct(first, 0.5),
        "stage2_first_beam_ms_p95": pct(first, 0.95),
        "stage2_total_ms_p50": pct(total, 0.5),
        "stage2_total_ms_p95": pct(total, 0.95),
        "end_to_end_ms_p50": pct(e2e, 0.5),
        "computed_tokens_d_per_request": statistics.mean(s.computed_tokens_d for s in samples)
        if samples else None,
        "parent_tokens_mean": statistics.mean(s.parent_tokens for s in samples) if samples else None,
    }
    firsts = [s.computed_first_step for s in samples if s.computed_first_step is not None]
    if firsts:
        out["computed_tokens_first_step_per_request"] = statistics.mean(firsts)
        out["first_step_computes_only_suffix_plus_one"] = (
            f"{sum(s.computed_first_step == s.suffix_tokens + 1 for s in samples)}/{len(samples)}")
    moved = [s for s in samples if s.kv_bytes and s.transfer_ms]
    if moved:
        out["d_cache"] = sorted({s.d_cache for s in moved})
        out["kv_bytes_per_request"] = statistics.mean(s.kv_bytes for s in moved)
        out["descriptors_per_request"] = statistics.mean(s.descriptors for s in moved)
        out["transfer_ms_p50"] = pct([s.transfer_ms for s in moved], 0.5)
        out["transfer_gbps"] = round(sum(s.kv_bytes for s in moved)
                                     / (sum(s.transfer_ms for s in moved) / 1e3) / 1e9, 3)
    for engine in ("p", "d"):
        hits = sum(s.prefix_cache.get(engine, (0, 0))[0] for s in samples)
        queries = sum(s.prefix_cache.get(engine, (0, 0))[1] for s in samples)
        out[f"prefix_cache_hit_rate_{engine}"] = round(hits / queries, 3) if queries else None
    return out


def summarize_warm(samples: list[Sample]) -> dict[str, Any]:
    """Handoffs to a D that already holds the prompt's blocks: what the import read and
    what it found on D instead."""
    if not samples:
        return {}
    out = summarize(samples)
    out["tokens_read_per_request"] = statistics.mean(s.tokens_read for s in samples)
    out["tokens_found_on_d_per_request"] = statistics.mean(s.tokens_found for s in samples)
    out["bytes_saved_per_request"] = statistics.mean(
        s.tokens_found // s.block_size * s.kv_bytes_per_block for s in samples)
    return out


def floor_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of one (beam width, beam tokens) floor measurement."""
    out = dict(rows[0])
    for key in ("stage2_total_ms", "import_step_ms", "decode_step_ms", "decode_step_logprobs_ms",
                "beam_step_ms", "floor_ms", "ratio"):
        out[key] = round(statistics.median(r[key] for r in rows), 3)
    out["repeats"] = len(rows)
    return out


def agreement(by_mode: dict[str, list[Sample]], mode: str) -> dict[str, Any]:
    """How ``mode``'s beams compare with the colocated path's and with vLLM's own beam
    search (a reference we did not write): ids and order equal, cumulative logprobs
    within the harness's tolerance."""

    got, ref, peer = by_mode[mode], by_mode["colocated"], by_mode["vllm_beam_search"]
    same = sum(s.beams == r.beams for s, r in zip(got, ref))
    agree = sum(s.beams == r.beams and all(
        abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(s.logprobs, r.logprobs))
        for s, r in zip(got, peer))
    # Where the beams differ from vLLM's: the same scores in another order (near-ties
    # whose order the batch's floating point decides) or another search?
    same_scores = sum(len(s.logprobs) == len(r.logprobs) and all(
        abs(a - b) <= LOGPROB_TOLERANCE for a, b in zip(sorted(s.logprobs), sorted(r.logprobs)))
        for s, r in zip(got, peer))
    return {
        "beams_match_colocated": f"{same}/{len(got)}",
        "beams_match_vllm_beam_search": f"{agree}/{len(got)}",
        "beam_ids_match_vllm_beam_search": f"{sum(s.beams == r.beams for s, r in zip(got, peer))}/{len(got)}",
        "scores_match_vllm_beam_search": f"{same_scores}/{len(got)}",
        "max_score_diff_vs_vllm_beam_search": max(
            (abs(a - b) for s, r in zip(got, peer)
             for a, b in zip(sorted(s.logprobs), sorted(r.logprobs))), default=None),
        # Where beams differ: are the scores the same (ties among near-equal candidates)
        # or different searches?
        "max_score_diff_vs_colocated": max(
            (abs(a - b) for s, r in zip(got, ref) for a, b in zip(s.logprobs, r.logprobs)),
            default=None),
    }


def concurrency_row(mode: str, c: int, samples: list[Sample],
                    wall_s: float | None = None) -> dict[str, Any]:
    """Throughput and latency of ``samples`` run ``c`` at a time (``wall_s``: their wall
    time; at concurrency 1, the sum of their end-to-end times)."""
    if wall_s is None:
        wall_s = sum(s.end_to_end_ms for s in samples) / 1e3
    return {"mode": mode, "concurrency": c, "requests": len(samples),
            "requests_per_s": round(len(samples) / wall_s, 3),
            "end_to_end_ms_p50": pct([s.end_to_end_ms for s in samples], 0.5),
            "stage2_first_beam_ms_p50": pct([s.stage2_first_beam_ms for s in samples], 0.5),
            "stage2_first_beam_ms_p95": pct([s.stage2_first_beam_ms for s in samples], 0.95)}


def format_report(r: dict[str, Any]) -> str:
    lines = ["one request at a time, both prefix caches emptied before each; handoff = cold D",
             f"{'mode':<18}{'first beam p50':>15}{'p95':>9}{'stage2 p50':>12}{'p95':>9}"
             f"{'e2e p50':>10}{'D computed':>11}{'KiB moved':>10}{'GB/s':>7}{'hit P':>7}"
             f"{'hit D':>7}  beams=B  =vLLM"]

    def rate(x: float | None) -> str:
        return f"{x:>7.2f}" if x is not None else f"{'-':>7}"

    for mode in MODES:
        m = r["modes"][mode]
        kib = m.get("kv_bytes_per_request")
        lines.append(
            f"{mode:<18}{m['stage2_first_beam_ms_p50']:>15.1f}{m['stage2_first_beam_ms_p95']:>9.1f}"
            f"{m['stage2_total_ms_p50']:>12.1f}{m['stage2_total_ms_p95']:>9.1f}"
            f"{m['end_to_end_ms_p50']:>10.0f}{m['computed_tokens_d_per_request']:>11.1f}"
            f"{(kib / 1024 if kib else 0):>10.0f}{m.get('transfer_gbps', 0):>7.2f}"
            f"{rate(m.get('prefix_cache_hit_rate_p'))}{rate(m.get('prefix_cache_hit_rate_d'))}  "
            f"{m['beams_match_colocated']:>7}{m['beams_match_vllm_beam_search']:>7}")
    w = r.get("handoff_warm")
    if w:
        lines.append(
            f"handoff, warm D (holds the prompt): first beam p50 {w['stage2_first_beam_ms_p50']:.1f} ms, "
            f"read {w['tokens_read_per_request']:.0f} tokens, found "
            f"{w['tokens_found_on_d_per_request']:.0f} on D, "
            f"{w['bytes_saved_per_request'] / 2**20:.1f} MiB not moved per request")
    lines.append("")
    lines.append(f"{'concurrency':<12}{'mode':<18}{'req/s':>8}{'e2e p50 ms':>12}"
                 f"{'first beam p50':>16}{'p95':>9}")
    for row in r["concurrency"]:
        lines.append(f"{row['concurrency']:<12}{row['mode']:<18}{row['requests_per_s']:>8.2f}"
                     f"{row['end_to_end_ms_p50']:>12.0f}{row['stage2_first_beam_ms_p50']:>16.1f}"
                     f"{row['stage2_first_beam_ms_p95']:>9.1f}")
    if r.get("floor"):
        lines.append("")
        lines.append(f"{'W':>4}{'T':>4}{'stage2 ms':>11}{'import step':>13}{'decode step':>13}"
                     f"{'floor ms':>10}{'ratio':>7}{'beam step':>11}{'+logprobs':>11}")
        for row in r["floor"]:
            lines.append(f"{row['beam_width']:>4}{row['beam_tokens']:>4}"
                         f"{row['stage2_total_ms']:>11.1f}{row['import_step_ms']:>13.1f}"
                         f"{row['decode_step_ms']:>13.1f}{row['floor_ms']:>10.1f}"
                         f"{row['ratio']:>7.2f}{row['beam_step_ms']:>11.1f}"
                         f"{row['decode_step_logprobs_ms']:>11.1f}")
    lines.append("")
    lines.append(f"{'parent':<8}{'MiB':>6}{'descs':>7}{'READ ms':>9}{'GB/s':>7}{'raw':>7}"
                 f"{'ratio':>7}{'raw@descs':>10}{'import step':>13}{'tail fwd':>10}{'budget':>8}"
                 f"{'prefill ms':>12}")
    for row in r["sweep"]:
        t = row["transfer_ms"]
        lines.append(f"{row['parent_tokens']:<8}{row['kv_bytes'] / 2**20:>6.1f}"
                     f"{row['descriptors']:>7}{(t if t is not None else float('nan')):>9.2f}"
                     f"{row['read_gbps'] or 0:>7.2f}{row.get('raw_nixl_gbps', 0):>7.2f}"
                     f"{row.get('read_vs_raw', 0):>7.2f}"
                     f"{row.get('raw_same_descriptors_gbps', 0):>10.2f}"
                     f"{row['import_step_ms']:>13.1f}"
                     f"{row['tail_forward_ms']:>10.1f}{row['import_step_budget_ms']:>8.1f}"
                     f"{row['prefill_ms']:>12.1f}")
    if r.get("idle_cpu"):
        c = r["idle_cpu"]
        lines.append("")
        lines.append(f"CPU over {c['seconds']:.0f} s, % of a core: P idle {c['p_cpu_pct_idle']:.1f}, "
                     f"P holding an unread export {c['p_cpu_pct_holding_export']:.1f} (both "
                     f"engines: {c['engines_cpu_pct_idle']:.1f} idle, "
                     f"{c['engines_cpu_pct_holding_export']:.1f} holding)")
    if r.get("router"):
        ro = r["router"]
        lines.append("")
        lines.append(f"router overhead p50 {ro['router_overhead_ms_p50']:.2f} ms (p95 "
                     f"{ro['router_overhead_ms_p95']:.2f}); end to end p50 via router "
                     f"{ro['end_to_end_ms_p50_router']:.0f} ms vs direct engine calls "
                     f"{ro['end_to_end_ms_p50_direct']:.0f} ms (paired difference p50 "
                     f"{ro['router_minus_direct_ms_p50']:+.1f} ms); beams equal "
                     f"{ro['beams_match_direct']}")
    t = r["transfer"]
    lines.append("")
    lines.append(f"raw NIXL READ {t['nixl_gbps']:.2f} GB/s vs same-host memcpy {t['memcpy_gbps']:.2f}"
                 f" GB/s (largest size; per size in the JSON)")
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(MODES))
    first = [r["modes"][m]["stage2_first_beam_ms_p50"] for m in MODES]
    total = [r["modes"][m]["stage2_total_ms_p50"] for m in MODES]
    ax1.bar([x - 0.2 for x in xs], first, width=0.4, label="first beam step p50")
    ax1.bar([x + 0.2 for x in xs], total, width=0.4, label="stage 2 total p50")
    ax1.set_xticks(list(xs), [m.replace("_", "\n") for m in MODES])
    ax1.set_ylabel("ms")
    ax1.set_yscale("log")
    ax1.set_title("stage 2 latency by mode")
    ax1.legend()
    sweep = r["sweep"]
    ax2.plot([s["parent_tokens"] for s in sweep], [s["transfer_ms"] or 0 for s in sweep], "o-",
             label="NIXL transfer")
    ax2.plot([s["parent_tokens"] for s in sweep], [s["prefill_ms"] for s in sweep], "s-",
             label="prefill it replaces")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("parent tokens")
    ax2.set_ylabel("ms")
    ax2.set_title("transfer vs prefill")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)

"""The benchmark's numbers as people read them: percentiles, per-mode summaries, the
printed report and the plot."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from tools.harness_report import LOGPROB_TOLERANCE

if TYPE_CHECKING:
    from tools.bench import Sample

MODES = ("text_roundtrip", "colocated", "handoff", "vllm_beam_search")


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
        out["kv_bytes_per_request"] = statistics.mean(s.kv_bytes for s in moved)
        out["transfer_ms_p50"] = pct([s.transfer_ms for s in moved], 0.5)
        out["transfer_gbps"] = round(sum(s.kv_bytes for s in moved)
                                     / (sum(s.transfer_ms for s in moved) / 1e3) / 1e9, 3)
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
    return {
        "beams_match_colocated": f"{same}/{len(got)}",
        "beams_match_vllm_beam_search": f"{agree}/{len(got)}",
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
            "stage2_first_beam_ms_p50": pct([s.stage2_first_beam_ms for s in samples], 0.5)}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"{'mode':<18}{'first beam p50':>15}{'p95':>9}{'stage2 p50':>12}{'p95':>9}"
             f"{'e2e p50':>10}{'D computed':>11}{'KiB moved':>10}{'GB/s':>7}  beams=B  =vLLM"]
    for mode in MODES:
        m = r["modes"][mode]
        kib = m.get("kv_bytes_per_request")
        lines.append(
            f"{mode:<18}{m['stage2_first_beam_ms_p50']:>15.1f}{m['stage2_first_beam_ms_p95']:>9.1f}"
            f"{m['stage2_total_ms_p50']:>12.1f}{m['stage2_total_ms_p95']:>9.1f}"
            f"{m['end_to_end_ms_p50']:>10.0f}{m['computed_tokens_d_per_request']:>11.1f}"
            f"{(kib / 1024 if kib else 0):>10.0f}{m.get('transfer_gbps', 0):>7.2f}  "
            f"{m['beams_match_colocated']:>7}{m['beams_match_vllm_beam_search']:>7}")
    lines.append("")
    lines.append(f"{'concurrency':<12}{'mode':<18}{'req/s':>8}{'e2e p50 ms':>12}{'first beam p50':>16}")
    for row in r["concurrency"]:
        lines.append(f"{row['concurrency']:<12}{row['mode']:<18}{row['requests_per_s']:>8.2f}"
                     f"{row['end_to_end_ms_p50']:>12.0f}{row['stage2_first_beam_ms_p50']:>16.1f}")
    lines.append("")
    lines.append(f"{'parent tokens':<14}{'KiB':>8}{'transfer ms':>13}{'import step ms':>16}"
                 f"{'prefill ms':>12}")
    for row in r["sweep"]:
        t = row["transfer_ms"]
        lines.append(f"{row['parent_tokens']:<14}{row['kv_bytes'] / 1024:>8.0f}"
                     f"{(t if t is not None else float('nan')):>13.2f}"
                     f"{row['import_step_ms']:>16.1f}{row['prefill_ms']:>12.1f}")
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

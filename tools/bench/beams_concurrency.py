"""``kvhandoff bench --beams --concurrency 1,4,8,32``: stage 2 at throughput, C beam
searches at once, ours against vLLM's beam search and against the floor at concurrency.

On one P+D pair in this process, the engines to itself:

- **parents**: ``max(C)`` distinct prompts, each a two-stage request by handoff (P's
  stage 1, D imports the parent over NIXL): their stage-2 prompts are the searches'.
- for each W (increasing), then each C (increasing), the first C stage-2 prompts, warm
  on D (a 1-token request each first: the parents' full blocks in D's prefix cache):
  - **ours** (``decode_engine.engine.run_beam_stage``) and **vLLM's**
    (``decode_engine.vllm_peer.vllm_beam_search``): C searches at once (``asyncio.gather``),
    in the order ours, vLLM's, ours, vLLM's: each run's wall time (QPS = C / wall) and
    each search's latency; the better of the two runs is reported, and the first
    against the second (the first run of a new (W, C) shape);
  - **identity**: every search's beams, ours against vLLM's and ours' two runs against
    each other; any difference fails the bench (``BeamsConcurrencyResult.identical``);
  - **floor at concurrency** (plain vLLM on D): the import step(s), C 1-token requests on
    the same warm prompts at once (wall time, median of ``FLOOR_REPEATS``), plus T-1
    engine steps decoding C x W sequences of those prompts, each cut to one token past
    its last full block (``floor.decode_step_ms_many``; below);
    floor QPS = C / floor; ours / floor = floor QPS / ours QPS;
  - **where ours' time goes** (its better run): the engine step with C x W slots (slot
    0's inter-token times, ``beams.slot_step_ms``), the logits processor's ms a step per
    group and over the C groups, blocks copied a step over the groups, the import step
    (the slowest search's step 0), and the rest ("front end": submissions and outputs);
  - a (W, C) whose C searches D's pool cannot hold at once beside the parents
    (``stage2_reservation``) is skipped, with the arithmetic.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

from decode_engine.engine import run_beam_stage
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.budget import stage2_reservation
from kvhandoff.types import BeamParams
from tools.bench.beams import engine_core_hwm_mib, slot_step_ms
from tools.bench.floor import decode_step_ms_many
from tools.bench.modes import Bench, make_prompts
from tools.bench.report import nearest_rank
from tools.bench.types import BenchConfig
from tools.local import local_pair

WIDTHS = (50, 128, 512)
CONCURRENCY = (1, 4, 8, 32)
TOKENS = 3
#: D's KV pool by default (``--d-pool-mib``): W=50 at C=32 and W=512 at C=4 beside 32
#: parents of the bench model (768 KiB blocks); W=512 at C=8 needs about 4.7 GiB.
D_POOL_MIB = 4096
FLOOR_REPEATS = 3
#: D's max_num_seqs at most (vLLM wants max_num_batched_tokens, 4096, no smaller).
MAX_SEQUENCES = 4096
#: Parents imported by handoff at once.
IMPORTS_AT_ONCE = 8


@dataclass
class BeamsConcurrencyResult:
    """The report: its settings, one row per (W, C) measured, the ones skipped."""

    settings: dict[str, Any]
    rows: list[dict[str, Any]]
    skipped: list[dict[str, Any]]

    @property
    def identical(self) -> bool:
        """Every row's beams: ours = vLLM's, and ours' two runs the same."""
        return all(row["same_beams"] for row in self.rows)

    def as_dict(self) -> dict[str, Any]:
        return {**self.settings, "rows": self.rows, "skipped": self.skipped,
                "identical": self.identical}


async def _timed(coro: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = await coro
    return out, (time.perf_counter() - t0) * 1e3


async def _searches(bench: Bench, prompts: list[list[int]], beam: BeamParams,
                    kind: str) -> dict[str, Any]:
    """One run: ``len(prompts)`` searches at once, ours or vLLM's; their beams (token ids
    per search), latencies, the run's wall time, and ours' Stage2Results."""
    if kind == "ours":
        calls = [run_beam_stage(bench.d, p, beam, bench.new_id("ours")) for p in prompts]
    else:
        calls = [vllm_beam_search(bench.d.llm, bench.tok, p, beam, bench.new_id("vllm"))
                 for p in prompts]
    t0 = time.perf_counter()
    done = await asyncio.gather(*(_timed(c) for c in calls))
    wall_ms = (time.perf_counter() - t0) * 1e3
    outs = [out for out, _ in done]
    beams = [[list(b.token_ids) for b in (o.beams if kind == "ours" else o)] for o in outs]
    return {"wall_ms": wall_ms, "latency_ms": [ms for _, ms in done], "beams": beams,
            "results": outs if kind == "ours" else None}


async def _warm(bench: Bench, prompts: list[list[int]]) -> float:
    """A 1-token request on each prompt at once (plain vLLM): the wall time in ms."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    await asyncio.gather(*(bench.d.generate(p, params, bench.new_id("import"))
                           for p in prompts))
    return (time.perf_counter() - t0) * 1e3


def _breakdown(run: dict[str, Any], step_ms: float | None, tokens: int) -> dict[str, Any]:
    """Where ours' run went (module docstring), from its Stage2Results."""
    results = run["results"]
    steps = [r.beam_steps or {} for r in results]
    select = [ms for s in steps for ms in (s.get("select_ms") or [])]
    copied = [n for s in steps for n in (s.get("copied_blocks") or [])]
    per_group = statistics.mean(select) if select else None
    import_ms = max(r.first_step_s for r in results) * 1e3
    return {
        "slot_step_ms": None if step_ms is None else round(step_ms, 1),
        "select_ms_per_step_per_group": None if per_group is None else round(per_group, 2),
        "select_ms_per_step_all_groups": (None if per_group is None
                                          else round(per_group * len(results), 1)),
        "copied_blocks_per_step_all_groups": (round(sum(copied) / (tokens - 1), 1)
                                              if copied and tokens > 1 else 0),
        "import_step_ms": round(import_ms, 1),
        "front_end_ms": (None if step_ms is None else
                         round(run["wall_ms"] - import_ms - (tokens - 1) * step_ms, 1)),
    }


async def concurrency_point(bench: Bench, prompts: list[list[int]], width: int,
                            tokens: int) -> dict[str, Any]:
    """One (W, C = len(prompts)): the figures in the module docstring."""
    c, beam = len(prompts), BeamParams(beam_width=width, max_tokens=tokens)
    await _warm(bench, prompts)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "vllm": []}
    spans: list[tuple[int, int]] = []  # D's iterations during ours' runs
    for _ in range(2):
        since = bench.d.counters.iterations
        runs["ours"].append(await _searches(bench, prompts, beam, "ours"))
        await asyncio.sleep(0.05)  # the stats follow the outputs by a step
        spans.append((since, bench.d.counters.iterations))
        runs["vllm"].append(await _searches(bench, prompts, beam, "vllm"))
    best = min(range(2), key=lambda i: runs["ours"][i]["wall_ms"])
    step = slot_step_ms(bench, width, *spans[best])
    same = (runs["ours"][0]["beams"] == runs["ours"][1]["beams"]
            and all(r["beams"] == runs["ours"][0]["beams"] for r in runs["vllm"]))
    import_ms = statistics.median([await _warm(bench, prompts) for _ in range(FLOOR_REPEATS)])
    # The decode steps' sequences end one token into a block: their full blocks are the
    # parents' (cached), each computes one token to start, so C x W start in one step's
    # token budget, and decode within one block each (C x W blocks, as the pool is sized).
    #   | parent's full blocks (cached, shared) | 1 | decoded ... | (one block each)
    # Up to block_size - 1 tokens shorter than the parents: a floor a hair low.
    bs = bench.d.block_size
    trimmed = [p[:(len(p) - 1) // bs * bs + 1] for p in prompts]
    admit = -(-c * width // bench.d.config.max_num_batched_tokens)
    decode_ms = await decode_step_ms_many(bench, trimmed, width, max(tokens, 3) + admit + 2)
    floor_ms = import_ms + (tokens - 1) * decode_ms
    row: dict[str, Any] = {"beam_width": width, "concurrency": c, "beam_tokens": tokens,
                           "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
                           "floor_tokens_mean": round(statistics.mean(map(len, trimmed)), 1)}
    for kind, rs in runs.items():
        walls = [r["wall_ms"] for r in rs]
        lat = rs[min(range(2), key=lambda i: walls[i])]["latency_ms"]
        row |= {f"{kind}_qps": round(c * 1e3 / min(walls), 3),
                f"{kind}_qps_runs": [round(c * 1e3 / w, 3) for w in walls],
                f"{kind}_first_over_second": round(walls[0] / walls[1], 2),
                f"{kind}_p50_ms": round(statistics.median(lat), 1),
                f"{kind}_p99_ms": round(nearest_rank(lat, 0.99), 1)}
    row |= {"ours_over_vllm": round(row["ours_qps"] / row["vllm_qps"], 2),
            "floor_import_ms": round(import_ms, 1), "floor_decode_step_ms": round(decode_ms, 1),
            "floor_ms": round(floor_ms, 1), "floor_qps": round(c * 1e3 / floor_ms, 3)}
    row["ours_over_floor"] = round(row["floor_qps"] / row["ours_qps"], 2)
    row |= _breakdown(runs["ours"][best], step, tokens)
    row |= {"same_beams": same, "d_peak_rss_mib": engine_core_hwm_mib(bench.d.llm)}
    return row


async def _import_parents(bench: Bench, cfg: BenchConfig, n: int,
                          tokens: int) -> tuple[list[list[int]], int]:
    """``n`` parents by handoff (``IMPORTS_AT_ONCE`` at a time, caches emptied first):
    their stage-2 prompts, and the tokens D read over NIXL for them."""
    prompts = make_prompts(bench.tok, n, cfg.prompt_tokens, cfg.seed + 60)
    sem = asyncio.Semaphore(IMPORTS_AT_ONCE)
    await bench.empty_caches()

    async def one(i: int, prompt: list[int]) -> Any:
        async with sem:
            return await bench.one("handoff", prompt, cfg.seed + i, alone=False,
                                   beam=BeamParams(beam_width=4, max_tokens=tokens))

    samples = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return [s.stage2_prompt for s in samples], sum(s.tokens_read for s in samples)


def _too_big(bench: Bench, prompts: list[list[int]], width: int, tokens: int) -> dict | None:
    """None if D's pool holds the searches of ``prompts`` at once beside every parent's
    full blocks, else the arithmetic that says it does not."""
    d, bs = bench.d, bench.d.block_size
    need = sum(stage2_reservation(len(p), bs, width, tokens, d.config.beam_fork,
                                  d.num_total_blocks) for p in prompts)
    parents = sum(len(p) // bs for p in prompts)
    if need + parents <= d.num_total_blocks and len(prompts) * width <= d.config.max_num_seqs:
        return None
    return {"beam_width": width, "concurrency": len(prompts), "blocks_needed": need,
            "parents_blocks": parents, "pool_blocks": d.num_total_blocks,
            "sequences": len(prompts) * width, "max_num_seqs": d.config.max_num_seqs}


async def run_beams_concurrency(cfg: BenchConfig, widths: tuple[int, ...] = WIDTHS,
                                concurrency: tuple[int, ...] = CONCURRENCY,
                                tokens: int = TOKENS, pair: Any = None,
                                progress: Any = None,
                                d_pool_mib: int = D_POOL_MIB) -> BeamsConcurrencyResult:
    """The grid, on ``pair`` if given (tests), else on a new P+D pair whose D has a pool
    of ``d_pool_mib`` and room for the largest C x W."""
    if pair is None:
        max_len = cfg.prompt_tokens + cfg.stage1_tokens + 64 + tokens
        max_len += -max_len % 32
        seqs = max(64, max(w * c for w in widths for c in concurrency))
        common = dict(max_model_len=max_len, kv_cache_memory_bytes=2 << 30, lease_s=60,
                      max_num_seqs=min(seqs, MAX_SEQUENCES), max_num_batched_tokens=4096,
                      max_logprobs=max(64, 2 * max(widths)))
        async with local_pair(cfg.model, decode_overrides={
                "kv_cache_memory_bytes": d_pool_mib << 20}, **common) as new:
            return await run_beams_concurrency(cfg, widths, concurrency, tokens, new, progress)
    bench = Bench(pair, cfg)
    # Every path once, on a short prompt: the engines' first requests out of the figures.
    await bench.one("handoff", make_prompts(bench.tok, 1, 64, cfg.seed)[0], 1, stage1_tokens=4)
    await vllm_beam_search(bench.d.llm, bench.tok, make_prompts(bench.tok, 1, 64, 1)[0],
                           BeamParams(4, 2), bench.new_id("w"))
    prompts, read = await _import_parents(bench, cfg, max(concurrency), tokens)
    rows, skipped = [], []
    for width in sorted(widths):
        for c in sorted(concurrency):
            too_big = _too_big(bench, prompts[:c], width, tokens)
            if too_big is not None:
                skipped.append(too_big)
            else:
                rows.append(await concurrency_point(bench, prompts[:c], width, tokens))
            if progress is not None:
                progress(f"W={width} C={c}: {too_big or rows[-1]}")
    settings = {"model": str(pair.model_dir), "prompt_tokens": cfg.prompt_tokens,
                "stage1_tokens": cfg.stage1_tokens, "beam_tokens": tokens,
                "parents": len(prompts), "parents_tokens_read_by_d": read,
                "d_pool_blocks": bench.d.num_total_blocks,
                "d_max_num_seqs": bench.d.config.max_num_seqs}
    return BeamsConcurrencyResult(settings, rows, skipped)


COLUMNS = ("beam_width", "concurrency", "ours_qps", "vllm_qps", "ours_over_vllm",
           "floor_qps", "ours_over_floor", "ours_p50_ms", "ours_p99_ms", "vllm_p50_ms",
           "vllm_p99_ms", "ours_first_over_second", "vllm_first_over_second",
           "slot_step_ms", "floor_decode_step_ms", "select_ms_per_step_all_groups",
           "copied_blocks_per_step_all_groups", "import_step_ms", "floor_import_ms",
           "front_end_ms", "same_beams")


def format_beams_concurrency(result: dict[str, Any]) -> str:
    lines = ["  ".join(COLUMNS)]
    lines += ["  ".join(str(row.get(c)) for c in COLUMNS) for row in result["rows"]]
    lines += [f"skipped W={s['beam_width']} C={s['concurrency']}: {s['blocks_needed']} + "
              f"{s['parents_blocks']} blocks of {s['pool_blocks']}, {s['sequences']} "
              f"sequences of {s['max_num_seqs']}" for s in result["skipped"]]
    lines.append("beams identical (ours = vLLM's, both runs) in every row"
                 if result["identical"] else "BEAMS DIFFER in some row: see same_beams")
    return "\n".join(lines)

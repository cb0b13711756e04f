"""``kvhandoff bench --beams``: stage 2's beam search inside D against its floor and
against vLLM's own beam search, for beam widths W and beam tokens T.

For each W (increasing) and T, on one P+D pair in this process, the engines to itself:

- **ours, cold**: a handoff (P's stage 1, D imports the parent over NIXL and runs the
  search): stage 2's total and its import step;
- **floor**: that import step plus T-1 engine steps decoding W sequences of the stage-2
  prompt's length (vLLM's iteration stats: ``floor.decode_step_ms``); ratio = ours / floor;
  both ``BenchConfig.beam_repeats`` times (another parent each), medians reported (one
  sample moved the ratio by a third on this 2-core machine);
- **ours and vLLM's, warm**: the same stage-2 prompt on D again, ours (step 0 finds the
  parent's full blocks in D's prefix cache) then vLLM's ``beam_search`` (the online one,
  ``decode_engine.vllm_peer.vllm_beam_search``) in the same cache state; ratio = vLLM / ours;
- **the slots' steps** (ours, warm): the logits processor's milliseconds a step, the
  blocks copied after a step, the engine step with W slots (iteration stats), and what is
  left of the slots' part ("front end": their submission, the final outputs);
- **peak memory of D's engine-core process** (VmHWM: widths run in increasing order, so
  each figure is the peak up to that width);
- **constrained to a catalog** (``catalog`` rows, W in ``CATALOG_WIDTHS``, T = 3): a
  synthetic semantic-id catalog (three codebooks of 256 tokens, ``CATALOG_ITEMS`` items:
  every depth keeps more than W beams alive), stage 2 warm on D open and constrained,
  alternated (open first) ``CATALOG_REPEATS`` times in the same cache state: the medians,
  their ratio, and the processor's milliseconds a step each way.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from decode_engine.engine import run_beam_stage
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.types import BeamParams
from tools.bench.floor import decode_step_ms
from tools.bench.modes import Bench, make_prompts
from tools.bench.types import BenchConfig
from tools.local import local_pair

WIDTHS = (4, 32, 128, 512)
TOKENS = (3, 8)
CATALOG_WIDTHS = (32, 512)
CATALOG_ITEMS = 20_000
CATALOG_REPEATS = 3


def synthetic_catalog(path: Path, seed: int) -> Path:
    """Semantic ids of three tokens, one from each of three codebooks of 256 ordinary
    tokens (ids 10-777 of a 1024-token vocabulary), ``CATALOG_ITEMS`` distinct ones."""
    import random

    rng = random.Random(seed)
    items: set[tuple[int, int, int]] = set()
    while len(items) < CATALOG_ITEMS:
        items.add((10 + rng.randrange(256), 266 + rng.randrange(256), 522 + rng.randrange(256)))
    path.write_text("".join(f"{a} {b} {c}\n" for a, b, c in sorted(items)))
    return path


async def catalog_point(bench: Bench, prompt: list[int], width: int) -> dict[str, Any]:
    """Open and constrained stage 2 warm on D, alternated (module docstring)."""
    cold = await bench.one("handoff", prompt, 1, beam=BeamParams(beam_width=4, max_tokens=3))
    runs: dict[str, list[Any]] = {"open": [], "catalog": []}
    times: dict[str, list[float]] = {"open": [], "catalog": []}
    for _ in range(CATALOG_REPEATS):
        for kind in ("open", "catalog"):
            beam = BeamParams(beam_width=width, max_tokens=3,
                              catalog="bench" if kind == "catalog" else None)
            t0 = time.perf_counter()
            runs[kind].append(await run_beam_stage(bench.d, cold.stage2_prompt, beam,
                                                   bench.new_id(kind)))
            times[kind].append((time.perf_counter() - t0) * 1e3)

    def select_ms(kind: str) -> float | None:
        steps = [ms for r in runs[kind] for ms in ((r.beam_steps or {}).get("select_ms") or [])]
        return round(statistics.mean(steps), 2) if steps else None

    open_ms, catalog_ms = statistics.median(times["open"]), statistics.median(times["catalog"])
    return {"beam_width": width, "beam_tokens": 3, "catalog_items": CATALOG_ITEMS,
            "open_warm_ms": round(open_ms, 1), "catalog_warm_ms": round(catalog_ms, 1),
            "catalog_over_open": round(catalog_ms / open_ms, 3),
            "open_select_ms_per_step": select_ms("open"),
            "catalog_select_ms_per_step": select_ms("catalog"),
            "catalog_beams": len(runs["catalog"][-1].beams)}


def engine_core_hwm_mib(llm: Any) -> float | None:
    """Peak resident memory (VmHWM) of ``llm``'s engine-core process, MiB (None if vLLM's
    process list is not where 0.32 keeps it)."""
    manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
    procs = getattr(manager, "processes", None)
    if not procs:
        return None
    for line in Path(f"/proc/{procs[0].pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def slot_step_ms(bench: Bench, width: int, since: int,
                 until: int | None = None) -> float | None:
    """Median engine step of the slots, after iteration ``since`` (up to ``until``, if
    given; D runs nothing else then): the time between slot 0's tokens (the front end
    knows slot 0 alone, the engine makes the others: vLLM's iteration stats list its
    inter-token time only)."""
    steps = [max(it.inter_token_s) for it in bench.d.counters.recent_iterations
             if it.index > since and (until is None or it.index <= until)
             and it.inter_token_s]
    return statistics.median(steps) * 1e3 if steps else None


async def beam_point(bench: Bench, prompt: list[int], width: int, tokens: int,
                     seed: int) -> dict[str, Any]:
    """One (W, T): the figures in the module docstring."""
    beam = BeamParams(beam_width=width, max_tokens=tokens)
    colds, steps_ms, ratios = [], [], []
    for rep in range(bench.cfg.beam_repeats):
        # Another stage-1 seed: another parent, so D's cache misses it (cold).
        cold = await bench.one("handoff", prompt, seed + 1000 * rep, beam=beam)
        # Long enough that all W, admitted over a few steps (their partial blocks share
        # the token budget), decode together for a while.
        step_ms = await decode_step_ms(bench, cold.stage2_prompt, width,
                                       max(tokens, 3) + width // 32)
        colds.append(cold)
        steps_ms.append(step_ms)
        ratios.append(cold.stage2_total_ms / (cold.stage2_first_beam_ms
                                              + (tokens - 1) * step_ms))
    med = statistics.median
    step_ms = med(steps_ms)
    floor_ms = med(c.stage2_first_beam_ms for c in colds) + (tokens - 1) * step_ms
    since = bench.d.counters.iterations
    t0 = time.perf_counter()
    ours = await run_beam_stage(bench.d, cold.stage2_prompt, beam, bench.new_id("warm"))
    ours_ms = (time.perf_counter() - t0) * 1e3
    slot_step = slot_step_ms(bench, width, since)
    t0 = time.perf_counter()
    theirs = await vllm_beam_search(bench.d.llm, bench.tok, cold.stage2_prompt, beam,
                                    bench.new_id("vllm"))
    vllm_ms = (time.perf_counter() - t0) * 1e3
    same = [b.token_ids for b in ours.beams] == [b.token_ids for b in theirs]
    steps = getattr(ours, "beam_steps", None) or {}
    select = steps.get("select_ms") or []
    slots_ms = ours_ms - ours.first_step_s * 1e3
    return {
        "beam_width": width, "beam_tokens": tokens, "parent_tokens": cold.parent_tokens,
        "repeats": len(colds),
        "stage2_cold_ms": round(med(c.stage2_total_ms for c in colds), 1),
        "import_step_ms": round(med(c.stage2_first_beam_ms for c in colds), 1),
        "decode_step_ms": round(step_ms, 1),
        "floor_ms": round(floor_ms, 1),
        # The median of each cold run against the floor measured right after it.
        "ratio_to_floor": round(med(ratios), 3),
        "ratio_to_floor_runs": [round(r, 3) for r in ratios],
        "ours_warm_ms": round(ours_ms, 1), "vllm_warm_ms": round(vllm_ms, 1),
        "vllm_over_ours": round(vllm_ms / ours_ms, 2), "same_beams_as_vllm": same,
        "slot_step_ms": None if slot_step is None else round(slot_step, 1),
        "select_ms_per_step": round(statistics.mean(select), 2) if select else None,
        "copied_blocks_per_step": (round(statistics.mean(steps["copied_blocks"]), 1)
                                   if steps.get("copied_blocks") else 0),
        "front_end_ms": (None if slot_step is None else
                         round(slots_ms - (tokens - 1) * slot_step, 1)),
        "d_peak_rss_mib": engine_core_hwm_mib(bench.d.llm),
    }


async def run_beams(cfg: BenchConfig, widths: tuple[int, ...] = WIDTHS,
                    tokens: tuple[int, ...] = TOKENS, progress: Any = None
                    ) -> dict[str, Any]:
    """The grid on a fresh P+D pair sized for the widest W."""
    widest = max(widths)
    max_len = cfg.prompt_tokens + cfg.stage1_tokens + 64 + max(tokens)
    max_len += -max_len % 32
    common = dict(max_model_len=max_len, kv_cache_memory_bytes=2 << 30, lease_s=60,
                  max_num_seqs=max(64, widest), max_logprobs=max(64, 2 * widest))
    rows, catalog_rows = [], []
    catalog = synthetic_catalog(Path(tempfile.mkdtemp()) / "bench-catalog.txt", cfg.seed)
    common["catalogs"] = (("bench", str(catalog)),)
    async with local_pair(cfg.model, **common) as pair:
        bench = Bench(pair, cfg)
        prompt = make_prompts(bench.tok, 1, cfg.prompt_tokens, cfg.seed + 77)[0]
        await bench.one("handoff", prompt[:64], 1, stage1_tokens=4)  # warm every path
        await vllm_beam_search(bench.d.llm, bench.tok, prompt[:64], BeamParams(4, 2), "w")
        for i, width in enumerate(sorted(widths)):
            for j, t in enumerate(tokens):
                rows.append(await beam_point(bench, prompt, width, t, cfg.seed + 80 + 10 * i + j))
                if progress is not None:
                    progress(f"W={width} T={t}: {rows[-1]}")
        for width in [w for w in CATALOG_WIDTHS if w <= widest]:
            catalog_rows.append(await catalog_point(bench, prompt, width))
            if progress is not None:
                progress(f"catalog W={width}: {catalog_rows[-1]}")
        await asyncio.sleep(0)
    return {"model": str(pair.model_dir), "prompt_tokens": cfg.prompt_tokens,
            "stage1_tokens": cfg.stage1_tokens, "rows": rows, "catalog": catalog_rows}


def format_beams(result: dict[str, Any]) -> str:
    cols = ["beam_width", "beam_tokens", "parent_tokens", "stage2_cold_ms", "floor_ms",
            "ratio_to_floor", "ours_warm_ms", "vllm_warm_ms", "vllm_over_ours",
            "slot_step_ms", "select_ms_per_step", "copied_blocks_per_step", "front_end_ms",
            "d_peak_rss_mib", "same_beams_as_vllm"]
    lines = ["  ".join(cols)]
    for row in result["rows"]:
        lines.append("  ".join(str(row.get(c)) for c in cols))
    if result.get("catalog"):
        cols = list(result["catalog"][0])
        lines += ["", "  ".join(cols)]
        lines += ["  ".join(str(row.get(c)) for c in cols) for row in result["catalog"]]
    return "\n".join(lines)

"""``kvhandoff bench``'s measurement: every phase in one run on one machine, on one P+D
pair started here (or the caller's).

Phases, in order: a warm-up of every mode; each prompt in every mode
(``tools.bench.modes``), the order of the modes rotated per prompt, each sample alone on
emptied caches; after each cold handoff a ``warm`` one on the same prompt (D holding the
prompt's blocks: tokens read vs found on D, bytes saved); throughput at concurrency
(handoff vs colocated, caches emptied before each batch, distinct prompts); the stage-2
floor for W x T and the import step's pieces per parent length (``tools.bench.floor``);
the CPU the engines use idle and while P holds an export nobody reads
(``tools.bench.idle``); the router's own time per request
(``tools.bench.router_overhead``); and, after the engines are gone, raw NIXL for the
bytes each sweep point read (``tools.bench.nixl_probe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict
from typing import Any

from tools.bench.floor import stage2_floor, sweep_point
from tools.bench.idle import idle_cpu
from tools.bench.modes import Bench, make_prompts, rotated
from tools.bench.nixl_probe import measure_descriptor_rate, measure_transfer
from tools.bench.report import agreement, concurrency_row, floor_row, summarize, summarize_warm
from tools.bench.router_overhead import measure_router_overhead
from tools.bench.types import MODES, BenchConfig, Sample
from tools.local import local_pair


async def _at_concurrency(bench: Bench, cfg: BenchConfig, mode: str, c: int) -> dict[str, Any]:
    """``c x rounds`` requests of one mode, ``c`` at a time, on emptied caches and
    distinct prompts (no request finds another's blocks)."""
    prompts = make_prompts(bench.tok, c * cfg.rounds, cfg.prompt_tokens, cfg.seed + 1000 * c)
    sem = asyncio.Semaphore(c)
    await bench.empty_caches()

    async def go(i: int, prompt: list[int]) -> Sample:
        async with sem:
            return await bench.one(mode, prompt, cfg.seed + i, alone=False)

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(go(i, p) for i, p in enumerate(prompts)))
    return concurrency_row(mode, c, samples, wall_s=time.perf_counter() - t0)


async def run_bench(cfg: BenchConfig, progress: Any = None, pair: Any = None,
                    checkpoint: Any = None) -> dict[str, Any]:
    """Run every measurement; on ``pair`` if given (tests), else on a new P+D pair.
    ``checkpoint(result)`` is called after each phase with what is measured so far."""

    def tick(label: str) -> None:
        if progress is not None:
            progress(label)

    def save() -> None:
        if checkpoint is not None:
            checkpoint(result)

    max_parent = max([*cfg.sweep, cfg.prompt_tokens + cfg.stage1_tokens])
    max_len = max_parent + 64
    max_len += -max_len % 32
    pool = 2 << 30
    common = dict(max_model_len=max_len, kv_cache_memory_bytes=pool, lease_s=60,
                  max_num_seqs=max(64, cfg.beam_width * max(cfg.concurrency),
                                   max(cfg.floor_widths, default=1)),
                  max_logprobs=max(64, 2 * cfg.beam_width, *(2 * w for w in cfg.floor_widths)))
    result: dict[str, Any] = {"config": {**asdict(cfg)}, "modes": {}, "concurrency": [],
                              "sweep": [], "floor": [], "transfer": {}}
    t_start = time.perf_counter()
    started = contextlib.nullcontext(pair) if pair is not None else local_pair(cfg.model, **common)
    async with started as pair:
        bench = Bench(pair, cfg)
        prompts = make_prompts(bench.tok, cfg.requests, cfg.prompt_tokens, cfg.seed)
        # Warm every path once (first NIXL handshake, compile of logprobs gathers).
        for mode in MODES:
            await bench.one(mode, prompts[0][:64], 1, stage1_tokens=4)
        tick("warm-up")
        by_mode: dict[str, list[Sample]] = {m: [] for m in MODES}
        warm: list[Sample] = []
        for i, prompt in enumerate(prompts):
            for mode in rotated(MODES, i):
                by_mode[mode].append(await bench.one(mode, prompt, cfg.seed + i))
                if mode == "handoff":
                    # D now holds the prompt's blocks: the same prompt, another stage 1.
                    warm.append(await bench.one(mode, prompt, cfg.seed + i + 500,
                                                d_cache="warm"))
                tick(f"{mode} {i + 1}/{len(prompts)}")
        result["modes"] = {mode: {**summarize(by_mode[mode]), **agreement(by_mode, mode)}
                           for mode in MODES}
        result["handoff_warm"] = summarize_warm(warm)
        save()
        if 1 in cfg.concurrency:
            result["concurrency"] += [concurrency_row(m, 1, by_mode[m]) for m in MODES]
        for c in (c for c in cfg.concurrency if c > 1):
            for mode in cfg.concurrent_modes:
                result["concurrency"].append(await _at_concurrency(bench, cfg, mode, c))
                tick(f"concurrency {c} {mode}")
                save()
        floor_prompt = make_prompts(bench.tok, 1, cfg.prompt_tokens, cfg.seed + 77)[0]
        for w in cfg.floor_widths:
            for t in cfg.floor_tokens:
                rows = [await stage2_floor(bench, floor_prompt, w, t, cfg.seed + 80 + k)
                        for k in range(cfg.floor_repeats)]
                result["floor"].append(floor_row(rows))
                tick(f"floor W={w} T={t}")
                save()
        for i, n in enumerate(cfg.sweep):
            result["sweep"].append(await sweep_point(bench, n, cfg.seed + 7 + i))
            tick(f"sweep {n}")
            save()
        if cfg.idle_s:
            result["idle_cpu"] = await idle_cpu(bench, cfg.idle_s)
            tick("idle CPU")
            save()
        if cfg.router_requests:
            result["router"] = await measure_router_overhead(
                pair,
                make_prompts(bench.tok, cfg.router_requests, cfg.prompt_tokens, cfg.seed + 99),
                stage1_tokens=cfg.stage1_tokens, beam=bench.beam, progress=tick)
            save()
    # Raw NIXL for the bytes each sweep point read, and the configured sizes.
    sizes = sorted({*(row["kv_bytes"] for row in result["sweep"] if row["kv_bytes"]),
                    *(m << 20 for m in cfg.nixl_sizes_mib)})
    result["transfer"] = measure_transfer(sizes)
    raw = {row["bytes"]: row["nixl_gbps"] for row in result["transfer"]["sizes"]}
    for row in result["sweep"]:
        if row["read_gbps"] and row["kv_bytes"] in raw:
            row["raw_nixl_gbps"] = raw[row["kv_bytes"]]
            row["read_vs_raw"] = round(row["read_gbps"] / raw[row["kv_bytes"]], 3)
            # The same bytes in as many unmergeable descriptors as the engine posted.
            row["raw_same_descriptors_gbps"] = measure_descriptor_rate(
                row["kv_bytes"], max(1, row["descriptors"]))
    tick("raw transfer")
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return result

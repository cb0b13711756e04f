"""The CPU the engines use while nothing runs, and while P holds an export nobody reads
(what a lease costs P before D's READ), on a :class:`~tools.bench.modes.Bench`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from connector.handoff import ImportRequest
from tools.bench.modes import Bench, make_prompts
from tools.pipeline import stage2_prompt


def _engine_processes(engine: Any) -> list[Any]:
    """An engine's engine-core process(es) and their children (its worker)."""
    import psutil

    manager = engine.llm.engine_core.resources.engine_manager
    cores = [psutil.Process(p.pid) for p in manager.processes]
    return cores + [c for core in cores for c in core.children(recursive=True)]


def _cpu_s(processes: list[Any]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(Exception):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


async def idle_cpu(bench: Bench, seconds: float) -> dict[str, Any]:
    """CPU (percent of one core) of P's processes (engine core and worker) and of both
    engines' over ``seconds`` idle, then over ``seconds`` while P holds an export D
    has not read (then D reads it). Nothing else may run on the engines meanwhile."""

    p_procs = _engine_processes(bench.p)
    all_procs = p_procs + _engine_processes(bench.d)

    async def measure() -> tuple[float, float]:
        await asyncio.sleep(1.0)  # past the last request's steps
        p0, a0, t0 = _cpu_s(p_procs), _cpu_s(all_procs), time.perf_counter()
        await asyncio.sleep(seconds)
        elapsed = time.perf_counter() - t0
        return (round(100 * (_cpu_s(p_procs) - p0) / elapsed, 1),
                round(100 * (_cpu_s(all_procs) - a0) / elapsed, 1))

    idle = await measure()
    prompt = make_prompts(bench.tok, 1, 64, 5)[0]
    req = bench.request(prompt, 1, 4)
    stage1 = await bench.p.run_stage1(prompt, req.stage1, bench.new_id("hold"), export=True,
                                      target=bench.d.handoff_target)
    holding = await measure()
    prompt2, _ = stage2_prompt(req, stage1)
    await bench.d.run_stage2(prompt2, bench.beam, bench.new_id("hold2"),
                             handoff=ImportRequest.for_beams(stage1.handoff_params, bench.beam))
    return {"seconds": seconds, "p_cpu_pct_idle": idle[0],
            "p_cpu_pct_holding_export": holding[0], "engines_cpu_pct_idle": idle[1],
            "engines_cpu_pct_holding_export": holding[1]}

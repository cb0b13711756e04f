"""``kvhandoff bench``: its flags to the measurement they select, and that measurement's
outputs (the printed report, ``--json``, ``--plot``). The flags themselves are defined in
``cli.main``.

One measurement per run: ``--beams`` (``tools.bench.beams``; with ``--concurrency``,
``tools.bench.beams_concurrency``), ``--chunks``
(``tools.bench.chunks`` and ``tools.bench.blend``), ``--fleet`` (``tools.bench.fleet``),
``--http-two-calls`` (``tools.bench.http_two_calls``), ``--serve-routers``
(``tools.bench.serve_routers``), ``--hosts-link``
(``tools.bench.hosts``), ``--moves`` (``tools.bench.moves``), ``--serve-scale``
(``tools.bench.serve_scale``), ``--read``
(``tools.bench.read``), ``--router-only`` (``tools.bench.router_overhead`` on
processes), else the full bench (``tools.bench.run``, ``--quick`` for its small
configuration). Each loads its module only when chosen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from tools.bench.report import format_report, plot
from tools.bench.router_overhead import measure_router_overhead_on_cluster
from tools.bench.run import run_bench
from tools.bench.types import MODES, BenchConfig


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    """``result`` as indented JSON at ``path`` (its folder made); nothing without a path."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """Those of ``names`` the command line set (the rest keep the config's defaults)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _report(args: argparse.Namespace, text: str, result: dict[str, Any]) -> int:
    print(text)
    _write_json(args.json, result)
    return 0


def _run_chunks(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """``--chunks MODE``: the exact bench (``tools.bench.chunks``), the approximate one's
    quality and speed (``tools.bench.blend``), or all three in that order; the report and
    the result (a key each: exact, quality, speed)."""
    from tools.bench.blend import format_blend, run_blend_quality, run_blend_speed
    from tools.bench.chunks import format_chunks, run_chunks

    mode, reps, seed = args.chunks, args.requests or 3, _given(args, "seed")
    result: dict[str, Any] = {}
    if mode in ("all", "exact"):
        result["exact"] = run_chunks(args.model, reps=reps, **seed)
    if mode in ("all", "approximate", "quality"):
        result["quality"] = run_blend_quality(**seed)
    if mode in ("all", "approximate", "speed"):
        result["speed"] = run_blend_speed(args.model, reps=reps, **seed)
    text = [format_chunks(result["exact"])] if "exact" in result else []
    if "quality" in result or "speed" in result:
        text.append(format_blend(result.get("speed"), result.get("quality")))
    return "\n\n".join(text), result


def _run_beams_concurrency(args: argparse.Namespace) -> int:
    """``--beams --concurrency``: print and write the grid; 1 if any row's beams differ."""
    from tools.bench.beams_concurrency import (
        WIDTHS,
        format_beams_concurrency,
        run_beams_concurrency,
    )

    widths = tuple(int(x) for x in args.widths.split(",")) if args.widths else WIDTHS
    result = asyncio.run(run_beams_concurrency(
        BenchConfig(model=args.model or "bench",
                    **_given(args, "prompt_tokens", "stage1_tokens", "seed")),
        widths, tuple(int(x) for x in args.concurrency.split(",")),
        **({"tokens": args.beam_tokens} if args.beam_tokens else {}),
        **({"d_pool_mib": args.d_pool_mib} if args.d_pool_mib else {}),
        progress=lambda label: print(label, flush=True))).as_dict()
    _report(args, format_beams_concurrency(result), result)
    return 0 if result["identical"] else 1


def _run_e2e(args: argparse.Namespace) -> int:
    """``--e2e``: print and write the table; 1 if any answer differs or left its path."""
    from tools.bench.e2e_concurrency import E2EConfig, format_e2e, measure_e2e

    kw = _given(args, "prompt_tokens", "stage1_tokens", "beam_width", "beam_tokens", "seed")
    if args.concurrency:
        kw["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
    result = measure_e2e(args.model or "bench", E2EConfig(**kw)).as_dict()
    _report(args, format_e2e(result), result)
    return 0 if result["identical"] else 1


def main_bench(args: argparse.Namespace) -> int:
    """Run the measurement ``args`` select, print it, write its JSON and plot; 0."""
    from tqdm import tqdm

    if args.http_two_calls:
        from tools.bench.http_two_calls import format_two_calls, measure_two_calls_over_http

        kw = {"requests": args.requests or 8,
              **_given(args, "prompt_tokens", "stage1_tokens", "beam_width", "seed")}
        if args.concurrency:
            kw["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
        result = measure_two_calls_over_http(args.model, **kw)
        return _report(args, format_two_calls(result), result)

    if args.serve_routers:
        from tools.bench.serve_routers import format_serve_routers, measure_serve_routers

        kw = {"routers": tuple(int(x) for x in args.serve_routers.split(",")),
              **({"requests": args.requests} if args.requests else {}),
              **({"concurrency": int(args.concurrency)} if args.concurrency else {}),
              **_given(args, "prompt_tokens", "stage1_tokens", "beam_width", "seed")}
        result = measure_serve_routers(args.model, **kw)
        return _report(args, format_serve_routers(result), result)

    if args.hosts_link:
        from tools.bench.hosts import (
            format_first_handoff,
            format_link,
            measure_first_handoff,
            measure_link,
        )

        result = measure_link()
        print(format_link(result))
        result["first_handoff"] = measure_first_handoff(args.model, Path("out") / "bench-hosts")
        return _report(args, format_first_handoff(result["first_handoff"]), result)

    if args.serve_scale:
        from tools.bench.serve_scale import format_serve_scale, plot_serve_scale, run_serve_scale

        result = run_serve_scale(drain=not args.no_drain)
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot_serve_scale(result, args.plot)
        _report(args, format_serve_scale(result), result)
        return 0 if not result["num_lost"] and not result["num_recomputed"] else 1

    if args.search_moves:
        from tools.bench.search_moves import format_search_moves, run_search_moves

        result = asyncio.run(run_search_moves(args.model))
        _report(args, format_search_moves(result), result)
        return 0 if result["identical"] else 1

    if args.moves:
        from tools.bench.moves import format_moves, measure_moves

        result = measure_moves(args.model, drain_requests=args.requests or 8,
                               **_given(args, "seed"))
        return _report(args, format_moves(result), result)

    if args.read:
        from tools.bench.read import format_read, run_read

        sweep = tuple(int(x) for x in args.sweep.split(",")) if args.sweep else (1024, 2048, 4096)
        result = asyncio.run(run_read(
            BenchConfig(model=args.model or "bench", **_given(args, "seed")), sweep,
            progress=lambda label: print(label, flush=True)))
        return _report(args, format_read(result), result)

    if args.beams and args.concurrency:
        return _run_beams_concurrency(args)

    if args.e2e:
        return _run_e2e(args)

    if args.beams:
        from tools.bench.beams import WIDTHS, format_beams, run_beams

        widths = tuple(int(x) for x in args.widths.split(",")) if args.widths else WIDTHS
        result = asyncio.run(run_beams(
            BenchConfig(model=args.model or "bench",
                        **_given(args, "prompt_tokens", "stage1_tokens", "seed")),
            widths, progress=lambda label: print(label, flush=True)))
        return _report(args, format_beams(result), result)

    if args.chunks:
        return _report(args, *_run_chunks(args))

    if args.fleet:
        from tools.bench.fleet import FleetConfig, format_fleet, plot_fleet, run_fleet

        kw = {"users": args.requests} if args.requests else {}
        if args.concurrency:
            kw["concurrency"] = int(args.concurrency)
        if args.seed is not None:
            kw["seed"] = args.seed
        result = run_fleet(args.model, FleetConfig(**kw))
        print(format_fleet(result))
        _write_json(args.json, result)
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
            plot_fleet(result, args.plot)
        return 0 if not result["identity_differences"] else 1

    if args.router_only:
        result = {"router_cluster": measure_router_overhead_on_cluster(
            args.model, args.requests or 12)}
        return _report(args, json.dumps(result, indent=1), result)

    kw: dict[str, Any] = {"model": args.model or "bench", **_given(
        args, "prompt_tokens", "stage1_tokens", "beam_width", "beam_tokens", "requests",
        "seed")}
    if args.concurrency:
        kw["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
    if args.sweep:
        kw["sweep"] = tuple(int(x) for x in args.sweep.split(","))
    cfg = BenchConfig.quick(**kw) if args.quick else BenchConfig(**kw)
    levels = sum(1 for c in cfg.concurrency if c > 1)
    steps = (1 + cfg.requests * len(MODES) + levels * len(cfg.concurrent_modes)
             + len(cfg.floor_widths) * len(cfg.floor_tokens) + len(cfg.sweep)
             + bool(cfg.idle_s) + cfg.router_requests + 1)
    with tqdm(total=steps, desc="bench", unit="step") as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        def checkpoint(partial: dict[str, Any]) -> None:
            # After every phase: what is measured so far, marked partial.
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({**partial, "partial": True}, indent=1))

        result = asyncio.run(run_bench(cfg, progress, checkpoint=checkpoint))
    print(format_report(result))
    _write_json(args.json, result)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    return 0

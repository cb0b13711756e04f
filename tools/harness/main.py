"""``kvhandoff verify``: the harness (``tools.harness.run``) on P, D and a second P
started in this process, on one host or, with ``--hosts netns``, P's and D's processes
on two network hosts (then every READ must go by a network transport). Prints the table;
exits 0 only when every case passes and the pools are clean."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from connector.faults import FAULTS
from kvhandoff.budget import blocks_needed
from kvhandoff.model import DTYPE_BYTES, kv_bytes_per_block, model_dtype, resolve_model
from tools.harness.cases import adapter_cases, default_cases
from tools.harness.report import CaseReport, HarnessReport, format_table, result_text, write_json
from tools.harness.run import Harness
from tools.local import local_pair
from tools.ucx_report import read_transports_in

#: D's pool for ``kvhandoff verify``, in blocks: 128 usable plus vLLM's null block, so the
#: ``fill-d-pool`` case can fill it within a 4096-token context.
VERIFY_D_POOL_BLOCKS = 129


def d_pool_blocks(beam_width: int | None) -> int:
    """D's pool in blocks: what the longest stage 2 in a 4096-token context needs at
    ``beam_width`` (the fill case's), plus vLLM's null block; 129 at the cases' own."""
    if beam_width is None:
        return VERIFY_D_POOL_BLOCKS
    return 1 + blocks_needed(4096 - 8, 32, beam_width, 3, beam_fork=True)


def pair_settings(model_dir: Path, beam_width: int | None = None) -> dict[str, Any]:
    """``local_pair`` settings for the harness on ``model_dir``: the model runs in the
    dtype it was saved in (bf16 models in bf16, as on GPUs), and D's pool holds
    ``d_pool_blocks(beam_width)`` of its blocks in that dtype."""
    dtype = model_dtype(model_dir)
    d_pool = d_pool_blocks(beam_width) * kv_bytes_per_block(
        model_dir, block_size=32, dtype_bytes=DTYPE_BYTES[dtype])
    return {"dtype": dtype, "decode_overrides": {"kv_cache_memory_bytes": d_pool}}


async def verify(model: str | None, *, quick: bool, json_path: str | None,
                 lease_s: int = 30, inject: str | None = None,
                 on_hosts: dict[str, Any] | None = None,
                 ucx_log_dir: Path = Path("out/verify-logs"),
                 beam_width: int | None = None, adapters: bool = False) -> HarnessReport:
    """Start P, D and a second P on ``model``, run the harness (with ``inject``: every
    handoff carries that fault, and no second P), shut them down. ``on_hosts`` (tools.netns
    hosts ``p`` and ``d``): the Ps' processes on one host, D's on the other; the report
    then names the transports UCX chose for the READs, which must be network ones.
    ``beam_width``: every case at that width. ``adapters``: the adapter cases, on
    engines that serve the built-in adapters a and b (no second P)."""

    if on_hosts:
        for old in ucx_log_dir.glob("*.ucx.log"):
            old.unlink()
    model_dir = resolve_model(model)
    served = builtin_adapters(model_dir) if adapters else ()
    async with local_pair(model, lease_s=lease_s, fault_injection=inject is not None,
                          **pair_settings(model_dir, beam_width), adapters=served,
                          second_prefill=inject is None and not adapters, on_hosts=on_hosts,
                          ucx_log_dir=ucx_log_dir if on_hosts else None) as pair:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids, p2=pair.p2)
        cases = (adapter_cases() if adapters else
                 default_cases(quick, via_p=pair.p2 is not None, beam_width=beam_width))

        def progress(c: CaseReport) -> None:
            print(f"  [{len(done) + 1}/{len(cases)}] {c.name}: {result_text(c)}", flush=True)
            done.append(c)

        done: list[CaseReport] = []
        report = await harness.run(cases, model_dir=str(pair.model_dir), progress=progress,
                                   fault=inject)
    if on_hosts:
        # D reads from P (a handoff, a move to D); the second P reads from P (a move).
        report.hosts = {"p": on_hosts["p"].address, "d": on_hosts["d"].address}
        report.read_transports = sorted(read_transports_in(sorted(
            ucx_log_dir.glob("*.ucx.log"))))
    if json_path:
        write_json(report, json_path)
    return report


def builtin_adapters(model_dir: Path) -> tuple[tuple[str, str], ...]:
    """The adapters the adapter cases name: a and b, built-in (seeds 1 and 2)."""
    from kvhandoff.builtin.adapters import builtin_adapter

    return tuple((name, str(builtin_adapter(model_dir, seed)))
                 for name, seed in (("a", 1), ("b", 2)))


def main_verify(model: str | None, quick: bool, json_path: str | None,
                inject: str | None = None, hosts: str | None = None,
                beam_width: int | None = None, adapters: bool = False) -> int:
    """``kvhandoff verify``'s flags: run it, print the table; 0 when it passed, else 1.
    ``hosts``: None (one host) or ``"netns"``."""
    if inject is not None and inject not in FAULTS:
        raise SystemExit(f"--inject {inject!r}: not a fault; choose from {', '.join(FAULTS)}")
    where: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(None)
    if hosts == "netns":
        from tools.netns import can_create
        from tools.netns import hosts as make_hosts

        why = can_create()
        if why:
            raise SystemExit(f"kvhandoff verify --hosts netns: cannot make the hosts here: "
                             f"{why}")
        where = make_hosts(("p", "d"))
    with where as on_hosts:
        report = asyncio.run(verify(model, quick=quick, json_path=json_path, inject=inject,
                                    on_hosts=on_hosts, beam_width=beam_width,
                                    adapters=adapters))
    print(format_table(report))
    return 0 if report.ok else 1

"""The probe's two processes, its report and its command line (``python3 -m
tools.gpu_probe``; the package's docstring says what it measures)."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing as mp
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from connector.runs import MERGE_FAULTS
from tools.gpu_probe.agents import install_wheels, owner
from tools.gpu_probe.machine import device_info
from tools.gpu_probe.pools import LAYER_OUTER, LAYOUTS, LLAMA3_8B, MODES, Geometry
from tools.gpu_probe.reader import Reader

#: The modes whose rate is set against one descriptor's (``ratios``), and how the table
#: names them.
_COMPARED = {"vllm_descs": "vLLM's descriptors", "runs": "runs",
             "runs_blocks_outer": "runs, blocks outer"}


def _read(geo: Geometry, device: str, flat_bytes: int, described: dict[str, Any],
          tokens: list[int], repeats: int, modes: list[str], merge_fault: str | None,
          report: dict[str, Any], out: Path, env: dict[str, str]) -> None:
    """D's process: every mode of ``modes`` at every length of ``tokens``, then the
    baselines, the report written after each; an error is recorded in it (``error``)
    and raised."""
    os.environ.update(env)
    report["reader_pid"] = os.getpid()  # whose UCX log holds the READs' tables
    _write(report, out)
    try:
        reader = Reader(geo, device, flat_bytes, described, [MODES[m] for m in modes], seed=0)
        try:
            for n in tokens:
                row: dict[str, Any] = {"tokens": n, "blocks": geo.blocks_for(n)}
                report["rows"].append(row)
                if "vllm_descs" in modes:
                    row["vllm_descs"] = reader.vllm_descs(n, repeats)
                    _write(report, out)
                for mode in ("runs", "runs_blocks_outer"):
                    if mode in modes:
                        row[mode] = reader.runs(n, repeats, MODES[mode], merge_fault)
                        _write(report, out)
                row["one_desc"] = reader.one_desc(
                    geo.blocks_for(n) * geo.layers * geo.page_bytes, repeats)
                row["copy"] = reader.copies(n, repeats)
                row["nixl_backend"] = reader.backend
                row["ratios"] = ratios(row)
                _write(report, out)
        finally:
            reader.close()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        _write(report, out)
        raise


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """Each measured mode's best rate over one descriptor's (``<mode>_vs_one_desc``), and
    vLLM's over the contiguous copy's (``vllm_descs_vs_copy``)."""
    one = row["one_desc"]["best_gbps"]
    out = {f"{mode}_vs_one_desc": round(row[mode]["best_gbps"] / one, 4)
           for mode in _COMPARED if mode in row}
    if "vllm_descs" in row:
        out["vllm_descs_vs_copy"] = round(
            row["vllm_descs"]["best_gbps"] / row["copy"]["contiguous"]["best_gbps"], 4)
    return out


def _write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(report, indent=1))


def run(device: str, tokens: list[int], geo: Geometry, repeats: int, out: Path,
        fault: int = 0, ucx_tls: str | None = None, modes: list[str] | None = None,
        merge_fault: str | None = None) -> dict[str, Any]:
    """Owner in a child process, reader in another; returns the report (also written to
    ``out``/probe.json). ``modes``: among :data:`MODES` (default all); ``fault``
    shifts P's pattern, ``merge_fault`` (``connector.runs.MERGE_FAULTS``) is passed to
    the runs modes' merge. Raises RuntimeError if a READ fails, hangs or moves the
    wrong bytes."""
    from tools.ucx_report import read_transports_in, ucx_env

    modes = list(MODES) if modes is None else modes
    unknown = set(modes) - set(MODES)
    if unknown or (merge_fault is not None and merge_fault not in MERGE_FAULTS):
        raise ValueError(f"unknown modes {sorted(unknown)} or merge fault {merge_fault!r}")
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("ucx.*.log"):
        old.unlink()
    env = {**ucx_env(str(out / "ucx.%p.log")), **({"UCX_TLS": ucx_tls} if ucx_tls else {})}
    flat_bytes = geo.blocks_for(max(tokens)) * geo.layers * geo.page_bytes
    layouts = list(dict.fromkeys([LAYER_OUTER, *(MODES[m] for m in modes)]))
    report: dict[str, Any] = {
        "geometry": {**asdict(geo), "page_bytes": geo.page_bytes,
                     "layout": LAYOUTS[LAYER_OUTER], "layouts": LAYOUTS},
        "repeats": repeats, "fault": fault, "modes": modes, "merge_fault": merge_fault,
        "ucx_env": {k: v for k, v in sorted({**os.environ, **env}.items())
                    if k.startswith("UCX_") and k not in ("UCX_LOG_FILE", "UCX_PROTO_INFO")},
        "info": device_info(device), "rows": []}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=owner, args=(geo, device, layouts, flat_bytes, fault, child, env),
                    daemon=True)
    p.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the owner did not publish its pool within 300 s")
        described = parent.recv()
        reader = ctx.Process(target=_read, daemon=True,
                             args=(geo, device, flat_bytes, described, tokens, repeats,
                                   modes, merge_fault, report, out, env))
        reader.start()
        reader.join()
        if reader.exitcode != 0:
            done = json.loads((out / "probe.json").read_text()) if (
                out / "probe.json").exists() else report
            raise RuntimeError(f"the reader failed (exit {reader.exitcode}): "
                               f"{done.get('error', '?')}; measured: "
                               f"{[r['tokens'] for r in done['rows'] if 'copy' in r]}")
    finally:
        parent.send("stop")
        p.join(30)
        if p.is_alive():
            p.kill()
    report = json.loads((out / "probe.json").read_text())
    logs = sorted(out.glob("ucx.*.log"))
    report["read_transports"] = sorted(read_transports_in(
        [log for log in logs if log.name == f"ucx.{report['reader_pid']}.log"]))
    _write(report, out)
    return report


def format_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table (GB/s, best of the repeats; "-" where a mode was
    not run)."""
    def cell(row: dict[str, Any], mode: str, key: str) -> str:
        return str(row[mode][key]) if mode in row else "-"

    def ratio(row: dict[str, Any], key: str) -> str:
        value = ratios(row).get(key)
        return "-" if value is None else f"{value:.2f}"

    modes = list(_COMPARED)
    names = list(_COMPARED.values())
    header = ([f"descriptors: {' / '.join(names)}"]
              + [f"NIXL READ, {name} (GB/s)" for name in names]
              + ["NIXL READ, 1 descriptor", "runs / 1 descriptor",
                 "runs, blocks outer / 1 descriptor", "copy in one process, contiguous",
                 "copy, same blocks", "vLLM's READ / contiguous copy"])
    lines = ["| parent tokens | MiB | " + " | ".join(header) + " |",
             "|" + "---|" * (len(header) + 2)]
    for row in report["rows"]:
        one, copy = row["one_desc"], row["copy"]
        lines.append(
            f"| {row['tokens']} | {one['bytes'] / 2**20:.0f} "
            f"| {' / '.join(cell(row, m, 'descriptors') for m in modes)} "
            f"| {' | '.join(cell(row, m, 'best_gbps') for m in modes)} "
            f"| {one['best_gbps']} | {ratio(row, 'runs_vs_one_desc')} "
            f"| {ratio(row, 'runs_blocks_outer_vs_one_desc')} "
            f"| {copy['contiguous']['best_gbps']} | {copy['blocks']['best_gbps']} "
            f"| {ratio(row, 'vllm_descs_vs_copy')} |")
    lines.append(f"UCX transports of the READs: {', '.join(report['read_transports']) or '?'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    doc = importlib.import_module(__package__ or "tools.gpu_probe").__doc__ or ""
    p = argparse.ArgumentParser(prog="python3 -m tools.gpu_probe",
                                description=doc.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", default="1024,4096,16384",
                   help="parent lengths, comma-separated")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"READ modes, comma-separated, among {', '.join(MODES)} "
                        "(1 descriptor and the copies always run)")
    p.add_argument("--layers", type=int, default=LLAMA3_8B["layers"])
    p.add_argument("--kv-heads", type=int, default=LLAMA3_8B["kv_heads"])
    p.add_argument("--head-dim", type=int, default=LLAMA3_8B["head_dim"])
    p.add_argument("--block", type=int, default=LLAMA3_8B["block"])
    p.add_argument("--pool-blocks", type=int, default=0,
                   help="blocks per layer in each pool (default: 1.5 x the longest parent)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for both processes")
    p.add_argument("--fault", type=int, default=0,
                   help="offset P's byte pattern: the READ check must fail")
    p.add_argument("--merge-fault", choices=sorted(MERGE_FAULTS), default=None,
                   help="a wrong merge in the runs modes: the READ check must fail")
    p.add_argument("--wheels", type=Path, default=None,
                   help="install the NIXL wheels in this folder first")
    p.add_argument("--out", type=Path, default=Path("out/gpu-probe"))
    args = p.parse_args(argv)
    if args.wheels is not None:
        site = install_wheels(args.wheels)
        sys.path.insert(0, site)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site, os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    tokens = [int(t) for t in args.tokens.split(",")]
    pool = args.pool_blocks or math.ceil(1.5 * math.ceil(max(tokens) / args.block))
    geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.block,
                   LLAMA3_8B["dtype_bytes"], pool)
    report = run(args.device, tokens, geo, args.repeats, args.out, args.fault, args.ucx_tls,
                 [m for m in args.modes.split(",") if m], args.merge_fault)
    print(format_table(report))
    return 0

"""The product's checks on a GPU host, as one prepared run (issue 45): ``scripts/gpu-host``
installs the bundle, then runs this.

Each step is a command of this repo run as its own process under a time limit; a step
that fails or times out is recorded (exit code, the tail of its output) and the next
still runs, so one short lease returns as much as it can. ``summary.json`` in the out
folder is rewritten after every step; the steps' own JSON reports lie beside it. The
host returns at most 8 files, so each step writes at most one.

``--rehearse``: the same steps at CPU sizes on this machine (``tests/test_gpu_host.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TAIL_CHARS = 3000


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    #: Seconds before the step is killed (its process group: engines included).
    limit_s: int
    #: The JSON report the step writes, if any, and the name it is copied to in the out
    #: folder (the host returns the out folder, at most 8 files).
    report: Path | None = None
    report_as: str | None = None


_DEVICE = """
import json, sys
info = {"python": sys.version.split()[0]}
import torch
info.update(torch=torch.__version__, cuda=torch.version.cuda,
            cuda_available=torch.cuda.is_available())
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    info.update(device=torch.cuda.get_device_name(0), free_gib=round(free / 2**30, 1),
                total_gib=round(total / 2**30, 1))
import vllm
from vllm.platforms import current_platform
info.update(vllm=vllm.__version__, platform=type(current_platform).__name__)
import nixl._api
import transformers
info.update(transformers=transformers.__version__)
print(json.dumps(info))
"""


def steps(work: Path, rehearse: bool) -> list[Step]:
    """The run, cheapest and most telling first. On the host: the raw READ probe on a
    Llama-3-8B shape, then the harness's quick set, then the quick bench, each at GPU
    sizes; rehearsed: the same commands at CPU sizes."""
    py = sys.executable
    cli = (py, "-m", "cli.main")
    probe_tokens = "64,128" if rehearse else "1024,4096,16384"
    probe_shape = ("--layers", "2", "--kv-heads", "2", "--head-dim", "16") if rehearse else ()
    return [
        Step("device", (py, "-c", _DEVICE), 300),
        Step("probe", (py, "-m", "tools.gpu_probe", "--device", "cpu" if rehearse else "cuda",
                       "--tokens", probe_tokens, *probe_shape, "--repeats", "3", "--out",
                       str(work / "probe")), 300, work / "probe" / "probe.json", "probe.json"),
        Step("verify", (*cli, "verify", "--quick", "--json", str(work / "verify.json")),
             900 if rehearse else 420, work / "verify.json", "verify.json"),
        Step("bench", (*cli, "bench", "--quick", "--json", str(work / "bench.json")),
             900 if rehearse else 420, work / "bench.json", "bench.json"),
    ]


def run_step(step: Step, out: Path) -> dict[str, Any]:
    """Runs one step in a process group of its own, so a timeout kills its engines too."""
    if step.report:
        step.report.unlink(missing_ok=True)  # an earlier run's is not this one's
    t0 = time.monotonic()
    proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=step.limit_s)
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        text, _ = proc.communicate()
        code = "timeout"
    result: dict[str, Any] = {"step": step.name, "exit": code,
                              "seconds": round(time.monotonic() - t0, 1),
                              "tail": (text or "")[-TAIL_CHARS:]}
    if step.report and step.report_as and step.report.is_file():
        shutil.copyfile(step.report, out / step.report_as)
        result["report"] = step.report_as
    if step.name == "device" and code == 0:
        result["info"] = json.loads(text.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tools.gpu_host", description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvh-gpu-host"),
                        help="where the steps write their logs and reports")
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--steps", default=None,
                        help="comma-separated names to run (default: all, in order)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    chosen = steps(args.work, args.rehearse)
    if args.steps:
        names = args.steps.split(",")
        unknown = set(names) - {s.name for s in chosen}
        if unknown:
            parser.error(f"unknown steps {sorted(unknown)}; known: "
                         f"{', '.join(s.name for s in chosen)}")
        chosen = [s for s in chosen if s.name in names]
    summary: dict[str, Any] = {"rehearse": args.rehearse, "steps": []}
    for step in chosen:
        print(f"gpu-host: {step.name} (limit {step.limit_s} s)", flush=True)
        result = run_step(step, args.out)
        summary["steps"].append(result)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"gpu-host: {step.name}: exit {result['exit']} in {result['seconds']} s",
              flush=True)
    return 0 if all(r["exit"] == 0 for r in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())

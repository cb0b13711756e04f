"""The GPU host's prepared run (scripts/gpu-host, tools/gpu_host.py), rehearsed here: the
same command with ``--rehearse`` runs its steps at CPU sizes from .venv and writes the
summary the host returns; a step that fails or hangs is recorded and the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.gpu_host import Step, run_step

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def test_host_command_fits_one_device_call() -> None:
    """The device tool takes commands of at most 2000 characters; the host's is this."""
    command = "bash scripts/gpu-host $OUT"
    assert len(command) < 2000
    assert (ROOT / "scripts" / "gpu-host").stat().st_mode & 0o111


@pytest.mark.timeout(300)
def test_rehearsal_device_and_probe(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([str(ROOT / "scripts" / "gpu-host"), str(out), "--rehearse",
                           "--work", str(tmp_path / "work"), "--steps", "device,probe"],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["device", "probe"]
    info = summary["steps"][0]["info"]
    assert info["vllm"] == "0.32.0" and info["platform"] == "CpuPlatform"
    probe = json.loads((out / "probe.json").read_text())
    assert probe["rows"] and all("one_desc" in row for row in probe["rows"])
    assert sorted(p.name for p in out.iterdir()) == ["probe.json", "summary.json"]


def test_failed_and_hung_steps_are_recorded(tmp_path: Path) -> None:
    failed = run_step(Step("fails", (sys.executable, "-c", "print('boom'); raise SystemExit(3)"),
                           30), tmp_path)
    assert failed["exit"] == 3 and "boom" in failed["tail"]
    # A hung step is killed with its whole process group (a child it started too).
    marker = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(60)']); open({str(marker)!r}, 'w').write(str(c.pid)); "
            "time.sleep(60)")
    t0 = time.monotonic()
    hung = run_step(Step("hangs", (sys.executable, "-c", code), 3), tmp_path)
    assert hung["exit"] == "timeout" and time.monotonic() - t0 < 20
    child = int(marker.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(
        f"/proc/{child}/stat").read_text().split()[2]

"""deploy/README.md's "Minimal run (one machine, CPU)", run as written: its shell commands
from the repo root, then its Python snippet from another process, on this 2-core
machine. (tests/test_ray_serve.py tests the application itself on a Ray instance it
starts; this one tests the documented way in.)"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils import in_this_netns

pytestmark = [pytest.mark.ray, pytest.mark.engines, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]


def _minimal_run() -> tuple[list[str], str]:
    """The section's shell commands (comments dropped) and its Python snippet."""
    readme = (ROOT / "deploy" / "README.md").read_text()
    section = readme.split("## Minimal run (one machine, CPU)", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)[1]
    commands = [line.split("#", 1)[0].strip() for line in bash.splitlines()]
    return [c for c in commands if c], re.search(r"```python\n(.*?)```", section, re.S)[1]


def _ctrl_c_works() -> None:
    """In ``serve run``'s process: SIGINT as in a terminal (a job started in the
    background of a non-interactive shell inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ray_processes(since: float) -> list:
    import psutil

    found = []
    for proc in psutil.process_iter(["name", "cmdline", "create_time"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["create_time"] >= since and (
                "raylet" in cmd or "gcs_server" in cmd or cmd.startswith("ray::")
                or "serve run" in cmd) and in_this_netns(proc.pid):
            found.append(proc)
    return found


def test_the_documented_minimal_run_comes_up_and_answers(tmp_path):
    commands, snippet = _minimal_run()
    assert commands == ["scripts/setup-venv", ".venv/bin/serve run deploy/config-cpu.yaml"]
    t0 = time.time()
    subprocess.run(shlex.split(commands[0]), cwd=ROOT, check=True, timeout=900)
    log_path = tmp_path / "serve-run.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(shlex.split(commands[1]), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_ctrl_c_works)

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + 420
        while True:
            out = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT,
                                 capture_output=True, text=True, timeout=180)
            if out.returncode == 0:
                break
            assert proc.poll() is None, f"serve run exited {proc.returncode}:\n{log_tail()}"
            assert time.monotonic() < deadline, (
                f"no answer after 420 s; the snippet said:\n{out.stderr[-1500:]}\n"
                f"serve run's log:\n{log_tail()}")
            time.sleep(5)
        # The snippet prints the best beam's token ids and the tokens D imported.
        beams, imported = out.stdout.strip().rsplit(" ", 1)
        assert beams.startswith("[") and int(imported) > 0, out.stdout
        assert "taken more than 30s to be scheduled" not in log_tail()
    finally:
        _stop(proc, t0)


def _stop(proc: subprocess.Popen, since: float) -> None:
    """Ctrl-C ``serve run`` (it shuts Serve and its Ray down), SIGKILL if it hangs; no Ray
    process started since ``since`` may outlive it."""
    for sig, wait_s in ((signal.SIGINT, 90), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            break
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 60
    while _ray_processes(since) and time.monotonic() < deadline:
        time.sleep(1)
    left = _ray_processes(since)
    for p in left:
        p.kill()
    assert not left, f"processes outlived serve run: {[p.info['cmdline'][:3] for p in left]}"


def test_a_config_the_machine_cannot_hold_is_refused_with_the_numbers(tmp_path):
    """The negative control: the CPU config with its earlier asks (1 + 1 + 0.5 CPUs, which
    made Serve wait forever for a replica on 2 cores) through the same `serve run`: the
    application is refused with what it needs and what the cluster has."""
    import yaml

    cfg = yaml.safe_load((ROOT / "deploy" / "config-cpu.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["prefill"]["num_cpus"] = args["decode"]["num_cpus"] = 1
    args["router"]["num_cpus"] = 0.5
    config = tmp_path / "config-too-big.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cpus = os.cpu_count()
    if cpus is None or cpus >= 2.5:
        pytest.skip(f"this machine has {cpus} CPUs: 2.5 fit")
    t0 = time.time()
    log_path = tmp_path / "serve-run.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([".venv/bin/serve", "run", str(config)], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_ctrl_c_works)
    try:
        deadline = time.monotonic() + 180
        want = "the application needs 2.5 CPUs"
        while want not in log_path.read_text(errors="replace"):
            assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
            time.sleep(2)
        assert f"the Ray cluster has {cpus:g}" in log_path.read_text(errors="replace")
    finally:
        _stop(proc, t0)

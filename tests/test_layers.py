"""The house's rules, checked by the suite: the import layers and the router's weight
(``pyproject.toml``'s import-linter contracts), and a clean ``ruff check``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_imports_follow_the_layers():
    proc = _run(str(BIN / "lint-imports"), "--no-cache")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_importing_the_router_loads_no_engine():
    code = ("import sys, router.core, router.service, router.metrics, tools.client; "
            "heavy = sorted(m for m in ('vllm', 'torch', 'ray', 'nixl') if m in sys.modules); "
            "print(heavy); sys.exit(1 if heavy else 0)")
    proc = _run(sys.executable, "-c", code)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_ruff_is_clean():
    proc = _run(str(BIN / "ruff"), "check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout[-4000:]

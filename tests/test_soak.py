"""The soak (``kvhandoff soak``): its verdict, with the faults it must catch (in CI), and a
short real soak under the ``soak`` marker (not in CI; ``pytest -m soak`` runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.soak import verdict


def _minutes(rss: list[float], errors: list[list[str]] | None = None) -> list[dict]:
    errors = errors or [[] for _ in rss]
    return [{"minute": i + 1, "rss_mib": {"prefill": r, "decode": 2000.0, "router": 400.0},
             "errors": e} for i, (r, e) in enumerate(zip(rss, errors))]


def test_the_verdict_passes_a_flat_soak_and_catches_growth_errors_and_dirty_pools():
    flat = _minutes([2100, 2150, 2160, 2170])
    assert verdict(flat, 2, pools_clean=True)["ok"]
    # Growth before the baseline minute is warm-up, not a leak.
    assert verdict(_minutes([1000, 2150, 2160, 2200]), 2, pools_clean=True)["ok"]
    leak = verdict(_minutes([2100, 2150, 2200, 2300]), 2, pools_clean=True)
    assert not leak["ok"] and "prefill RSS grew +7.0%" in leak["problems"][0]
    dirty = verdict(flat, 2, pools_clean=False)
    assert not dirty["ok"] and "pool" in dirty["problems"][0]
    failed = verdict(_minutes([2100] * 3, [[], ["soak-unary-7: error: UNAVAILABLE x"], []]), 2,
                     pools_clean=True)
    assert not failed["ok"] and failed["unintended_errors"] == 1


@pytest.mark.engines
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_short_soak_passes(tmp_path, model_dir):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.cli", "soak", "--model", model_dir, "--minutes", "4",
         "--interval-s", "30", "--baseline-minutes", "2", "--json", str(out),
         "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, timeout=800)
    print(proc.stdout)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    assert result["verdict"]["ok"] and result["pools_clean"]
    kinds = {k.split(":")[0] for m in result["minutes"] for k in m["outcomes"]}
    assert kinds == {"unary", "stream", "cancel", "deadline", "bad"}, kinds

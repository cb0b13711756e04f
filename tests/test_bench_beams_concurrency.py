"""``kvhandoff bench --beams --concurrency``: the grid on the shared real P+D pair (built-in
model, W=4, C in 1,2, T=3): every row's figures and identical beams; and the command's
exit status when a row's beams differ (the measurement faked)."""

from __future__ import annotations

import json

import pytest

from cli.main import build_parser
from tools.bench import main as bench_main
from tools.bench.beams_concurrency import (
    BeamsConcurrencyResult,
    format_beams_concurrency,
    run_beams_concurrency,
)
from tools.bench.types import BenchConfig


@pytest.mark.engines
@pytest.mark.beams
def test_the_grid_runs_ours_vllms_and_the_floor_at_concurrency(pair, run, assert_pools_clean):
    cfg = BenchConfig(model=None, prompt_tokens=40, stage1_tokens=8)
    result = run(run_beams_concurrency(cfg, widths=(4,), concurrency=(1, 2), tokens=3,
                                       pair=pair), timeout=300).as_dict()
    assert [(r["beam_width"], r["concurrency"]) for r in result["rows"]] == [(4, 1), (4, 2)]
    assert result["skipped"] == [] and result["identical"]
    assert result["parents"] == 2 and result["parents_tokens_read_by_d"] > 0
    for row in result["rows"]:
        assert row["same_beams"]
        for kind in ("ours", "vllm"):
            assert row[f"{kind}_qps"] > 0 and len(row[f"{kind}_qps_runs"]) == 2
            assert row[f"{kind}_qps"] == max(row[f"{kind}_qps_runs"])
            assert 0 < row[f"{kind}_p50_ms"] <= row[f"{kind}_p99_ms"]
            assert row[f"{kind}_first_over_second"] > 0
        assert row["floor_qps"] > 0 and row["floor_decode_step_ms"] > 0
        assert row["ours_over_floor"] == round(row["floor_qps"] / row["ours_qps"], 2)
        assert row["ours_over_vllm"] == round(row["ours_qps"] / row["vllm_qps"], 2)
        assert row["slot_step_ms"] > 0 and row["select_ms_per_step_per_group"] is not None
        assert row["import_step_ms"] > 0
    text = format_beams_concurrency(result)
    assert "ours_over_floor" in text and "identical" in text
    json.dumps(result)  # the --json output is plain JSON
    assert_pools_clean()


def test_beams_that_differ_fail_the_command(monkeypatch, tmp_path, capsys):
    import tools.bench.beams_concurrency as bc

    row = {"beam_width": 4, "concurrency": 1, "same_beams": False}

    async def fake(cfg, widths, concurrency, **kw):
        assert (widths, concurrency) == ((4,), (1, 2))
        return BeamsConcurrencyResult({"model": "m"}, [row], [])

    monkeypatch.setattr(bc, "run_beams_concurrency", fake)
    out = tmp_path / "r.json"
    args = build_parser().parse_args(["bench", "--beams", "--concurrency", "1,2", "--widths",
                                      "4", "--json", str(out)])
    assert bench_main.main_bench(args) == 1
    assert "BEAMS DIFFER" in capsys.readouterr().out
    assert json.loads(out.read_text())["identical"] is False
    row["same_beams"] = True
    assert bench_main.main_bench(args) == 0

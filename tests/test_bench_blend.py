"""``kvhandoff bench --chunks approximate`` end to end on the built-in model, small: the
quality table (with its control, which must do worse) on a few prompts, and the speed
rows at one short context (a smoke test: the figures are the bench's to report)."""

from __future__ import annotations

import pytest

from tools.bench.blend import CONTROL, format_blend, run_blend_quality, run_blend_speed

pytestmark = [pytest.mark.engines, pytest.mark.chunks, pytest.mark.timeout(600)]


def test_the_blend_bench_measures_quality_by_share_and_its_control_does_worse(tmp_path):
    quality = run_blend_quality(prompts=3, log_dir=tmp_path, progress=lambda _: None)
    rows = {r["case"]: r for r in quality["rows"]}
    assert set(rows) == {"full", "0", "0.05", "0.15", "0.3", CONTROL}
    assert rows["full"]["agrees_with_full"] == 1.0
    assert rows["0"]["recomputed_share"] == 0.0 < rows["0.3"]["recomputed_share"] < 0.5
    # Keys moved, the ids follow the moved items; left at their old positions, they do
    # not (the built-in model's ids are a rule of the history).
    assert rows["0"]["agrees_with_full"] >= 2 / 3, rows
    assert rows[CONTROL]["agrees_with_full"] < rows["0"]["agrees_with_full"], rows
    speed = run_blend_speed("builtin", reps=1, contexts=(128,), log_dir=tmp_path,
                            progress=lambda _: None)
    (row,) = speed["rows"]
    assert row["share_0"]["blended_tokens"] == 128
    assert row["share_0.15"]["blended_tokens"] == 128 - 20  # ceil(0.15 * 128) computed
    assert "logprob gap" in format_blend(speed, quality)

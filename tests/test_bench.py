"""`kvhandoff bench` on the shared real P+D pair (tiny sizes): every mode measured, the
handoff's import step computes only the tail, and the report, JSON and plot come out."""

from __future__ import annotations

import json

import pytest

from tools.bench import BenchConfig, run_bench
from tools.bench_report import MODES, format_report, plot

pytestmark = [pytest.mark.engines]


def test_bench_measures_every_mode(pair, run, assert_pools_clean, tmp_path):
    cfg = BenchConfig(model=None, prompt_tokens=40, stage1_tokens=8, beam_width=4, beam_tokens=2,
                      requests=2, concurrency=(1, 2), rounds=1, sweep=(64, 200),
                      nixl_sizes_mib=(4,), router_requests=2)
    r = run(run_bench(cfg, pair=pair), timeout=900)
    for mode in MODES:
        m = r["modes"][mode]
        assert m["n"] == 2
        assert m["stage2_first_beam_ms_p50"] > 0 and m["stage2_total_ms_p50"] > 0
        assert m["computed_tokens_d_per_request"] > 0
    handoff = r["modes"]["handoff"]
    assert handoff["first_step_computes_only_suffix_plus_one"] == "2/2"
    assert handoff["beams_match_colocated"] == "2/2"
    # ... and vLLM's own beam search on the same continuation prompt agrees.
    assert handoff["beams_match_vllm_beam_search"] == "2/2"
    assert r["modes"]["colocated"]["beams_match_vllm_beam_search"] == "2/2"
    assert handoff["kv_bytes_per_request"] > 0 and handoff["transfer_gbps"] > 0
    # The round trip recomputes the whole re-tokenised prompt; the handoff does not.
    assert (r["modes"]["text_roundtrip"]["computed_tokens_d_per_request"]
            > handoff["computed_tokens_d_per_request"])
    assert {(row["mode"], row["concurrency"]) for row in r["concurrency"]} == \
        {(m, c) for m in MODES for c in (1, 2)}
    assert [row["parent_tokens"] for row in r["sweep"]] == [64, 200]
    assert all(row["transfer_ms"] and row["prefill_ms"] > 0 for row in r["sweep"])
    assert r["transfer"]["nixl_gbps"] > 0 and r["transfer"]["memcpy_gbps"] > 0
    # Through a real router process and as direct engine calls: same beams.
    ro = r["router"]
    assert ro["requests"] == 2 and ro["beams_match_direct"] == "2/2"
    assert 0 < ro["router_overhead_ms_p50"] < ro["end_to_end_ms_p50_router"]

    text = format_report(r)
    assert "handoff" in text and "raw NIXL READ" in text and "router overhead" in text
    plot(r, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    json.dumps(r)  # the --json output is plain JSON
    assert_pools_clean()

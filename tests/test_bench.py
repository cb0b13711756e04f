"""`kvhandoff bench` on the shared real P+D pair (tiny sizes): every mode measured, the
handoff's import step computes only the tail, and the report, JSON and plot come out."""

from __future__ import annotations

import json

import pytest

from tools.bench import MODES, BenchConfig, format_report, plot, run_bench

pytestmark = [pytest.mark.engines]


def test_bench_measures_every_mode(pair, run, assert_pools_clean, tmp_path):
    cfg = BenchConfig(model=None, prompt_tokens=40, stage1_tokens=8, beam_width=4, beam_tokens=2,
                      requests=2, concurrency=(1, 2), rounds=1, sweep=(64, 200),
                      floor_widths=(2, 4), floor_tokens=(3,), floor_repeats=1, idle_s=1.0,
                      sweep_repeats=1,
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
    # Cold: every handoff read its whole parent (checked per sample) in NIXL descriptors.
    assert handoff["d_cache"] == ["cold"] and handoff["descriptors_per_request"] >= 1
    warm = r["handoff_warm"]
    assert warm["n"] == 2 and warm["tokens_found_on_d_per_request"] >= 32
    assert warm["bytes_saved_per_request"] > 0
    assert warm["tokens_read_per_request"] < r["modes"]["handoff"]["parent_tokens_mean"] - 32
    # Caches emptied before each sample: P's stage 1 (all these modes run on P) finds
    # nothing of the prompt, though every mode ran the same prompt before.
    assert r["modes"]["handoff"]["prefix_cache_hit_rate_p"] == 0
    assert r["modes"]["text_roundtrip"]["prefix_cache_hit_rate_p"] == 0
    assert r["modes"]["colocated"]["prefix_cache_hit_rate_p"] > 0  # its beam steps
    # The round trip recomputes the whole re-tokenised prompt; the handoff does not.
    assert (r["modes"]["text_roundtrip"]["computed_tokens_d_per_request"]
            > handoff["computed_tokens_d_per_request"])
    assert {(row["mode"], row["concurrency"]) for row in r["concurrency"]} == \
        {(m, 1) for m in MODES} | {("colocated", 2), ("handoff", 2)}
    assert [(row["beam_width"], row["beam_tokens"]) for row in r["floor"]] == [(2, 3), (4, 3)]
    assert all(row["decode_step_ms"] > 0 and row["ratio"] > 0.5 for row in r["floor"])
    assert [row["parent_tokens"] for row in r["sweep"]] == [64, 200]
    assert all(row["transfer_ms"] and row["prefill_ms"] > 0 and row["descriptors"] >= 1
               and row["read_vs_raw"] > 0 and row["tail_forward_ms"] > 0
               and row["raw_same_descriptors_gbps"] > 0 for row in r["sweep"])
    idle = r["idle_cpu"]
    assert 0 <= idle["p_cpu_pct_holding_export"] <= idle["engines_cpu_pct_holding_export"]
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


def test_a_cold_handoff_that_found_the_prompt_on_d_fails_the_bench(pair, run, assert_pools_clean):
    """The negative control of the cold check: D's cache not emptied (injected), so the
    second "cold" import finds the prompt's blocks and reads less than the parent."""
    from tools.bench import Bench, BenchError, make_prompts

    bench = Bench(pair, BenchConfig(model=None, beam_width=2, beam_tokens=2))
    prompt = make_prompts(pair.tokenizer, 1, 80, 3)[0]
    run(bench.one("handoff", prompt, 1, stage1_tokens=4))  # a real cold one: passes

    async def not_emptied():
        return None

    bench.empty_caches = not_emptied
    with pytest.raises(BenchError, match="found [1-9]"):
        run(bench.one("handoff", prompt, 2, stage1_tokens=4))
    assert_pools_clean()

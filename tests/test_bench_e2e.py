"""``kvhandoff bench --e2e`` on the shared cluster (P, D, router as processes) and the
vLLM peer engine, at a tiny size: every router answer equals vLLM alone's (stage 1, then
vLLM's own ``beam_search`` as a new request), the rows are filled in; and its negative
control, a fault zeroing block 0 of each handoff's import, makes the bench report the
differences. The full-size run is by hand (docs/performance.md, "Two-stage requests at
concurrency through the router")."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tools.bench.e2e_concurrency import (
    E2EConfig,
    E2EResult,
    check_paths,
    format_e2e,
    run_router,
    run_vllm,
)

pytestmark = [pytest.mark.engines, pytest.mark.fault]

CFG = E2EConfig(concurrency=(1, 2), prompt_tokens=60, stage1_tokens=8, beam_width=4,
                beam_tokens=2, rounds=1, min_requests=2)


def _bench(cluster, vllm_peer, run, model_dir, cfg):
    from kvhandoff.model import ModelTokens

    engine, tokenizer, _ = vllm_peer
    rows, answers = run_router(cluster["router"], cfg, vocab=1000)
    vllm_rows, diffs, gaps = run(run_vllm(engine, tokenizer,
                                          ModelTokens.load(Path(model_dir)), cfg, answers),
                                 timeout=600)
    return rows, vllm_rows, diffs, gaps


def test_the_e2e_bench_answers_as_vllm_alone_and_its_control_differs(
        cluster, vllm_peer, run, model_dir):
    rows, vllm_rows, diffs, gaps = _bench(cluster, vllm_peer, run, model_dir, CFG)
    assert diffs == [] and check_paths(rows) == []
    assert [(r["path"], r["concurrency"], r["requests"]) for r in rows + vllm_rows] == [
        ("handoff", 1, 2), ("colocated", 1, 2), ("handoff", 2, 2), ("colocated", 2, 2),
        ("vllm_alone", 1, 2), ("vllm_alone", 2, 2)]
    assert all(r["qps"] > 0 and r["first_beam_ms_p99"] >= r["first_beam_ms_p50"] > 0
               for r in rows + vllm_rows)
    assert all(r["stage1_first_token_ms_p50"] for r in rows)
    settings = {"config": {**CFG.__dict__, "concurrency": list(CFG.concurrency)}}
    text = format_e2e(E2EResult(settings, rows + vllm_rows, diffs, gaps).as_dict())
    assert "identical to vLLM alone: yes" in text and "vllm_alone" in text
    # The control: the same requests with block 0 of every import zeroed on D.
    bad = dataclasses.replace(CFG, concurrency=(1,), fault="zero-block")
    _, _, diffs, _ = _bench(cluster, vllm_peer, run, model_dir, bad)
    assert diffs and all(d.startswith("handoff C=1") for d in diffs), diffs
    assert any("beams differ" in d or "logprobs differ" in d for d in diffs), diffs

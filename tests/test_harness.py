"""The handoff-correctness harness over every case, on real engines and NIXL."""

from __future__ import annotations

import json

import pytest

from kvhandoff.harness import Harness, default_cases, format_table, write_json

pytestmark = pytest.mark.engines


def test_every_case_is_token_identical_to_one_engine(pair, run, tmp_path):
    harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                      think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                      suffix_ids=pair.default_suffix_ids)
    cases = default_cases()
    report = run(harness.run(cases, model_dir=str(pair.model_dir)), timeout=900)
    print(format_table(report))

    # Every case: stage-1 tokens and beams identical, D computed exactly len(suffix)+1.
    assert [c.name for c in report.cases if not c.ok] == []
    endings = {c.stage1_finish_reason for c in report.cases}
    assert endings == {"stop", "length"}
    assert {c.beam["beam_width"] for c in report.cases} == {1, 4, 32}
    for c in report.cases:
        assert c.num_computed_tokens_d_first_step == len(c.suffix_token_ids) + 1
        assert c.num_imported_tokens == c.num_parent_tokens - 1
        assert c.num_bytes_moved > 0
    assert report.pools_clean, report.pool_details

    # The JSON report carries what a machine needs to re-check a case.
    path = tmp_path / "verify.json"
    write_json(report, path)
    data = json.loads(path.read_text())
    assert data["ok"] is True and data["block_size"] == 32
    case = data["cases"][0]
    for key in ("prompt_token_ids", "stage1_token_ids", "suffix_token_ids", "beam",
                "colocated_beams", "handoff_beams", "num_imported_tokens",
                "num_computed_tokens_d_first_step", "num_bytes_moved", "beams_identical"):
        assert key in case

"""``kvhandoff bench --fleet``'s parts that need no fleet: its workload (histories that
grow behind a shared prefix), its identity check (which must see a difference), and its
report. The bench itself starts two fleets of five processes: run by hand (figures in
docs/performance.md, "A fleet placed by its caches")."""

from __future__ import annotations

import copy

import pytest

from tools.bench.fleet import FleetConfig, format_fleet, identity, plot_fleet, workload

pytestmark = pytest.mark.fleet


def test_each_users_calls_extend_the_last_behind_one_shared_prefix():
    cfg = FleetConfig(users=3, calls=3, shared_tokens=64, history_tokens=40, growth_tokens=8)
    users = workload(cfg)
    shared = users[0][0][:64]
    for calls in users:
        assert [len(p) for p in calls] == [104, 112, 120]
        assert all(p[:64] == shared for p in calls)
        assert all(b[:len(a)] == a for a, b in zip(calls, calls[1:]))
    assert users[0][0][64:] != users[1][0][64:]  # histories are the users' own
    assert workload(cfg) == users  # the same requests for both placements


def _run(placement: str) -> dict:
    cont = {"width": 4, "decode": "d0", "recomputed": False, "bytes_read": 1024,
            "imported_tokens": 10, "found_on_d_tokens": 5, "first_beam_ms": 3.0,
            "beams": [([1, 2, 3], -1.25), ([1, 2, 4], -2.5)]}
    return {"placement": placement, "wall_s": 1.0, "calls_per_s": 2.0,
            "p_prefix_hit_rate": 0.5, "p_prefix_hit_tokens": 10, "p_prompt_tokens": 20,
            "stage1_first_token_ms_p50": 5.0, "stage1_ms_p50": 9.0,
            "stage2_first_beam_ms_p50": 3.0, "kv_bytes_read_per_continuation": 1024.0,
            "found_on_d_tokens_per_continuation": 5.0, "recomputed": 0,
            "placements": {"prefill_hit": 1.0},
            "calls": [{"id": "u0-c0", "thinking": [7, 8], "continuations": [cont]}]}


def test_the_identity_check_sees_every_kind_of_difference(tmp_path):
    runs = {"load": _run("load"), "cache": _run("cache")}
    assert identity(runs) == []
    for change, expect in ((lambda c: c["thinking"].append(9), "stage-1 tokens differ"),
                           (lambda c: c["continuations"][0]["beams"].reverse(),
                            "beams differ"),
                           (lambda c: c["continuations"][0].update(
                               beams=[([1, 2, 3], -1.25 + 1e-4), ([1, 2, 4], -2.5)]),
                            "cumulative logprobs differ")):
        other = copy.deepcopy(runs)
        change(other["cache"]["calls"][0])
        assert [expect in d for d in identity(other)] == [True], expect
    result = {"runs": runs, "identity_differences": []}
    text = format_fleet(result)
    assert "P prefix-hit rate" in text and "the same answers" in text
    plot_fleet(result, str(tmp_path / "fleet.png"))
    assert (tmp_path / "fleet.png").stat().st_size > 0

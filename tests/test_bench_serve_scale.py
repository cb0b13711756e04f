"""``kvhandoff bench --serve-scale``'s own run, shortened: the Serve application on a
local Ray instance, scaled by its P:D policy (``deploy.autoscale``) from the engines'
reports under one session begun a second, then back down once the sessions stop, with
every call served and no continuation recomputed (the replica Serve stops drains its
held parents first)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.engines]


def test_the_policy_scales_up_under_queue_and_back_down_losing_nothing():
    from tools.bench.serve_scale import format_serve_scale, run_serve_scale

    # 30 s of load: the second P is asked for within seconds (at 3 s alone, 2026-11-30);
    # 75 s idle: alone, the second P ran at 37 s and was stopped by 52 s.
    r = run_serve_scale(phases=((30, 1.0), (75, 0.0)))
    print(format_serve_scale(r))
    assert r["num_lost"] == 0 and r["num_recomputed"] == 0, r["failures"]
    assert r["num_continuations"] > 0
    # The policy asked for a second P under the load: a replica starting or running
    # beside the first. Whether it ran before the load ended is the machine's speed: in
    # a full suite on 2 cores (2026-11-29) it was asked for at 1 s and never ran in 135 s.
    asked = max(s.get("Prefill_RUNNING", 0) + s.get("Prefill_STARTING", 0)
                for s in r["timeline"])
    assert asked == 2, r["timeline"]
    # Back to one P once idle, none starting: a second that ran was stopped (drained of
    # its parents' leases first), one still starting was not kept.
    last = r["timeline"][-1]
    assert (last.get("Prefill_RUNNING", 0), last.get("Prefill_STARTING", 0)) == (1, 0), \
        r["timeline"][-5:]

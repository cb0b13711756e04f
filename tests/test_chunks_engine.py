"""A pinned hold on a real P (``Stage1Request.pin``: a named KV chunk's blocks): no lease
ends it, and a release by name prefix (what a router sends for its namespace when it
starts again) ends it and only the holds under that prefix."""

from __future__ import annotations

import math
import time

import pytest

from kvhandoff.types import Stage1Params
from prefill_engine.engine import PINNED

pytestmark = [pytest.mark.engines, pytest.mark.chunks]


def _used(pair) -> int:
    return pair.p.pool().num_used_blocks


def test_a_pinned_hold_outlives_the_lease_and_a_release_by_prefix_ends_only_its_own(
        pair, run, assert_pools_clean):
    from tests.conftest import LEASE_S

    params = Stage1Params(max_tokens=1, seed=0)
    before = _used(pair)
    mine = run(pair.p.run_stage1([11 + k % 900 for k in range(96)], params,
                                 "chunk-mine-0-sys", export=False, hold=PINNED))
    theirs = run(pair.p.run_stage1([17 + k % 900 for k in range(64)], params,
                                   "chunk-theirs-0-sys", export=False, hold=PINNED))
    # The control: a hold for a time (a parent's) does end, as the wait below shows.
    run(pair.p.run_stage1([23 + k % 900 for k in range(64)], params, "parent-held",
                          export=False, hold=3.0))
    assert math.isinf(mine.held_until) and math.isinf(theirs.held_until)
    pinned = 3 + 2
    assert _wait_used(pair, run, before + pinned + 2) == before + pinned + 2
    time.sleep(LEASE_S + 1)  # past P's lease, which no hold of a time outlives
    run(pair.p.run_stage1([5, 6, 7], params, "step", export=False))  # P steps: expiries
    assert _wait_used(pair, run, before + pinned) == before + pinned, \
        "a pinned hold ended with the lease, or the parent's hold did not end"
    run(pair.p.release([], ["chunk-mine-"]))
    assert _wait_used(pair, run, before + 2) == before + 2, \
        "the release by prefix ended another namespace's hold, or not its own"
    run(pair.p.release(["chunk-theirs-0-sys"]))
    assert_pools_clean()


def _wait_used(pair, run, expected: int, timeout_s: float = 10.0) -> int:
    """P's used blocks once they are ``expected`` (the engine's stats arrive on the
    session loop, which runs meanwhile), or as they are after ``timeout_s``."""
    import asyncio

    async def poll() -> int:
        deadline = time.monotonic() + timeout_s
        while _used(pair) != expected and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return _used(pair)

    return run(poll())

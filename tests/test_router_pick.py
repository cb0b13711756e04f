"""The router's choice of D, over fake engine stubs (no engines): capacity snapshots are
reused while fresh, the router's own picks are counted against them, stale ones are asked
again."""

from __future__ import annotations

import asyncio
import time

import pytest

from decode_engine.scheduler import blocks_needed
from kvhandoff.types import BeamParams, Stage1Params
from kvhandoff.v1 import common_pb2, engine_pb2


class FakeEngineStub:
    def __init__(self, num_free_blocks: int):
        self.num_free_blocks = num_free_blocks
        self.num_capacity_calls = 0

    async def GetCapacity(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        self.num_capacity_calls += 1
        return engine_pb2.Capacity(num_free_blocks=self.num_free_blocks, num_total_blocks=200,
                                   block_size=32, max_beam_width=32)


def _router(model_dir: str, free: list[int]):
    from router.core import Endpoint, Router, RouterConfig

    decode = [Endpoint(f"d{i}", FakeEngineStub(n), None) for i, n in enumerate(free)]
    config = RouterConfig(prefill=("p",), decode=tuple(ep.address for ep in decode),
                          model=model_dir, warm_up=False)
    return Router(config, endpoints=([Endpoint("p", FakeEngineStub(100), None)], decode))


def _plan(beam_width: int = 4):
    from router.core import Plan

    return Plan("r", [1] * 100, [2], Stage1Params(max_tokens=10),
                BeamParams(beam_width=beam_width, max_tokens=3), common_pb2.PATH_HANDOFF, None)


def test_fresh_snapshots_are_reused_and_picks_are_claimed(model_dir):
    router = _router(model_dir, [40, 30])
    need = blocks_needed(200, 32, 4, 3)
    picks = [asyncio.run(router._pick_decode(200, _plan())).address for _ in range(4)]
    # One GetCapacity per D for the whole burst; claims move the next pick to the D with
    # the most unclaimed blocks.
    assert [ep.stub.num_capacity_calls for ep in router.decode] == [1, 1]
    assert picks[0] == "d0"
    assert router.decode[0].num_claimed_blocks + router.decode[1].num_claimed_blocks == 4 * need
    assert set(picks) == {"d0", "d1"}


def test_stale_snapshots_and_failed_handoffs_ask_again(model_dir):
    router = _router(model_dir, [40])
    d = router.decode[0]
    asyncio.run(router._pick_decode(200, _plan()))
    d.capacity_at = time.monotonic() - router.config.capacity_max_age_s - 1
    d.stub.num_free_blocks = 7
    asyncio.run(router._pick_decode(200, _plan()))
    assert d.stub.num_capacity_calls == 2 and d.capacity.num_free_blocks == 7
    asyncio.run(router._pick_decode(200, _plan(), fresh=True))
    assert d.stub.num_capacity_calls == 3


def test_no_fitting_d_still_goes_to_the_roomiest_whose_admission_refuses(model_dir):
    router = _router(model_dir, [3, 5])
    assert asyncio.run(router._pick_decode(2000, _plan(beam_width=32))).address == "d1"


def test_poll_interval_must_be_below_the_snapshot_age():
    from router.core import RouterConfig

    with pytest.raises(ValueError, match="capacity_poll_s"):
        RouterConfig(prefill=("p",), decode=(), model="m", capacity_poll_s=2.0)

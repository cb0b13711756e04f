"""Placement by what each engine's cache holds (``router.placement``, ``EnginePool``'s
picks), over fake indexes and fake engine stubs: no engines. The real engines and their
KV events: ``tests/test_fleet.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from router import placement
from tests.test_router_pick import FakeEngineStub, _plan, _router

pytestmark = pytest.mark.fleet


def _ep(name: str, outstanding: int = 0, takes_work: bool = True):
    return SimpleNamespace(address=name, outstanding=outstanding, takes_work=takes_work,
                           capacity=SimpleNamespace(block_size=32))


def _picker(cached: dict[str, int], exclude=None) -> placement.Picker:
    return placement.Picker(
        filters=(placement.takes_work, placement.not_excluded(exclude)),
        scorers=(placement.cached_prefix(lambda ep: cached.get(ep.address, 0),
                                         lambda ep: ep.capacity.block_size),
                 placement.queue()))


def test_without_cache_information_the_fewest_outstanding_wins_first_listed_on_ties():
    eps = [_ep("a", 2), _ep("b", 1), _ep("c", 1)]
    assert _picker({}).pick(eps).address == "b"
    assert _picker({}, exclude=eps[1]).pick(eps).address == "c"
    assert _picker({}).pick([_ep("a", takes_work=False)]) is None


def test_a_long_cached_prefix_outweighs_a_request_in_the_queue_a_few_blocks_do_not():
    """The stated rule: one outstanding request weighs LOAD_TOKENS (512) tokens."""
    eps = [_ep("a", 0), _ep("b", 1)]
    assert _picker({"b": 40}).pick(eps).address == "b"  # 1280 cached tokens > 512
    assert _picker({"b": 3}).pick(eps).address == "a"   # 96 cached tokens < 512
    # Equal queues: any cached block decides.
    assert _picker({"b": 1}).pick([_ep("a"), _ep("b")]).address == "b"
    ranked = _picker({"b": 40}).ranked(eps)
    assert [(score, ep.address) for score, ep in ranked] == [(1280 - 512, "b"), (0, "a")]


class FakeCaches:
    """What ``EngineCaches`` answers, set by hand."""

    def __init__(self, cached: dict[str, int]):
        self.cached = cached

    def cached_blocks(self, address, token_ids, adapter=None):
        return self.cached.get(address, 0)

    def follow(self, address, capacity):
        pass

    def feed(self, address):
        """Every engine's events are followed (nothing cached where not said)."""
        return object()

    async def close(self):
        pass


def test_the_pool_places_stage_1_and_stage_2_where_the_prefix_is(model_dir):
    """P: the one holding the prompt's prefix, the other by load without it; D: among
    those with room, the one holding most of it; with placement by load (the control)
    the first of equals, whatever the caches hold."""
    from kvhandoff.v1 import engine_pb2
    from router import Endpoint

    async def picks(caches):
        router = _router(model_dir, [100, 100])
        router.prefill.append(Endpoint("p2", FakeEngineStub(100), None))
        for ep in [*router.prefill, *router.decode]:
            ep.capacity = engine_pb2.Capacity(num_total_blocks=200, num_free_blocks=100,
                                               block_size=32, max_beam_width=32)
            ep.capacity_at = float("inf")
        router.pool.caches = caches
        p = await router.pool.pick_prefill(None, prompt_ids=list(range(2000)))
        claim = await router.pool.pick_decode(100, _plan().beam, None,
                                              prompt_ids=list(range(2000)))
        claim.release()
        return p.address, claim.endpoint.address

    assert asyncio.run(picks(FakeCaches({"p2": 20, "d1": 5}))) == ("p2", "d1")
    assert asyncio.run(picks(FakeCaches({}))) == ("p", "d0")
    assert asyncio.run(picks(None)) == ("p", "d0")


def test_a_parent_is_addressed_to_the_d_holding_its_prompt(model_dir):
    """A parent's handoff (StartParent: its continuations run on that D) goes to the D
    whose prefix cache holds most of the prompt, weighed against its queue as stage 1
    is (512 tokens a request outstanding), else to the one with the most room (the
    control: nothing cached, the roomier D)."""
    from kvhandoff.v1 import engine_pb2

    def target(caches, busy_d0: int = 0):
        router = _router(model_dir, [100, 150])
        for ep in router.decode:
            ep.capacity = engine_pb2.Capacity(num_total_blocks=200, block_size=32,
                                               num_free_blocks=ep.stub.num_free_blocks)
            ep.out_reason = None
        router.decode[0].outstanding = busy_d0
        router.pool.caches = caches
        return router.continuations._parent_target(list(range(2000)), "").address

    assert target(FakeCaches({"d0": 12})) == "d0"
    assert target(FakeCaches({"d0": 12}), busy_d0=1) == "d1"  # 384 tokens < one request
    assert target(FakeCaches({"d0": 20}), busy_d0=1) == "d0"  # 640 > 512
    assert target(FakeCaches({})) == "d1"
    assert target(None) == "d1"

    class Unfollowed(FakeCaches):
        def feed(self, address):
            return None if address == "d1" else object()

    # d1's events are not followed (yet): no D is judged on half the picture; by load.
    assert target(Unfollowed({"d0": 20})) == "d1"


def test_a_request_under_an_adapter_goes_only_where_it_is_served_and_its_prefix_counts(
        model_dir):
    """Under adapter a: P and D are picked among those that serve it (p2, d1), though
    the others hold more of the prompt, because the index is asked under a (the blocks
    the others hold are the base model's); an adapter no engine serves is NOT_FOUND
    before anything runs. The control: with no adapter the prefix decides (p, d0)."""
    import grpc

    from kvhandoff.v1 import engine_pb2
    from router import Endpoint, RouterError

    class AdapterCaches(FakeCaches):
        def cached_blocks(self, address, token_ids, adapter=None):
            return self.cached.get((address, adapter), 0)

    async def picks(adapter: str):
        router = _router(model_dir, [100, 100])
        router.prefill.append(Endpoint("p2", FakeEngineStub(100), None))
        for ep in [*router.prefill, *router.decode]:
            served = ["a"] if ep.address in ("p2", "d1") else []
            ep.capacity = engine_pb2.Capacity(
                num_total_blocks=200, num_free_blocks=100, block_size=32, max_beam_width=32,
                adapters=[engine_pb2.AdapterInfo(name=n, digest="x") for n in served])
            ep.capacity_at = float("inf")
        router.pool.caches = AdapterCaches({("p", None): 30, ("d0", None): 30,
                                            ("p2", "a"): 2, ("d1", "a"): 2})
        p = await router.pool.pick_prefill(None, prompt_ids=list(range(2000)),
                                           adapter=adapter)
        claim = await router.pool.pick_decode(100, _plan().beam, None,
                                              prompt_ids=list(range(2000)), adapter=adapter)
        claim.release()
        return p.address, claim.endpoint.address

    assert asyncio.run(picks("a")) == ("p2", "d1")
    assert asyncio.run(picks("")) == ("p", "d0")
    with pytest.raises(RouterError) as e:
        asyncio.run(picks("zzz"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert "no prefill engine has adapter 'zzz' (theirs: a;" in str(e.value)

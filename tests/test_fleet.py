"""The router's picture of real engines' prefix caches, from their own KV events
(``engine.kv_events`` relays vLLM's publisher; ``router.cache_feed`` reads it into ``router.cache_index``):
stage 1 on one P shows there and not on the other, a handoff shows on D, D's cache
emptied shows as empty, a feed started late learns what was stored before it (the
replay), and placement follows. Unit level: ``tests/test_cache_index.py``,
``tests/test_placement.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from connector.handoff import ImportRequest
from kvhandoff.types import BeamParams, Stage1Params
from router import placement
from router.cache_feed import EngineCaches
from tools.harness.cases import history_prompt

pytestmark = [pytest.mark.fleet, pytest.mark.engines]


def _capacity(engine) -> SimpleNamespace:
    """What GetCapacity says of the engine's events and pool."""
    return SimpleNamespace(kv_events_endpoint=engine.kv_events.endpoint,
                           kv_events_replay_endpoint=engine.kv_events.replay_endpoint,
                           block_size=engine.block_size,
                           num_total_blocks=engine.num_total_blocks)


async def _until(condition, timeout_s: float = 10.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.05)

    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.timeout(600)
def test_engines_kv_events_tell_the_router_where_a_prefix_is_cached(pair, run,
                                                                    assert_pools_clean):
    prompt = history_prompt(600, "fleet-events", pair.tokenizer)
    full = len(prompt) // pair.p.block_size
    stage1 = Stage1Params(max_tokens=8, temperature=0.0, stop_token_ids=())

    async def scenario():
        caches = EngineCaches()
        try:
            caches.follow("p", _capacity(pair.p))
            caches.follow("d", _capacity(pair.d))
            # Stage 1 on P2 before the router listens to it: the replay at the start of
            # its feed brings what it stored.
            s1 = await pair.p2.run_stage1(prompt, stage1, "fleet-p2", export=False)
            caches.follow("p2", _capacity(pair.p2))
            await _until(lambda: caches.cached_blocks("p2", prompt) == full)
            assert caches.cached_blocks("p", prompt) == 0
            assert caches.feed("p2").stats.replays >= 1

            eps = [SimpleNamespace(address=a, outstanding=n, takes_work=True,
                                   capacity=SimpleNamespace(block_size=pair.p.block_size))
                   for a, n in (("p", 0), ("p2", 1))]
            picker = placement.Picker(
                filters=(placement.takes_work,),
                scorers=(placement.cached_prefix(
                    lambda ep: caches.cached_blocks(ep.address, prompt),
                    lambda ep: ep.capacity.block_size), placement.queue()))
            assert picker.pick(eps).address == "p2"  # 576 cached tokens > one request
            assert picker.pick([*eps[:1], SimpleNamespace(**{**vars(eps[1]),
                                                             "outstanding": 2})]).address == "p"

            # A handoff: the parent's blocks D imported are in D's prefix cache.
            s1 = await pair.p.run_stage1(prompt, stage1, "fleet-p", export=True)
            parent = prompt + s1.token_ids + pair.default_suffix_ids
            beam = BeamParams(beam_width=2, max_tokens=2)
            await pair.d.run_stage2(parent, beam, "fleet-d",
                                    handoff=ImportRequest.for_beams(s1.handoff_params, beam))
            await _until(lambda: caches.cached_blocks("d", parent) >= full)
            await _until(lambda: caches.cached_blocks("p", prompt) == full)
            # D's cache emptied: its index follows (vLLM publishes a step's events with
            # the step: one tiny request carries the reset's).
            await pair.d.empty_prefix_cache()
            await pair.d.run_one_step()
            await _until(lambda: caches.cached_blocks("d", parent) == 0)
            stats = caches.feed("d").stats
            assert stats.incomplete == 0 and stats.restarts == 0
        finally:
            await caches.close()

    run(scenario())
    assert_pools_clean()


def _replica(name: str, engine, node: str = "here", outstanding: int = 0,
             answers: int | None = None):
    """A Serve replica as PrefillRouter sees it: its id, its routing stats
    (``EngineServer.record_routing_stats``: ``outstanding``, ``engine``'s events) and its
    answer to Serve's queue probe (``answers``, else ``outstanding``; -1: an error)."""
    from ray.serve._private.common import DeploymentID, ReplicaID

    async def get_queue_len(*, deadline_s: float) -> int:
        if answers == -1:
            raise ConnectionError(f"{name} does not answer")
        return outstanding if answers is None else answers

    events = engine.kv_events
    return SimpleNamespace(
        get_queue_len=get_queue_len,
        replica_id=ReplicaID(unique_id=name,
                             deployment_id=DeploymentID(name="Prefill", app_name="t")),
        routing_stats={"engine_id": engine.engine_id,
                       "outstanding": outstanding, "block_size": engine.block_size,
                       "num_total_blocks": engine.num_total_blocks, "node_id": node,
                       "kv_events_endpoint": events.endpoint,
                       "kv_events_replay_endpoint": events.replay_endpoint,
                       "kv_events_curve": False})


@pytest.mark.timeout(600)
def test_serves_cache_router_places_stage_1_on_the_p_replica_holding_the_prompt(pair, run):
    """``deploy.request_router.PrefillRouter`` (Ray Serve's Prefill), over real engines'
    KV events named in their replicas' routing stats: a prompt stage 1 ran on P2 goes
    to P2's replica first, one that ran on P to P's. Controls: the same P2 reported from
    another Ray node (its loopback events are not this node's: not followed) and a P2
    whose queue (the handle's count, else the replica's answer to Serve's probe, else
    the engine's last report) outweighs the cached
    prompt both lose to P; a call without a prompt
    keeps Serve's order; a replica gone from the deployment is no longer followed. A
    call naming an engine (Stop, Release) goes to its replica only; one naming an
    engine no replica runs, to any."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from deploy.request_router import PrefillRouter

    on_p2 = history_prompt(600, "serve-cache-p2", pair.tokenizer)
    on_p = history_prompt(600, "serve-cache-p", pair.tokenizer)
    stage1 = Stage1Params(max_tokens=4, temperature=0.0, stop_token_ids=())

    async def scenario():
        router = PrefillRouter(deployment_id=DeploymentID(name="Prefill", app_name="t"),
                             handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        router._node_id = "here"

        async def first(replicas, prompt):
            ranks = await router.choose_replicas(
                replicas, SimpleNamespace(kwargs={"prefix": ("", tuple(prompt))}))
            return ranks[0][0].replica_id.unique_id

        async def until_first(replicas, prompt, want):
            for _ in range(200):
                if await first(replicas, prompt) == want:
                    return
                await asyncio.sleep(0.05)
            raise AssertionError(f"{want} never ranked first")

        p, p2 = _replica("p", pair.p), _replica("p2", pair.p2)
        try:
            await pair.p2.run_stage1(on_p2, stage1, "serve-cache-p2", export=False)
            await pair.p.run_stage1(on_p, stage1, "serve-cache-p", export=False)
            await until_first([p, p2], on_p2, "p2")
            await until_first([p2, p], on_p, "p")
            cached = router.caches.cached_blocks("p2", on_p2)
            assert cached == len(on_p2) // pair.p.block_size, cached
            # Controls.
            far = _replica("p2-far", pair.p2, node="elsewhere")
            assert await first([p, far], on_p2) == "p"
            assert "p2-far" not in router.caches.addresses()
            # A queue of 2 (2 x 512 > 576 cached tokens) as the replica answers Serve's
            # probe (the handle's count was stale), and as the handle counts it.
            queues = router._replica_queue_len_cache
            busy = _replica("p2", pair.p2, outstanding=2)
            queues.invalidate_key(busy.replica_id)
            assert await first([p, busy], on_p2) == "p"
            assert queues.get(busy.replica_id) == 2
            # What the handle knows runs there now wins over the engine's last report
            # (a burst that has ended): the cache decides again.
            queues.update(busy.replica_id, 0)
            assert await first([p, busy], on_p2) == "p2"
            queues.update(busy.replica_id, 2)
            assert await first([p, busy], on_p2) == "p"
            # Stale: the engine last reported 2 (a burst since ended) and the replica
            # answers 0: the cache decides; if it does not answer, the report does.
            queues.invalidate_key(busy.replica_id)
            ended = _replica("p2", pair.p2, outstanding=2, answers=0)
            assert await first([p, ended], on_p2) == "p2"
            queues.invalidate_key(busy.replica_id)
            mute = _replica("p2", pair.p2, outstanding=2, answers=-1)
            assert await first([p, mute], on_p2) == "p"
            assert queues.get(mute.replica_id) is None
            assert await router.choose_replicas([p2, p], SimpleNamespace(kwargs={})) == [[p2, p]]
            for engine, want in ((pair.p2.engine_id, [[p2]]), (pair.p.engine_id, [[p]]),
                                 ("gone", [[p, p2]])):
                named = SimpleNamespace(kwargs={"engine": engine, "prefix": ("", on_p2)})
                assert await router.choose_replicas([p, p2], named) == want, engine
            router.update_replicas([])
            assert router.caches.addresses() == []
        finally:
            await router.caches.close()

    run(scenario())

"""The router's choice of D, over fake engine stubs (no engines): capacity snapshots are
reused while fresh, the router's own picks are claimed against them until a snapshot shows
them, stale ones are asked again, and a request with no room waits its turn, bounded;
and the check of the token D samples again when it finishes a stage 1 whose P is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest

from kvhandoff.budget import blocks_needed
from kvhandoff.types import BeamParams, Stage1Params
from kvhandoff.v1 import common_pb2, engine_pb2
from router import RouterError


class FakeEngineStub:
    def __init__(self, num_free_blocks: int, num_total_blocks: int = 200):
        self.num_free_blocks, self.num_total_blocks = num_free_blocks, num_total_blocks
        self.num_capacity_calls = 0
        #: Status the next GetCapacity calls fail with (None: they answer).
        self.fail_with: grpc.StatusCode | None = None
        #: Seconds each GetCapacity takes to answer.
        self.delay_s = 0.0

    async def GetCapacity(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        self.num_capacity_calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            raise grpc.aio.AioRpcError(self.fail_with, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "from the fake")
        return engine_pb2.Capacity(num_free_blocks=self.num_free_blocks,
                                   num_total_blocks=self.num_total_blocks,
                                   block_size=32, max_beam_width=32)



async def _until(condition, timeout_s: float = 5.0) -> None:
    """Wait for an event the router's tasks cause (not a sleep that hopes for it)."""
    async def poll():
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout_s)

def _router(model_dir: str, free: list[int], **config):
    from router import Endpoint, Router, RouterConfig

    decode = [Endpoint(f"d{i}", FakeEngineStub(n), None) for i, n in enumerate(free)]
    config = RouterConfig(prefill=("p",), decode=tuple(ep.address for ep in decode),
                          model=model_dir, warm_up=False, **config)
    return Router(config, endpoints=([Endpoint("p", FakeEngineStub(100), None)], decode))


def _plan(beam_width: int = 4, deadline: float | None = None):
    from router import Plan

    return Plan("r", [1] * 100, [2], Stage1Params(max_tokens=10),
                BeamParams(beam_width=beam_width, max_tokens=3), common_pb2.PATH_HANDOFF,
                deadline)


async def _pick(router, tokens: int = 200, plan=None, **kw):
    """The D ``EnginePool.pick_decode`` claims room on (the claim is left held)."""
    plan = plan or _plan()
    claim = await router.pool.pick_decode(tokens, plan.beam, plan.deadline, **kw)
    return claim.endpoint


def test_fresh_snapshots_are_reused_and_picks_are_claimed(model_dir):
    router = _router(model_dir, [40, 30])
    need = blocks_needed(200, 32, 4, 3)
    picks = [asyncio.run(_pick(router)).address for _ in range(4)]
    # One GetCapacity per D for the whole burst; claims move the next pick to the D with
    # the most unclaimed blocks.
    assert [ep.stub.num_capacity_calls for ep in router.decode] == [1, 1]
    assert picks[0] == "d0"
    assert router.decode[0].num_claimed_blocks + router.decode[1].num_claimed_blocks == 4 * need
    assert set(picks) == {"d0", "d1"}


def test_stale_snapshots_and_failed_handoffs_ask_again(model_dir):
    router = _router(model_dir, [40])
    d = router.decode[0]
    asyncio.run(_pick(router))
    d.capacity_at = time.monotonic() - router.config.capacity_max_age_s - 1
    d.stub.num_free_blocks = 37
    asyncio.run(_pick(router))
    assert d.stub.num_capacity_calls == 2 and d.capacity.num_free_blocks == 37
    asyncio.run(_pick(router, fresh=True))
    assert d.stub.num_capacity_calls == 3


class RecordingObserver:
    def __init__(self):
        self.changes: list[tuple[str, str, str]] = []
        self.answers: list[str] = []

    def engine_state(self, role, address, state, reason):
        self.changes.append((address, state, reason))

    def capacity_answer(self, role, address, seconds, code):
        self.answers.append(code)


def test_a_late_d_stays_in_rotation_until_silent_and_a_refusing_one_is_out_at_once(
        model_dir):
    router = _router(model_dir, [40, 30], engine_silence_s=0.5)
    router.pool.observer = seen = RecordingObserver()
    d0, d1 = router.decode
    asyncio.run(router.refresh_capacity(router.decode))
    assert seen.changes == [("d0", "in", "first answer"), ("d1", "in", "first answer")]
    seen_at = d0.capacity_at
    d0.stub.fail_with = grpc.StatusCode.DEADLINE_EXCEEDED
    d1.stub.fail_with = grpc.StatusCode.UNAVAILABLE
    for late in (1, 2, 3):
        asyncio.run(router.refresh_capacity(router.decode))
        assert d0.in_rotation and d0.num_late_answers == late  # slow is not dead
        assert d0.capacity_at == seen_at  # claims settle against the snapshot's own time
        assert not d1.in_rotation and d1.out_reason.startswith("UNAVAILABLE")
    assert d0.num_unclaimed_blocks == 40  # still counted on
    time.sleep(0.5)
    asyncio.run(router.refresh_capacity(router.decode))
    assert not d0.in_rotation and d0.out_reason.startswith("silent for")
    d0.stub.fail_with = None
    asyncio.run(router.refresh_capacity(router.decode))
    assert d0.in_rotation and d0.num_late_answers == 0
    assert seen.changes[2:] == [("d1", "out", "unavailable"), ("d0", "out", "silent"),
                                ("d0", "in", "answered")]
    assert seen.answers.count("DEADLINE_EXCEEDED") == 4


def test_with_no_d_in_rotation_a_request_waits_while_one_answered_lately(model_dir):
    async def scenario():
        router = _router(model_dir, [40], engine_silence_s=2.0)
        d = router.decode[0]
        await router.refresh_capacity(router.decode)
        d.stub.fail_with = grpc.StatusCode.UNAVAILABLE  # e.g. restarting
        await router.refresh_capacity(router.decode)
        assert not d.in_rotation
        waiter = asyncio.create_task(_pick(router))
        await _until(lambda: router.pool.num_waiting == 1)
        d.stub.fail_with = None
        assert await asyncio.wait_for(waiter, 5) is d  # its next answer lets it through
        # Silent past the limit: UNAVAILABLE at once, naming why.
        d.stub.fail_with = grpc.StatusCode.UNAVAILABLE
        await router.refresh_capacity(router.decode)
        d.answered_at -= 2.0
        with pytest.raises(RouterError, match="no decode engine is reachable") as e:
            await _pick(router)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "d0: UNAVAILABLE" in str(e.value)

    asyncio.run(scenario())


def test_a_wait_for_an_engine_out_of_rotation_is_bounded(model_dir):
    async def scenario():
        router = _router(model_dir, [40], decode_wait_s=0.3)
        d = router.decode[0]
        await router.refresh_capacity(router.decode)
        d.stub.fail_with = grpc.StatusCode.UNAVAILABLE
        await router.refresh_capacity(router.decode)
        t0 = time.monotonic()
        with pytest.raises(RouterError, match="no decode engine is reachable") as e:
            await _pick(router)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and 0.25 < time.monotonic() - t0 < 2
        with pytest.raises(asyncio.TimeoutError):
            await _pick(router, plan=_plan(deadline=time.monotonic() + 0.1))
        assert router.pool.num_waiting == 0
        # P alike: a request waits for a P that answered lately, bounded.
        p = router.prefill[0]
        await router.refresh_capacity(router.prefill)
        p.stub.fail_with = grpc.StatusCode.UNAVAILABLE
        await router.refresh_capacity(router.prefill)
        waiter = asyncio.create_task(router.pool.pick_prefill(None))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        p.stub.fail_with = None
        assert await asyncio.wait_for(waiter, 5) is p

    asyncio.run(scenario())


def test_a_request_no_d_could_ever_hold_is_refused_at_once(model_dir):
    router = _router(model_dir, [200, 150])
    with pytest.raises(RouterError) as e:
        asyncio.run(_pick(router, 8000, _plan(beam_width=32)))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT  # permanent: no retry helps
    assert "decode pool too small" in str(e.value) and "holds 200" in str(e.value)


def test_snapshots_settle_claims_whose_stage2_reached_d():
    from router import ADMIT_S, Claim, Endpoint

    ep = Endpoint("d", None, None)
    ep.capacity_at = time.monotonic()
    in_stage1 = Claim(ep, 3)
    sent_long_ago = Claim(ep, 5, sent_at=ep.capacity_at - ADMIT_S - 1)
    just_sent = Claim(ep, 7, sent_at=ep.capacity_at)
    ep.claims = {in_stage1, sent_long_ago, just_sent}
    ep.settle_claims()
    assert ep.claims == {in_stage1, just_sent} and ep.num_claimed_blocks == 10
    in_stage1.release()
    in_stage1.release()  # idempotent
    assert ep.claims == {just_sent} and ep.num_claimed_blocks == 7


def test_without_room_a_request_waits_its_turn_until_a_claim_is_released(model_dir):
    need = blocks_needed(200, 32, 4, 3)

    async def scenario():
        router = _router(model_dir, [need])
        d = router.decode[0]
        plan = _plan()
        held = await router.pool.pick_decode(200, plan.beam, plan.deadline)
        assert held.endpoint is d
        order = []

        async def wait(name):
            claim = await router.pool.pick_decode(200, plan.beam, plan.deadline)
            order.append(name)
            claim.release()

        waiters = [asyncio.create_task(wait(n)) for n in ("first", "second")]
        await _until(lambda: router.pool.num_waiting == 2)
        assert order == []
        held.release()
        await asyncio.wait_for(asyncio.gather(*waiters), 5)
        return order

    assert asyncio.run(scenario()) == ["first", "second"]


def test_the_wait_is_bounded_by_the_queue_the_time_and_the_deadline(model_dir):
    async def scenario():
        router = _router(model_dir, [1], decode_queue_limit=1, decode_wait_s=0.5)
        waiter = asyncio.create_task(_pick(router))
        await _until(lambda: router.pool.num_waiting == 1)
        with pytest.raises(RouterError, match="decode queue full"):
            await _pick(router)
        t0 = time.monotonic()
        with pytest.raises(RouterError, match="no decode engine had room") as e:
            await waiter
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 0.3 < time.monotonic() - t0 < 2
        with pytest.raises(asyncio.TimeoutError):
            await _pick(router, plan=_plan(deadline=time.monotonic() + 0.2))
        assert router.pool.num_waiting == 0

    asyncio.run(scenario())


def test_with_no_queue_a_request_without_room_is_refused_at_once(model_dir):
    router = _router(model_dir, [1], decode_queue_limit=0)
    with pytest.raises(RouterError, match="decode queue full"):
        asyncio.run(_pick(router))


def test_poll_interval_must_be_below_the_snapshot_age():
    from router import RouterConfig

    with pytest.raises(ValueError, match="capacity_poll_s"):
        RouterConfig(prefill=("p",), decode=(), model="m", capacity_poll_s=2.0)
    with pytest.raises(ValueError, match="engine_silence_s"):
        RouterConfig(prefill=("p",), decode=(), model="m", engine_silence_s=0.1)


def test_a_parent_hold_no_continuation_could_import_within_is_refused_at_start():
    """A held parent is imported only while its hold has ``LEASE_MARGIN_S`` to run: a
    shorter ``--parent-hold-s`` would hold blocks no continuation can read."""
    from router import RouterConfig
    from router.config import LEASE_MARGIN_S

    for hold_s in (-1.0, 1.0, LEASE_MARGIN_S):
        with pytest.raises(ValueError, match="parent_hold_s"):
            RouterConfig(prefill=("p",), decode=(), model="m", parent_hold_s=hold_s)
    for hold_s in (0.0, LEASE_MARGIN_S + 0.5, 7.0):
        assert RouterConfig(prefill=("p",), decode=(), model="m",
                            parent_hold_s=hold_s).parent_hold_s == hold_s


def test_the_parent_registry_is_bounded_by_count_time_and_ps_share():
    from router.parents import ParentRecord, ParentRegistry

    def done(pid: str) -> ParentRecord:
        r = ParentRecord(pid, "m", [1, 2, 3], num_blocks=10)
        r.done.set()
        return r

    reg = ParentRegistry(max_parents=2, ttl_s=0.2, pool_share=0.25)
    running = ParentRecord("run", "m", [1])
    reg.add(running)
    for pid in ("a", "b"):
        reg.add(done(pid))
    # Over the limit, but the oldest is still running: it stays; then it finishes.
    assert reg.get("run") is running and len(reg) == 3
    running.done.set()
    reg.add(done("c"))
    assert reg.get("a") is None and reg.get("b") is None and reg.evictions["lru"] == 2
    assert reg.get("run") is running and reg.get("c") is not None
    time.sleep(0.25)
    assert reg.get("c") is None and reg.evictions["ttl"] == 2
    # The share: 25 of 100 blocks; a hold counts until its lease ends, evicted or not.
    a, b = done("x"), done("y")
    assert reg.may_hold(10, 100) == ""
    reg.hold(a, time.time() + 60)
    reg.hold(b, time.time() + 0.2)
    assert "share of P's pool for held parents is full (20 of 25" in reg.may_hold(10, 100)
    assert reg.num_held() == 2
    time.sleep(0.25)
    assert reg.held_blocks() == 10 and reg.may_hold(10, 100) == ""
    reg.unhold(a)
    assert reg.held_blocks() == 0


def test_the_holds_released_for_a_new_parent_are_idle_forgotten_first_then_lru():
    """``ParentRegistry.to_release``: nothing when the new parent fits or could never
    fit; else parents the registry forgot, then the least recently used, never one whose
    continuation is running."""
    from router.parents import ParentRecord, ParentRegistry, ParentState

    reg = ParentRegistry(max_parents=2, ttl_s=60, pool_share=0.3)  # 30 of 100 blocks
    records = {}
    for pid in ("old", "mid", "new"):
        r = records[pid] = ParentRecord(pid, "m", [1], num_blocks=10)
        r.held_until = time.time() + 60
        r.enter(ParentState.HELD)  # stage 1 ended, held on P
        reg.add(r)
        reg.hold(r, r.held_until)
        time.sleep(0.01)
    # "old" was forgotten (LRU, 2 parents at most) but its hold still counts.
    assert reg.get("old") is None and reg.held_blocks() == 30
    assert reg.to_release(10, 200) == []  # 60 blocks of share: it fits
    assert reg.to_release(40, 100) == []  # bigger than the share: nothing helps
    assert reg.to_release(10, 100) == [records["old"]]
    reg.get("mid")  # used: now "new" is the least recently used
    assert reg.to_release(20, 100) == [records["old"], records["new"]]
    records["new"].in_use = 1  # a continuation reads it: never released
    assert reg.to_release(20, 100) == [records["old"], records["mid"]]
    records["mid"].in_use = 1
    assert reg.to_release(20, 100) == []  # only "old" is idle: not enough


class FakeStreamingD(FakeEngineStub):
    """A D whose sampled Stage2Stream answers ``tokens`` (then its result)."""

    def __init__(self, tokens: list[int]):
        super().__init__(100)
        self.tokens, self.requests = tokens, []

    def Stage2Stream(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        self.requests.append(request)

        async def events():
            yield engine_pb2.Stage2Event(new_token_ids=self.tokens)
            last = engine_pb2.Stage2Event()
            last.result.beams.add(token_ids=self.tokens, finish_reason="length")
            last.result.num_computed_tokens_first_step = len(request.prompt_token_ids)
            yield last

        return events()


@pytest.mark.parametrize("d_samples, ok", [([13, 14, 15], True), ([99, 14, 15], False)])
def test_stage1_finished_on_d_without_a_handoff_samples_the_last_token_again(
        model_dir, d_samples, ok):
    """P gone: D gets the prompt and the streamed tokens but the last, samples that one
    again, and the router checks it: equal, the stream goes on after it (never twice);
    different, INTERNAL naming both (the control: the check is not a constant)."""
    from router import Outcome

    router = _router(model_dir, [100])
    d = router.decode[0]
    d.stub = FakeStreamingD(d_samples)
    plan = _plan()
    out = Outcome(plan, "p", d.address, thinking_ids=[11, 12, 13])

    async def finish():
        return [t async for batch in router.stages.finish_stage1_on(d, None, None, plan, out,
                                                                       "resume: test")
                for t in batch]

    if ok:
        assert asyncio.run(finish()) == [14, 15]
        assert out.thinking_ids == [11, 12, 13, 14, 15]
    else:
        with pytest.raises(RouterError) as e:
            asyncio.run(finish())
        assert e.value.code == grpc.StatusCode.INTERNAL and "sampled 99 where 13" in str(e.value)
    (sent,) = d.stub.requests
    assert list(sent.prompt_token_ids) == [1] * 100 + [11, 12]
    assert sent.sampling.max_tokens == 10 - 2 and not sent.HasField("handoff")


class FakeP(FakeEngineStub):
    """A P whose Stage1 streams ``tokens`` then exports, or fails with ``fail_with``."""

    def __init__(self, tokens: list[int], fail: grpc.StatusCode | None = None):
        super().__init__(100)
        self.tokens, self.fail, self.requests = tokens, fail, []

    def Stage1(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        self.requests.append(request)

        async def events():
            if self.fail is not None:
                raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "refused by the fake")
            yield engine_pb2.Stage1Event(new_token_ids=self.tokens)
            last = engine_pb2.Stage1Event(finish_reason="length", num_imported_tokens=7)
            last.handoff.request_id = "exported"
            yield last

        return events()


@pytest.mark.migration
def test_a_move_the_other_p_refuses_resumes_on_a_p_with_the_same_d(model_dir):
    """A move to another P that refuses the import (its pool is short: RESOURCE_EXHAUSTED)
    leaves the request running: stage 1 resumes on a P from every token so far (the last
    sampled again and checked), exporting to the same D; the record lists the move and
    the resume. The control: a destination that takes it streams on after every token,
    its request carrying the source's handoff."""
    from router import Endpoint, Outcome
    from router.moves import Running

    async def move(dest_fails: bool):
        router = _router(model_dir, [100])
        source = router.prefill[0]
        source.stub = FakeP([13, 14, 15])
        dest = Endpoint("p2", FakeP([14, 15], grpc.StatusCode.RESOURCE_EXHAUSTED
                                    if dest_fails else None), None)
        router.prefill.append(dest)
        for ep in router.prefill:
            ep.capacity = engine_pb2.Capacity(num_total_blocks=200)
        plan = _plan()
        out = Outcome(plan, "p", "d0", thinking_ids=[11, 12, 13])
        running = Running(plan, source, router.decode[0], move_reason="move", move_to=dest)
        handoff = common_pb2.Handoff(request_id="from-source")
        items = [i async for i in router.executor.move_to_p(running, handoff, plan, out)]
        return router, dest, out, running, items

    router, dest, out, running, items = asyncio.run(move(dest_fails=True))
    assert out.thinking_ids == [11, 12, 13, 14, 15] and items[0] == [14, 15]
    assert items[-1].request_id == "exported"
    assert [(m.from_endpoint, m.to_endpoint, m.reason.split(":")[0]) for m in out.moves] == [
        ("p", "p2", "move"), ("p2", "p", "resume")]
    (resumed,) = router.prefill[0].stub.requests
    assert list(resumed.prompt_token_ids) == [1] * 100 + [11, 12] and resumed.export
    assert running.p is router.prefill[0] and running.d is router.decode[0]

    router, dest, out, running, items = asyncio.run(move(dest_fails=False))
    assert out.thinking_ids == [11, 12, 13, 14, 15] and running.p is dest
    (sent,) = dest.stub.requests
    assert list(sent.prompt_token_ids) == [1] * 100 + [11, 12, 13]
    assert sent.handoff.request_id == "from-source" and sent.sampling.max_tokens == 10 - 3
    assert [(m.to_endpoint, m.num_imported_tokens) for m in out.moves] == [("p2", 7)]
    assert not running.move_asked


class FakeD(FakeEngineStub):
    """A D whose Stage2 records its requests and answers one beam; ``fail_first``: the
    first call fails UNAVAILABLE (its READ failed), so the router recomputes."""

    def __init__(self, fail_first: bool = False):
        super().__init__(100)
        self.requests, self.fail_first = [], fail_first

    async def Stage2(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        sent = engine_pb2.Stage2Request()
        sent.CopyFrom(request)
        self.requests.append(sent)
        if self.fail_first and len(self.requests) == 1:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "READ failed")
        resp = engine_pb2.Stage2Response()
        resp.beams.add(token_ids=[5], finish_reason="length")
        return resp


@pytest.mark.parametrize("fault, on_p, on_d", [("", "", ""), ("stale", "stale", ""),
                                               ("zero-block", "", "zero-block")])
def test_a_fault_goes_to_the_engine_of_its_side_and_never_into_a_recompute(
        model_dir, fault, on_p, on_d):
    """A request naming an injected fault: P's stage 1 carries a P-side one (its export),
    D's import a D-side one; the recompute after a failed import carries none (it imports
    nothing); an unknown fault is INVALID_ARGUMENT at the plan."""
    import dataclasses

    async def run_one():
        router = _router(model_dir, [100])
        p, d = router.prefill[0], router.decode[0]
        p.stub, d.stub = FakeP([13, 14]), FakeD(fail_first=True)
        await router.refresh_capacity()
        plan = dataclasses.replace(_plan(), fault=fault)
        return [i async for i in router.run(plan)][-1], p.stub.requests, d.stub.requests

    out, stage1s, stage2s = asyncio.run(run_one())
    assert [r.fault for r in stage1s] == [on_p]
    imported, recomputed = stage2s
    assert imported.HasField("handoff") and imported.fault == on_d
    assert not recomputed.HasField("handoff") and recomputed.fault == ""
    assert out.failed_decode == "d0"


def test_an_unknown_fault_is_refused_at_the_plan(model_dir):
    from kvhandoff.types import InvalidRequest
    from router.grpc_wire import generate_call
    from tools.client import make_request

    router = _router(model_dir, [100])  # no snapshot yet: the prompt is not checked
    req = make_request(prompt=[1] * 40, max_tokens=2, path="handoff")
    req.fault = "no-such-fault"
    with pytest.raises(InvalidRequest, match="unknown fault 'no-such-fault'"):
        router.plan(generate_call(req), None)


def test_the_metrics_count_what_the_pool_sees_of_its_engines(model_dir):
    """``RouterMetrics.track_engines`` observes the router's pool: an engine's first
    answer and its leaving rotation are counted, by role and reason."""
    from router.metrics import RouterMetrics

    router = _router(model_dir, [40])
    metrics = RouterMetrics()
    metrics.track_engines(router)

    def changes(state: str, reason: str) -> float | None:
        return metrics.registry.get_sample_value(
            "kvhandoff_router_engine_state_changes_total",
            {"role": "decode", "endpoint": "d0", "state": state, "reason": reason})

    asyncio.run(router.refresh_capacity())
    router.decode[0].stub.fail_with = grpc.StatusCode.UNAVAILABLE
    asyncio.run(router.refresh_capacity())
    assert changes("in", "first answer") == 1 and changes("out", "unavailable") == 1


class EndlessStage1:
    """A P's Stage1 call that streams one batch after another until cancelled, and says
    whether it was (a gRPC call the router stops reading runs on in the engine until it
    is cancelled)."""

    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.cancelled:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return engine_pb2.Stage1Event(new_token_ids=[7])

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_stage1_the_router_stops_reading_is_cancelled_on_p_at_once(model_dir):
    """The client goes away after the first batch: the router's stage-1 generator is
    closed, and P's call is cancelled then, not whenever gRPC collects the call object
    (the cluster's cancel test once found P still running a cancelled stage 1)."""
    from router import Outcome

    router = _router(model_dir, [100])
    p = router.prefill[0]
    call = EndlessStage1()
    p.stub = type("P", (), {"Stage1": lambda self, request, timeout=None: call})()
    plan = _plan()
    out = Outcome(plan, "p", "d0")

    async def read_one_batch_then_go():
        stream = router.stages.stage1(p, None, plan, out, export=False)
        assert await anext(stream) == [7]
        assert not call.cancelled
        await stream.aclose()

    asyncio.run(read_one_batch_then_go())
    assert call.cancelled and p.outstanding == 0


@pytest.mark.migration
def test_a_move_answers_where_stage_1_ran_even_when_it_completes_during_the_stop(model_dir):
    """Router.Move reads the source before it asks P to stop: a move that completes while
    the stop call is still answering (the run switched ``running.p`` to the destination)
    is answered from the source, not from the destination twice (a fresh-clone run saw
    from == to). The control: the fake's switch really happens before the answer."""
    from router import Endpoint
    from router.moves import MoveDesk, Running

    router = _router(model_dir, [100])
    source, dest = router.prefill[0], Endpoint("p2", FakeEngineStub(100), None)
    router.prefill.append(dest)
    for ep in (*router.prefill, *router.decode):
        ep.capacity = engine_pb2.Capacity(num_total_blocks=200)
    plan = dataclasses.replace(_plan(), stage1=Stage1Params(max_tokens=10, positional=True,
                                                             seed=1))
    running = Running(plan, source, router.decode[0], s1_id="s1")

    class Stages:  # the run moves on before the stop call answers
        call_timeout_s = 5.0

        async def stop(self, p, s1_id, target, engine_id=""):
            assert (p, s1_id) == (source, "s1")
            running.p = dest
            running.settle_move(True)

    desk = MoveDesk(router.pool, Stages())

    async def move():
        with desk.track(running):
            return await desk.move(plan.request_id, to="p2")

    answer = asyncio.run(move())
    assert running.p is dest
    assert (answer.from_endpoint, answer.to_endpoint) == ("p", "p2")


def test_a_move_answers_only_what_the_run_did_with_the_stop(model_dir):
    """Router.Move answers once the run has seen stage 1 end on P: OK when the stop
    ended it (it goes on at D); FAILED_PRECONDITION when stage 1 had ended on its own
    before the stop reached P (the stop found nothing: a fresh-clone run counted such a
    request as moved); ABORTED when the request ended another way meanwhile. Each run
    here is the real check the executor makes (``_stopped_by_move``) on stage 1's end."""
    from router import Outcome
    from router.executor import Executor
    from router.moves import MoveDesk, Running

    router = _router(model_dir, [100])
    for ep in (*router.prefill, *router.decode):
        ep.capacity = engine_pb2.Capacity(num_total_blocks=200)
    plan = dataclasses.replace(_plan(), stage1=Stage1Params(max_tokens=10, positional=True,
                                                             seed=1))
    handoff = common_pb2.Handoff(request_id="s1")

    async def move(sampled: int, finish: str = "length", fail: bool = False):
        running = Running(plan, router.prefill[0], router.decode[0], s1_id="s1")
        out = Outcome(plan, "p", "d0", thinking_ids=list(range(sampled)))
        out.stage1_finish_reason = finish

        class Stages:  # P answers the stop; stage 1's end reaches the run after it
            call_timeout_s = 5.0

            async def stop(self, p, s1_id, target, engine_id=""):
                asyncio.get_running_loop().call_later(0.01, stage1_ended)

        def stage1_ended():
            if fail:
                run.cancel()
            else:
                Executor._stopped_by_move(running, plan, out, handoff)

        async def the_run():
            with desk.track(running):
                await asyncio.sleep(5)

        desk = MoveDesk(router.pool, Stages())
        run = asyncio.ensure_future(the_run())
        await asyncio.sleep(0)
        try:
            return await desk.move(plan.request_id)
        finally:
            run.cancel()

    assert asyncio.run(move(sampled=4)).to_endpoint == "d0"
    for sampled, finish, fail, code, says in (
            (10, "length", False, grpc.StatusCode.FAILED_PRECONDITION, "nothing moved"),
            (4, "stop", False, grpc.StatusCode.FAILED_PRECONDITION, "nothing moved"),
            (4, "length", True, grpc.StatusCode.ABORTED, "ended while")):
        with pytest.raises(RouterError) as e:
            asyncio.run(move(sampled, finish, fail))
        assert e.value.code == code and says in str(e.value), (sampled, finish, fail)


def test_a_search_kept_in_a_catalog_is_counted_at_the_slots_it_makes(model_dir):
    """A D that says how wide its catalog is (``Capacity.catalog_widths``): a W=32
    search kept in a catalog of 3 items makes 3 slots, and the router counts those: a
    parent that 32 slots would not fit beside in 200 blocks is placed. Without the
    widths the same search is refused as too big (32 slots counted)."""
    from router import Plan

    class CatalogStub(FakeEngineStub):
        def __init__(self, widths):
            super().__init__(200)
            self.widths = widths

        async def GetCapacity(self, request, timeout=None):  # noqa: N802
            cap = await super().GetCapacity(request, timeout)
            cap.catalogs.append("shop")
            if self.widths is not None:
                cap.catalog_widths.append(engine_pb2.CatalogWidths(
                    name="shop", nodes_at_depth=self.widths))
            return cap

    plan = Plan("r", [1] * 100, [2], Stage1Params(max_tokens=10),
                BeamParams(beam_width=32, max_tokens=3, catalog="shop"),
                common_pb2.PATH_HANDOFF, None)
    for widths in ([2, 3, 3], None):
        router = _router(model_dir, [200])
        router.pool.decode[0].stub = CatalogStub(widths)
        if widths is not None:
            assert asyncio.run(_pick(router, 5500, plan)).address == "d0"
        else:
            with pytest.raises(RouterError, match="decode pool too small"):
                asyncio.run(_pick(router, 5500, plan))



def test_a_parent_whose_stage_2_may_come_shorter_is_counted_at_its_largest(model_dir):
    """Before stage 1 ends the stage-2 prompt is anywhere from the prompt and suffix
    (stage 1 ended at once) to the longest; a shorter one can need more blocks (a fuller
    last block: each beam's tail spills into another). With 32 beams of 16 tokens, 3008
    tokens take 126 blocks of 32, 3000 take 157: a D of 150 refuses such a request up
    front, as its admission would once stage 1 ended short (in CI one reached D, which
    counted its 157 blocks reserved until it refused it, and refused another meanwhile)."""
    beam = BeamParams(beam_width=32, max_tokens=16)

    def pick(**kw):
        router = _router(model_dir, [150])
        router.pool.decode[0].stub.num_total_blocks = 150
        return asyncio.run(router.pool.pick_decode(3008, beam, None, **kw)).endpoint.address

    assert pick() == "d0"
    with pytest.raises(RouterError, match="decode pool too small: needs 157 blocks"):
        pick(shortest=3000)


def test_only_a_refusal_for_an_ended_lease_counts_as_one():
    """The router's expired-lease counter reads the failure's words: D's admission and
    the registry say the lease ended; D's message for a READ that failed in flight names
    the lease as one possible cause among others and is not counted."""
    from router.metrics import lease_ended
    from router.parents import ParentRecord

    record = ParentRecord("p", "m", [1, 2, 3])
    record.held_until = 1.0  # long past
    assert lease_ended(f"parent not held: {record.why_not_importable()}")
    assert lease_ended("handoff lease expired or about to (0.50s left, need 2.00s)")
    assert not lease_ended("KV import from P failed: the READ was refused (P's lease was "
                           "about to end) or failed in transport; see D's log")
    assert not lease_ended("failed to connect to all addresses")


def test_an_engine_back_takes_no_work_until_its_pairs_are_warmed_up(model_dir):
    """An engine that answers again after an outage is warmed up before new work goes to
    it (a NIXL connection the outage broke fails its first READ: the warm-up's, not a
    client's). Meanwhile picks pass it by, the warm-up's own pick (pinned) takes it, and
    it takes work again when the warm-up ends, failed or not."""
    router = _router(model_dir, [40, 30])
    d0, d1 = router.decode
    started = asyncio.Event()
    release = asyncio.Event()

    async def warm_up(timeout_s: float = 0, pairs=None):
        assert pairs == [(router.prefill[0], d0)]
        started.set()
        await release.wait()
        raise RuntimeError("the warm-up failed")

    async def go():
        assert (await _pick(router)) is d0  # the most room
        router.warmup.warm_up = warm_up
        router.warmup._warm_up_later(d0)  # what the pool calls when d0 answers again
        await started.wait()
        assert d0.warming and not d0.takes_work
        assert (await _pick(router)) is d1
        assert (await _pick(router, only=[d0], warming_ok=True)) is d0
        release.set()
        await _until(lambda: not d0.warming)
        assert d0.takes_work

    asyncio.run(go())


def test_a_catalog_and_an_adapter_on_different_ds_is_not_found_naming_both(model_dir):
    """Two Ds, one with the catalog, the other with the adapter: a search kept in the
    catalog under the adapter can run on neither. NOT_FOUND naming where each is (it was
    "max() arg is an empty sequence", INTERNAL); the twin on the D that has both runs."""
    class Stub(FakeEngineStub):
        def __init__(self, catalog: bool, adapter: bool):
            super().__init__(200)
            self.catalog, self.adapter = catalog, adapter

        async def GetCapacity(self, request, timeout=None):  # noqa: N802
            cap = await super().GetCapacity(request, timeout)
            if self.catalog:
                cap.catalogs.append("shop")
            if self.adapter:
                cap.adapters.add(name="a")
            return cap

    beam = BeamParams(beam_width=4, max_tokens=3, catalog="shop")
    router = _router(model_dir, [200, 200])
    router.pool.decode[0].stub, router.pool.decode[1].stub = Stub(True, False), Stub(False, True)
    with pytest.raises(RouterError, match="no decode engine has both catalog 'shop' and "
                                          "adapter 'a'.*on d0; the adapter on d1") as e:
        asyncio.run(router.pool.pick_decode(100, beam, None, adapter="a"))
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    router = _router(model_dir, [200, 200])
    router.pool.decode[0].stub, router.pool.decode[1].stub = Stub(True, False), Stub(True, True)
    claim = asyncio.run(router.pool.pick_decode(100, beam, None, adapter="a"))
    assert claim.endpoint.address == "d1"


def test_a_parent_and_a_running_request_refuse_an_illegal_transition():
    """Their states change only along ``_NEXT`` (``router.parents``, ``router.moves``):
    a failed parent is never held after, an ended request never runs again."""
    from router.moves import Running, Stage
    from router.parents import ParentRecord, ParentState

    held = ParentRecord("held", "m", [1])
    held.held_until = time.time() + 60
    held.enter(ParentState.HELD)
    assert held.done.is_set() and held.held
    held.enter(ParentState.NOT_HELD, "released by the client")
    assert not held.held and held.not_held_reason == "released by the client"
    failed = ParentRecord("failed", "m", [1])
    failed.enter(ParentState.FAILED, "P went away")
    assert failed.done.is_set() and failed.error == "P went away"
    with pytest.raises(AssertionError, match="FAILED -> HELD"):
        failed.enter(ParentState.HELD)
    running = Running(_plan(), None, None)
    running.enter(Stage.ON_D)  # moved to its D
    running.enter(Stage.ON_P)  # finishing there failed: resumed on a P
    running.enter(Stage.ENDED)
    with pytest.raises(AssertionError, match="ENDED -> ON_P"):
        running.enter(Stage.ON_P)


def test_the_routers_registries_are_taken_by_their_interfaces(model_dir):
    """Another store stands in for the parents, the chunks and the drains
    (``ParentStore``, ``ChunkStore``, ``Rotation``): the router uses what it is given."""
    from router import Endpoint, Router, RouterConfig
    from router.chunk_registry import ChunkRegistry
    from router.parents import ParentRegistry
    from router.rotation import LocalRotation

    class Drains(LocalRotation):
        def __init__(self):
            self.asked: list[tuple[str, str]] = []

        def drain(self, ep):
            self.asked.append(("drain", ep.address))
            super().drain(ep)

        def undo(self, ep):
            self.asked.append(("undo", ep.address))
            super().undo(ep)

    parents, chunks, drains = ParentRegistry(4, 60.0, 0.5), ChunkRegistry(), Drains()
    d = Endpoint("d0", FakeEngineStub(100), None)
    config = RouterConfig(prefill=("p",), decode=("d0",), model=model_dir, warm_up=False)
    router = Router(config, endpoints=([Endpoint("p", FakeEngineStub(100), None)], [d]),
                    parents=parents, chunk_store=chunks, rotation=drains)
    assert router.parents is parents and router.chunks.store is chunks
    drained = asyncio.run(router.drain("d0", timeout_s=1.0))
    assert drained.empty and d.draining and not d.takes_work
    asyncio.run(router.drain("d0", undo=True))
    assert drains.asked == [("drain", "d0"), ("undo", "d0")] and not d.draining


def test_a_p_back_from_a_restart_before_the_next_poll_is_asked_not_refused(model_dir):
    """P silent past ``engine_silence_s`` (a restart) answers again, and a request comes
    before any poll saw it: the request asks P itself and goes there. P still down:
    UNAVAILABLE, naming why, after that one ask."""
    async def scenario():
        router = _router(model_dir, [40], engine_silence_s=0.5)
        p = router.prefill[0]
        p.stub.fail_with = grpc.StatusCode.UNAVAILABLE  # "engine is starting"
        await router.refresh_capacity(router.prefill)
        p.answered_at -= 1.0
        calls = p.stub.num_capacity_calls
        with pytest.raises(RouterError, match="no prefill engine is reachable") as e:
            await router.pool.pick_prefill(None)
        assert "p: UNAVAILABLE" in str(e.value) and p.stub.num_capacity_calls == calls + 1
        p.stub.fail_with = None  # serving again; no poll runs in this router
        assert await asyncio.wait_for(router.pool.pick_prefill(None), 5) is p

    asyncio.run(scenario())


def test_a_d_back_from_a_restart_that_answers_slower_than_a_poll_is_waited_for(model_dir):
    """D silent past ``engine_silence_s`` answers again, but slower than a poll interval
    (the stale refresh's wait): the request waits for that answer (up to
    ``capacity_timeout_s``) instead of refusing D as silent."""
    async def scenario():
        router = _router(model_dir, [40], engine_silence_s=0.5)
        d = router.decode[0]
        d.stub.fail_with = grpc.StatusCode.UNAVAILABLE
        await router.refresh_capacity(router.decode)
        d.answered_at -= 1.0
        d.stub.fail_with, d.stub.delay_s = None, 3 * router.config.capacity_poll_s
        assert await asyncio.wait_for(_pick(router), 5) is d

    asyncio.run(scenario())

"""Router.Move of a stage 2 (``router.search_moves``) against fake engines: a request's
whole run (``Executor.run``) with a fake P and two fake Ds, and a Move while its beam
search runs. What the router sends (the Stop's target, the resume), what it answers,
which claims it holds, and what follows a destination that fails."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvhandoff.types import BeamParams, Stage1Params
from kvhandoff.v1 import common_pb2, engine_pb2

BEAMS = [common_pb2.Beam(token_ids=[9, 9, 9], cum_logprob=-1.0, finish_reason="length")]


class FakeEngine:
    """A P or D: capacity, a stage 1 of two tokens and its handoff (P), a stage 2 that
    (``mode``) waits for a Stop and answers stopped ("stop"), waits for it and ends with
    beams anyway ("end"), answers beams after ``slow_s`` ("slow") or at once; a resume
    fails with ``fail`` when set."""

    def __init__(self, name: str, mode: str = "beams",
                 fail: grpc.StatusCode | None = None):
        self.name, self.mode, self.fail = name, mode, fail
        #: Free blocks its capacity shows; how long a "slow" stage 2 takes.
        self.free, self.slow_s = 200, 0.3
        #: Stops ignored before one counts (D ignores a Stop that comes before the search).
        self.ignored_stops = 0
        #: How long a resume runs before it answers.
        self.resume_s = 0.0
        self.requests: list[engine_pb2.Stage2Request] = []
        self.stops: list[engine_pb2.StopRequest] = []
        self._stopped: asyncio.Event | None = None

    @property
    def stopped(self) -> asyncio.Event:
        if self._stopped is None:
            self._stopped = asyncio.Event()
        return self._stopped

    async def GetCapacity(self, request, timeout=None):  # noqa: N802 (the rpc's name)
        return engine_pb2.Capacity(num_free_blocks=self.free, num_total_blocks=200,
                                   block_size=32,
                                   max_beam_width=32, engine_id=self.name,
                                   handoff_target=f"{self.name}-target")

    def Stage1(self, request, timeout=None):  # noqa: N802
        async def events():
            yield engine_pb2.Stage1Event(new_token_ids=[5, 6], engine_id=self.name)
            yield engine_pb2.Stage1Event(finish_reason="stop", engine_id=self.name,
                                         handoff=common_pb2.Handoff(
                                             request_id=request.request_id,
                                             lease_expires_at=time.time() + 30))
        return events()

    async def Stage2(self, request, timeout=None):  # noqa: N802
        self.requests.append(request)
        if request.HasField("resume"):
            await asyncio.sleep(self.resume_s)
            if self.fail is not None:
                raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "the fake refuses")
            return engine_pb2.Stage2Response(beams=BEAMS, num_imported_tokens=7,
                                             engine_id=f"{self.name}-other")
        if self.mode in ("stop", "end") and len(self.requests) == 1:
            await asyncio.wait_for(self.stopped.wait(), 5)
            if self.mode == "stop":
                return engine_pb2.Stage2Response(stopped=engine_pb2.StoppedSearch(
                    prompt_token_ids=request.prompt_token_ids, steps_done=2, members=4,
                    live=[common_pb2.Beam(token_ids=[9, 9], cum_logprob=-0.5)],
                    export=common_pb2.Handoff(request_id=request.request_id,
                                              engine_id=self.name)))
        if self.mode == "slow":
            await asyncio.sleep(self.slow_s)
        return engine_pb2.Stage2Response(beams=BEAMS)

    async def Stop(self, request, timeout=None):  # noqa: N802
        self.stops.append(request)
        if len(self.stops) > self.ignored_stops:
            self.stopped.set()
        return engine_pb2.StopResponse()


def _router(model_dir, d0: FakeEngine, d1: FakeEngine):
    from router import Endpoint, Router, RouterConfig

    decode = [Endpoint("d0", d0, None), Endpoint("d1", d1, None)]
    config = RouterConfig(prefill=("p",), decode=("d0", "d1"), model=model_dir,
                          warm_up=False)
    return Router(config, endpoints=([Endpoint("p", FakeEngine("p"), None)], decode))


def _plan(sampled_stage2: bool = False):
    from router import Plan

    plan = Plan("r", [1] * 100, [2], Stage1Params(max_tokens=10),
                BeamParams(beam_width=4, max_tokens=3), common_pb2.PATH_HANDOFF, None)
    if sampled_stage2:
        plan.stage2_sampling = Stage1Params(max_tokens=3)
    return plan


async def _run_and_move(router, plan, to: str = ""):
    """The request's run, and a Move as soon as its stage 2 reached a D: (the Outcome,
    the Move's answer or its RouterError)."""
    from router.errors import RouterError

    async def run():
        return [item async for item in router.executor.run(plan)][-1]

    await router.pool.refresh_capacity(router.pool.endpoints)  # every engine answered
    task = asyncio.ensure_future(run())
    engines = [ep.stub for ep in router.decode]
    while not any(e.requests for e in engines) and not task.done():
        await asyncio.sleep(0.001)
    try:
        answer = await router.move(plan.request_id, to=to)
    except RouterError as e:
        answer = e
    return await task, answer


def _claims(router) -> list[int]:
    return [len(ep.claims) for ep in router.decode]


def test_a_moved_search_resumes_on_the_other_d_holding_its_room_there(model_dir):
    """D0 stops the search (the Stop names D1's handoff target and the stage-2 request
    id); the run resumes it on D1 (Stage2Request.resume: the stopped search, its prompt)
    and ends with D1's beams; the Move answers d0 -> d1; the move is listed at its beam
    step; no claim is left on either D."""
    d0, d1 = FakeEngine("d0", "stop"), FakeEngine("d1", "stop")
    router = _router(model_dir, d0, d1)
    out, answer = asyncio.run(_run_and_move(router, _plan()))
    first = d0 if d0.requests and not d0.requests[0].HasField("resume") else d1
    other = d1 if first is d0 else d0
    assert (answer.from_endpoint, answer.to_endpoint) == (first.name, other.name)
    (stop,) = first.stops
    assert stop.request_ids == ["r-s2"] and stop.target_engine_id == f"{other.name}-target"
    (resume,) = other.requests
    assert resume.HasField("resume") and resume.resume.steps_done == 2
    assert list(resume.prompt_token_ids) == list(first.requests[0].prompt_token_ids)
    assert list(out.stage2.beams) == BEAMS and out.decode == other.name
    (move,) = out.moves
    assert (move.from_endpoint, move.to_endpoint, move.at_beam_step, move.reason) == (
        first.name, other.name, 2, "move")
    assert out.failed_decode is None and _claims(router) == [0, 0]


def test_a_drain_of_d_returns_once_its_search_resumes_elsewhere_and_frees_ds_room(model_dir):
    """Router.Drain of the D running a search whose resume on the other D takes 1 s: the
    drain answers before the resume ends (moved 1, empty), with no claim left on the
    drained D; the run then ends with the other D's beams and no claim at all."""
    d0, d1 = FakeEngine("d0", "stop"), FakeEngine("d1", "stop")
    d0.resume_s = d1.resume_s = 1.0
    router = _router(model_dir, d0, d1)

    async def drained_while_running():
        await router.pool.refresh_capacity(router.pool.endpoints)
        run = router.executor.run(_plan())
        task = asyncio.ensure_future(asyncio.wait_for(_last(run), 30))
        while not (d0.requests or d1.requests):
            await asyncio.sleep(0.001)
        source = next(ep for ep in router.decode if ep.stub.requests)
        summary = await router.drain(source.address, timeout_s=10)
        claims = len(source.claims)
        return summary, claims, task.done(), await task

    summary, claims, ended, out = asyncio.run(drained_while_running())
    assert (summary.moved, summary.empty, summary.failed) == (1, True, 0), summary
    assert summary.seconds < 1.0 and not ended, summary
    assert claims == 0, "the drained D's room is still claimed"
    assert list(out.stage2.beams) == BEAMS and _claims(router) == [0, 0]


async def _last(items):
    return [item async for item in items][-1]


def test_a_stop_d_ignored_is_sent_again_until_d_answers(model_dir):
    """D ignores the first two Stops (they came before the search): the desk sends it
    again until D stops the search, and the move completes."""
    d0, d1 = FakeEngine("d0", "stop"), FakeEngine("d1", "stop")
    d0.ignored_stops = d1.ignored_stops = 2
    router = _router(model_dir, d0, d1)
    out, answer = asyncio.run(_run_and_move(router, _plan()))
    first = d0 if d0.stops else d1
    assert len(first.stops) == 3 and answer.from_endpoint == first.name
    assert len(out.moves) == 1 and list(out.stage2.beams) == BEAMS
    assert _claims(router) == [0, 0]


def test_a_search_that_ends_before_the_stop_is_not_moved(model_dir):
    """The search ended on D0 before the stop took effect: FAILED_PRECONDITION, nothing
    moved, the request ends with D0's beams and the destination's claim is given back."""
    from router.errors import RouterError

    router = _router(model_dir, FakeEngine("d0", "end"), FakeEngine("d1", "end"))
    out, answer = asyncio.run(_run_and_move(router, _plan()))
    assert isinstance(answer, RouterError), answer
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "before the stop took effect" in str(answer)
    assert not out.moves and list(out.stage2.beams) == BEAMS
    assert _claims(router) == [0, 0]


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.PERMISSION_DENIED])
def test_a_destination_that_fails_the_resume_is_followed_by_a_recompute(model_dir, code):
    """D1 fails the resume: stage 2 is recomputed from its token ids (no resume, no
    handoff) on a D with room, flagged as recomputed for D1; the move stays listed."""
    d0, d1 = FakeEngine("d0", "stop", fail=code), FakeEngine("d1", "stop", fail=code)
    router = _router(model_dir, d0, d1)
    out, answer = asyncio.run(_run_and_move(router, _plan()))
    assert out.failed_decode == answer.to_endpoint and "the fake refuses" in out.handoff_failure
    recomputes = [r for e in (d0, d1) for r in e.requests if r.request_id.startswith("r-s2r")]
    (recompute,) = recomputes
    assert not recompute.HasField("resume") and not recompute.HasField("handoff")
    assert list(out.stage2.beams) == BEAMS and len(out.moves) == 1
    assert _claims(router) == [0, 0]


@pytest.mark.parametrize("finds_runs", [True, False])
def test_a_search_behind_an_address_of_several_engines_moves_where_its_stub_finds_it(
        model_dir, finds_runs):
    """One D address standing for several engines (Serve's Decode handle). Where its
    stub finds the engine running each stage 2 (``finds_runs``: ``HandleStub``), a Move
    stops the search through that address and resumes it through it too (the stub sends
    the resume to another engine), the move listing both engines. Control, a stub that
    cannot: the Move is refused (FAILED_PRECONDITION, "stands for several engines"),
    nothing stopped."""
    from router import Endpoint, Router, RouterConfig
    from router.errors import RouterError

    d = FakeEngine("d", "stop" if finds_runs else "slow")
    config = RouterConfig(prefill=("p",), decode=("serve:Decode",), model=model_dir,
                          warm_up=False)
    router = Router(config, endpoints=(
        [Endpoint("p", FakeEngine("p"), None, one_engine=False)],
        [Endpoint("serve:Decode", d, None, one_engine=False, finds_runs=finds_runs)]))
    out, answer = asyncio.run(_run_and_move(router, _plan()))
    if not finds_runs:
        assert isinstance(answer, RouterError), answer
        assert answer.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "stands for several engines" in str(answer)
        assert not d.stops and not out.moves and list(out.stage2.beams) == BEAMS
        return
    assert (answer.from_endpoint, answer.to_endpoint) == ("serve:Decode", "serve:Decode")
    (stop,) = d.stops
    assert stop.request_ids == ["r-s2"] and stop.target_engine_id == "d-target"
    first, resume = d.requests
    assert resume.HasField("resume") and resume.resume.export.engine_id == "d"
    (move,) = out.moves
    assert (move.from_engine_id, move.to_engine_id, move.at_beam_step) == ("d", "d-other", 2)
    assert list(out.stage2.beams) == BEAMS and _claims(router) == [0]


def test_a_sampled_stage_2_or_a_move_to_a_p_is_refused(model_dir):
    """A sampled stage 2 is not movable (FAILED_PRECONDITION, says why); a search moved
    to a prefill engine or to its own D is refused; nothing is stopped."""
    from router.errors import RouterError

    router = _router(model_dir, FakeEngine("d0", "slow"), FakeEngine("d1", "slow"))
    out, answer = asyncio.run(_run_and_move(router, _plan(sampled_stage2=True)))
    assert isinstance(answer, RouterError) and "samples its stage 2" in str(answer)
    for to, says in (("p", "another decode engine"), ("nowhere", "unknown engine")):
        router = _router(model_dir, FakeEngine("d0", "slow"), FakeEngine("d1", "slow"))
        out, answer = asyncio.run(_run_and_move(router, _plan(), to=to))
        assert isinstance(answer, RouterError) and says in str(answer), (to, answer)
        assert not [s for ep in router.decode for s in ep.stub.stops]


def test_a_move_with_no_other_d_with_room_or_of_a_colocated_stage_2_is_refused(model_dir):
    """No other D has room for the search (within the 2 s a move waits): FAILED_
    PRECONDITION saying so, nothing stopped; a colocated request's stage 2 (on its P):
    FAILED_PRECONDITION saying so."""
    from router.errors import RouterError

    d0, d1 = FakeEngine("d0", "slow"), FakeEngine("d1", "slow")
    d0.slow_s, d1.free = 4.0, 0
    router = _router(model_dir, d0, d1)
    out, answer = asyncio.run(_run_and_move(router, _plan()))
    assert isinstance(answer, RouterError), answer
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no other decode engine has room" in str(answer), answer
    assert not d0.stops and not out.moves and _claims(router) == [0, 0]

    router = _router(model_dir, FakeEngine("d0"), FakeEngine("d1"))
    p = router.prefill[0].stub
    p.mode = "slow"
    plan = _plan()
    plan.path = common_pb2.PATH_COLOCATED

    async def run():
        return [item async for item in router.executor.run(plan)]

    async def colocated():
        await router.pool.refresh_capacity(router.pool.endpoints)
        task = asyncio.ensure_future(run())
        while not p.requests:
            await asyncio.sleep(0.001)
        try:
            await router.move(plan.request_id)
        except RouterError as e:
            return e
        finally:
            await task

    refused = asyncio.run(colocated())
    assert isinstance(refused, RouterError) and "colocated" in str(refused), refused


def test_a_stopped_search_crosses_the_wire_exactly_and_a_bad_resume_is_refused():
    """``server.convert``: a StoppedSearch to its message and back is the same search
    (cumulative logprobs as doubles, exactly; the export's block ids and fields); a
    resume no search of the beam could have stopped is INVALID_ARGUMENT before it runs."""
    import dataclasses

    from connector.params import KEY
    from decode_engine.beam import StoppedSearch
    from kvhandoff.types import InvalidRequest
    from server.convert import check_stopped, stopped_from_pb, stopped_to_pb

    # As D's connector exports: its engine and request id travel among our fields.
    export = {"remote_block_ids": [[3, 4, 5]], "remote_host": "127.0.0.1",
              "remote_port": 5600, "tp_size": 1,
              KEY: {"engine_id": "d0", "request_id": "r-s2-s0", "num_parent_tokens": 90,
                    "target_engine_id": "d1", "signature": "s"}}
    search = StoppedSearch(prompt=[7] * 90,
                           live=[([1, 2], -0.1234567890123), ([1, 3], -2.5)],
                           completed=[([4], -0.75)], steps_done=2, members=4, export=export)
    back = stopped_from_pb(engine_pb2.StoppedSearch.FromString(
        stopped_to_pb(search).SerializeToString()))
    assert (back.prompt, back.live, back.completed, back.steps_done, back.members) == (
        search.prompt, search.live, search.completed, 2, 4)
    assert back.export["remote_block_ids"] == [[3, 4, 5]]
    assert back.export["remote_engine_id"] == "d0" and back.export["remote_port"] == 5600
    assert back.export[KEY]["target_engine_id"] == "d1" and back.export[KEY]["signature"] == "s"
    beam = BeamParams(beam_width=4, max_tokens=8)
    check_stopped(back, beam, vocab_size=100)
    for bad in (dict(steps_done=8), dict(steps_done=0), dict(members=5),
                dict(live=[([1], -0.1)]), dict(live=[([1, 200], -0.1)]),
                dict(live=[([1, 2], 0.0)] * 5)):
        with pytest.raises(InvalidRequest):
            check_stopped(dataclasses.replace(back, **bad), beam, vocab_size=100)


def test_a_search_that_ends_while_the_move_waits_for_room_is_answered_at_once(model_dir):
    """The other D has no room when the Move comes; the search ends on D0 meanwhile, then
    room shows up: the Move answers FAILED_PRECONDITION (nothing moved) at once, with no
    Stop sent, instead of stopping a search D no longer runs (it used to send Stops for
    45 s). No claim is left."""
    from router.errors import RouterError

    d0, d1 = FakeEngine("d0", "slow"), FakeEngine("d1", "slow")
    d1.free = 0
    router = _router(model_dir, d0, d1)

    async def scenario():
        async def room_later():
            await asyncio.sleep(d0.slow_s + 0.3)
            d1.free = 200
            await router.pool.refresh_capacity(router.pool.endpoints)

        later = asyncio.ensure_future(room_later())
        t0 = time.monotonic()
        out, answer = await _run_and_move(router, _plan())
        await later
        return out, answer, time.monotonic() - t0

    out, answer, seconds = asyncio.run(scenario())
    assert isinstance(answer, RouterError), answer
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION, answer
    assert seconds < 5.0, f"the Move took {seconds:.1f} s"
    assert not d0.stops and not out.moves and list(out.stage2.beams) == BEAMS
    assert _claims(router) == [0, 0]

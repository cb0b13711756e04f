"""Moving a running stage 2 (issue 59) through the router's gRPC and HTTP fronts, with
real processes: one P, two Ds and a router (``tools.launch.local_cluster(extra_decode=1)``).
A beam search (W=8, T=8) is stopped on its D after a beam step and resumed on the other
D; its beams equal the same request run colocated. The negative control resumes a stopped
search with one live beam's score changed (through the engine wire, as the router sends
it): its beams differ, so the identity check can fail. Over HTTP, a continuation's beam
search drained off its D, with a control of its own (a corrupted import, moved)."""

from __future__ import annotations

import os
import time
from typing import Any

import grpc
import pytest

from tests.utils import assert_identical, assert_servers_clean

pytestmark = [pytest.mark.engines, pytest.mark.migration, pytest.mark.timeout(900)]

W, T = 8, 8
#: Stage 1's tokens: few, so the stage 2 starts soon after the request.
S1 = 4
LEASE_S = 30
RACED = object()


@pytest.fixture(scope="module")
def two_d(model_dir, tmp_path_factory):
    """P, two Ds and a router with the HTTP front (``http``: its base URL); the engines
    take injected faults (``--fault-injection``: the HTTP test's negative control)."""
    from kvhandoff.ports import free_port
    from tests.utils import metric_sum
    from tools.launch import local_cluster

    http_port = free_port()
    with local_cluster(model_dir, tmp_path_factory.mktemp("stage2-move-logs"),
                       decode_mib=32, prefill_mib=64, lease_s=LEASE_S, extra_decode=1,
                       engine_flags=("--fault-injection",),
                       router_flags=("--http-port", str(http_port))) as cluster:
        # A D that came up after the router is warmed up in the background, taking no
        # work meanwhile (a move to it would be refused): wait for both Ds' warm-ups.
        deadline = time.monotonic() + 120
        while not all(metric_sum(cluster["router_metrics"], "kvhandoff_router_warmups_total",
                                 dest=d.address) for d in cluster["decode"]):
            dead = [str(d.log_path) for d in cluster["decode"] if d.proc.poll() is not None]
            assert not dead, f"a D exited (its log: {dead})"
            assert time.monotonic() < deadline, "the router never warmed both Ds up"
            time.sleep(0.2)
        time.sleep(0.5)  # the warm-up's end puts the D back to work just after its count
        yield {**cluster, "http": f"http://127.0.0.1:{http_port}"}


def _request(request_id: str, prompt: list[int], path: str = "handoff"):
    """Stage 1 of ``S1`` tokens with vLLM's own seeded sampling (not movable: a Move
    reaches only the stage 2), then a beam search of W, T."""
    from tools.client import make_request

    req = make_request(prompt=prompt, max_tokens=S1, seed=5, beam_width=W, beam_tokens=T,
                       path=path, request_id=request_id)
    req.stage1.min_tokens = S1
    req.stage1.positional = False
    return req


#: Move's answers while the request is not in its beam search yet: try again.
_NOT_YET = ("is not running here", "has no D yet", "positional",
            "not in its stage 2's beam search yet")


def _move_search(stub, request_id: str, call, to: str = ""):
    """Router.Move of ``request_id``'s stage 2, asked from the moment it runs (the
    request ``call`` started): its answer, or RACED when the search ended first."""
    from kvhandoff.v1 import router_pb2

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return stub.Move(router_pb2.MoveRequest(request_id=request_id, to_endpoint=to),
                             timeout=60)
        except grpc.RpcError as e:
            if "before the stop took effect" in e.details() or call.done():
                return RACED
            if not any(s in e.details() for s in _NOT_YET):
                raise
        time.sleep(0.005)
    raise AssertionError(f"{request_id}: never in its beam search")


def _decodes(two_d) -> list[str]:
    return [d.address for d in two_d["decode"]]


def _drain_where_it_runs(client, decodes: list[str], done) -> tuple[str | None, Any]:
    """Drain (then undo) the first of ``decodes`` seen running a request (polled every
    2 ms until ``done()``, at most 120 s): (that D, the Drain's answer), or (None, None)
    when the request ended first."""
    from tools.launch import pool_state

    deadline = time.monotonic() + 120
    while not done() and time.monotonic() < deadline:
        source = next((a for a in decodes if pool_state(a)[1].num_running_reqs), None)
        if source is not None:
            try:
                return source, client.drain(source, timeout_s=120)
            finally:
                client.drain(source, undo=True)
        time.sleep(0.002)
    return None, None


def test_a_running_beam_search_moved_to_the_other_d_gives_the_unmoved_beams(two_d):
    """Router.Move of a request in its beam search: D stops it after a beam step, the
    other D resumes it; Move names both Ds, the response lists the move (its beam
    step) and ends on the other D, the beams equal the colocated run's; both Ds end
    clean. A Move of the finished request: NOT_FOUND."""
    from kvhandoff.v1 import router_pb2
    from tools.client import RouterClient

    prompt = list(range(300, 380))
    with RouterClient(two_d["router"]) as client:
        ref = client.generate(_request("s2mv-ref", prompt, "colocated"), timeout=300)
        for attempt in range(3):
            rid = f"s2mv-{attempt}"
            call = client.stub.Generate.future(_request(rid, prompt), timeout=300)
            moved = _move_search(client.stub, rid, call)
            got = call.result()
            if moved is not RACED:
                break
            assert not got.moves, "Move said nothing moved, yet the search moved"
        assert moved is not RACED, "every search of 3 ended before its Move"
        with pytest.raises(grpc.RpcError) as e:
            client.stub.Move(router_pb2.MoveRequest(request_id=rid), timeout=30)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    decodes = _decodes(two_d)
    assert {moved.from_endpoint, moved.to_endpoint} == set(decodes)
    assert got.stats.decode_endpoint == moved.to_endpoint
    (move,) = got.moves
    assert (move.from_endpoint, move.to_endpoint, move.reason) == (
        moved.from_endpoint, moved.to_endpoint, "move")
    assert 1 <= move.at_beam_step < T and move.at_token == S1
    assert move.num_imported_tokens > 0 and move.num_bytes_moved > 0
    assert_identical(got, ref, imported=False)
    assert_servers_clean(two_d["decode"], 2 * LEASE_S + 5)


def test_a_drain_of_a_d_moves_its_running_beam_search_to_the_other_d(two_d):
    """Router.Drain of the D running a beam search moves it (moved 1, reason "drain"):
    the beams equal the colocated run's, and the drained D's pool is clean after."""
    from tools.client import RouterClient

    prompt = list(range(400, 480))
    decodes = _decodes(two_d)
    with RouterClient(two_d["router"]) as client:
        ref = client.generate(_request("s2dr-ref", prompt, "colocated"), timeout=300)
        # A search here lasts ~70 ms: under a busy machine a drain may come after it
        # ended (nothing to move); each attempt is a fresh request.
        for attempt in range(10):
            call = client.stub.Generate.future(_request(f"s2dr-{attempt}", prompt),
                                               timeout=300)
            source, drained = _drain_where_it_runs(client, decodes, call.done)
            got = call.result()
            if drained is not None and drained.moved:
                break
        assert drained is not None and drained.moved == 1, drained
    assert (drained.failed, drained.empty) == (0, True), drained
    (move,) = got.moves
    assert (move.from_endpoint, move.reason) == (source, "drain")
    assert move.to_endpoint == got.stats.decode_endpoint != source
    assert_identical(got, ref, imported=False)
    assert_servers_clean([s for s in two_d["decode"] if s.address == source], 2 * LEASE_S + 5)


def test_a_move_of_a_search_that_ends_before_the_stop_answers_failed_precondition(two_d):
    """A beam search of one step (T=1: step 0 only, no beam step for a stop to follow)
    asked to move while it runs: Move answers FAILED_PRECONDITION ("before the stop
    took effect"), the request ends unmoved on its D with the colocated run's beams."""
    from kvhandoff.v1 import router_pb2
    from tools.client import RouterClient

    prompt = list(range(600, 680))

    def one_step(request_id, path="handoff"):
        req = _request(request_id, prompt, path)
        req.beam.max_tokens = 1
        return req

    with RouterClient(two_d["router"]) as client:
        ref = client.generate(one_step("s2end-ref", "colocated"), timeout=300)
        refused = None
        for attempt in range(5):  # the search is short: a Move may come after its end
            rid = f"s2end-{attempt}"
            call = client.stub.Generate.future(one_step(rid), timeout=300)
            while refused is None and not call.done():
                try:
                    client.stub.Move(router_pb2.MoveRequest(request_id=rid), timeout=60)
                    raise AssertionError("a one-step search was moved")
                except grpc.RpcError as e:
                    if "before the stop took effect" in e.details():
                        refused = e
                    elif not any(s in e.details() for s in _NOT_YET):
                        raise
            got = call.result()
            if refused is not None:
                break
    assert refused is not None, "no Move of 5 reached a running one-step search"
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not got.moves and got.stats.decode_endpoint in _decodes(two_d)
    assert_identical(got, ref)
    assert_servers_clean(two_d["decode"], 2 * LEASE_S + 5)


def test_a_resumed_search_with_a_changed_beam_score_gives_other_beams(two_d):
    """The engine wire as the router uses it: D0 runs a beam search, a Stop naming D1
    stops it (Stage2 answers ``stopped``), D1 resumes it: the beams equal the unmoved
    search's. The negative control: the same flow with the best live beam's cum_logprob
    lowered by 10 in the resume gives other beams (the identity check can fail)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvhandoff.v1 import common_pb2, engine_pb2
    from tests.conftest import engine_stub

    d0, d1 = (engine_stub(a) for a in _decodes(two_d))
    target = d1.GetCapacity(engine_pb2.CapacityRequest(), timeout=30).handoff_target
    prompt = list(range(500, 590))
    beam = common_pb2.BeamSearch(beam_width=W, max_tokens=T)

    def stage2(stub, request_id, **kw):
        return stub.Stage2(engine_pb2.Stage2Request(request_id=request_id,
                                                    prompt_token_ids=prompt, beam=beam,
                                                    **kw), timeout=120)

    ref = stage2(d0, "neg-ref")

    def stopped(name):
        for attempt in range(5):  # the search is short: it may end before the stop
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(stage2, d0, f"{name}-{attempt}")
                # As the router does: D ignores a Stop that comes before the search.
                while not answer.done():
                    d0.Stop(engine_pb2.StopRequest(request_ids=[f"{name}-{attempt}"],
                                                   target_engine_id=target), timeout=30)
                    time.sleep(0.005)
                resp = answer.result()
            if resp.HasField("stopped"):
                break
            assert beams(resp) == beams(ref), "the search ended unmoved with other beams"
        assert resp.HasField("stopped") and not resp.beams, "5 searches ended before the stop"
        assert 1 <= resp.stopped.steps_done < T
        return resp.stopped

    def beams(resp):
        return [list(b.token_ids) for b in resp.beams]

    same = stage2(d1, "neg-resumed", resume=stopped("neg-a"))
    assert beams(same) == beams(ref)
    tampered = stopped("neg-b")
    tampered.live[0].cum_logprob -= 10.0  # NEGATIVE CONTROL: a wrong score moved over
    other = stage2(d1, "neg-tampered", resume=tampered)
    assert beams(other) != beams(ref)
    assert_servers_clean(two_d["decode"], 2 * LEASE_S + 5)


#: The HTTP test's beam search: longer than W, T above (a drain must find it running).
HTTP_W, HTTP_T = 8, 48


def _http_drained(two_d, prompt: list[int], seed: int, fault: str | None = None):
    """Over the HTTP front: a parent (stage 1 of ``S1`` tokens), then its continuation
    with beam search (HTTP_W, HTTP_T) while the test drains the D that runs it (polled
    until it runs a request; that D is put back after). Returns (parent, beams, the
    Drain's answer, the drained D), or None for the drain when the search ended
    first."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tools.client import RouterClient

    client = openai.OpenAI(base_url=two_d["http"] + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    model = client.models.list().data[0].id
    parent = client.completions.create(model=model, prompt=prompt, max_tokens=S1, seed=seed,
                                       temperature=1.0)
    with ThreadPoolExecutor(1) as pool, RouterClient(two_d["router"]) as grpc_client:
        answer = pool.submit(client.completions.create, model=model, prompt="",
                             max_tokens=HTTP_T, n=HTTP_W, extra_body={
                                 "use_beam_search": True, "continuation_of": parent.id,
                                 **({"fault": fault} if fault else {})})
        source, drained = _drain_where_it_runs(grpc_client, _decodes(two_d), answer.done)
        beams = answer.result()
        assert grpc_client.release_parent(parent.id).hold_ended
    return parent, beams, drained, source


def test_an_http_continuation_drained_off_its_d_gives_the_unmoved_beams(two_d):
    """The OpenAI-compatible HTTP front: a parent, then its continuation's beam search,
    moved to the other D by Router.Drain of its D while it runs. The answer lists the
    move (``kvhandoff.moves``: from the drained D to the other, at a beam step, reason
    "drain"), names the other D as its decode_endpoint, and its beams equal the
    colocated run's. NEGATIVE CONTROL: the same with block 0 of D's import zeroed
    (``zero-block``, a fresh prompt): moved the same way (the other D reads D's KV as D
    holds it), its beams fail the same check."""
    from tests.utils import assert_http_identical
    from tools.client import RouterClient, make_request

    decodes = _decodes(two_d)

    def reference(prompt, seed):
        with RouterClient(two_d["router"]) as client:
            return client.generate(make_request(
                prompt=prompt, max_tokens=S1, seed=seed, beam_width=HTTP_W,
                beam_tokens=HTTP_T, path="colocated"), timeout=300)

    for prompt, seed, fault in ((list(range(700, 780)), 7, None),
                                (list(range(800, 880)), 8, "zero-block")):
        ref = reference(prompt, seed)
        for _ in range(3):  # a busy machine may end the search before the drain
            parent, beams, drained, source = _http_drained(two_d, prompt, seed, fault)
            if drained is not None and drained.moved:
                break
        assert drained is not None and drained.moved == 1, drained
        assert (drained.failed, drained.empty) == (0, True), drained
        info = beams.model_extra["kvhandoff"]
        (move,) = info["moves"]
        assert (move["from_endpoint"], move["reason"]) == (source, "drain"), move
        assert move["to_endpoint"] == info["decode_endpoint"] == next(
            a for a in decodes if a != source)
        assert 1 <= move["at_beam_step"] < HTTP_T and move["num_bytes_moved"] > 0, move
        if fault is None:
            assert_http_identical(parent, beams, ref, moved=True)
        else:
            with pytest.raises(AssertionError, match="cum_logprob|beams differ"):
                assert_http_identical(parent, beams, ref, moved=True)
    assert_servers_clean(two_d["decode"], 2 * LEASE_S + 5)


def test_the_benchs_d_drain_moves_every_search_with_the_waited_beams(two_d):
    """``kvhandoff bench --moves``' stage-2 part, small (2 searches, W=8, T=48): waited
    for, then drained off D to D': every search moved, none recomputed, the beams the
    same both times, the drained D empty when the Drain returns."""
    import random

    from tools.bench.moves import run_search_drains

    d, d2 = _decodes(two_d)
    result = run_search_drains(two_d["router"], d, d2, requests=2, prompt_tokens=64,
                               rng=random.Random(59), width=HTTP_W, tokens=HTTP_T)
    wait, drain = result["rows"]
    assert (wait["moved"], drain["moved"]) == (0, 2), result
    assert wait["recomputed"] == drain["recomputed"] == 0, result
    assert result["identical"], result
    assert drain["d_empty_s"] <= drain["drain_call_s"] + 0.5, result
    assert_servers_clean(two_d["decode"], 2 * LEASE_S + 5)


#: The load with drains: KVHANDOFF_MOVE_LOAD_REQUESTS at KVHANDOFF_MOVE_LOAD_CONCURRENCY
#: (CI: 48 at 8; the issue's full size: 500 at 32).
LOAD_REQUESTS = int(os.environ.get("KVHANDOFF_MOVE_LOAD_REQUESTS", "48"))
LOAD_CONCURRENCY = int(os.environ.get("KVHANDOFF_MOVE_LOAD_CONCURRENCY", "8"))
#: Requests compared with their colocated run (every LOAD_SAMPLE-th).
LOAD_SAMPLE = 6


def test_load_while_a_d_is_drained_and_brought_back_twice(two_d):
    """LOAD_REQUESTS two-stage requests at LOAD_CONCURRENCY while one D is drained (its
    running beam searches moved to the other D) and put back, twice: every request
    answered, none recomputed, the sampled ones (and moved ones) identical to their
    colocated runs, each drain found work on the D, returned with none left there and
    the D's pool clean, and both Ds clean at the end."""
    import random
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvhandoff.v1 import router_pb2
    from tools.client import RouterClient
    from tools.launch import wait_pool_clean

    rng = random.Random(59)
    prompts = [[rng.randrange(300, 900) for _ in range(rng.randrange(60, 160))]
               for _ in range(LOAD_REQUESTS)]
    drained = two_d["decode"][0].address
    done = [0]
    lock = threading.Lock()
    drains: list[tuple[object, bool]] = []

    def one(i: int):
        with RouterClient(two_d["router"]) as client:
            got = client.generate(_request(f"s2load-{i}", prompts[i]), timeout=600)
        with lock:
            done[0] += 1
        return got

    def drain_twice():
        with RouterClient(two_d["router"]) as client:
            for at in (0.2, 0.6):
                while done[0] < at * LOAD_REQUESTS:
                    time.sleep(0.01)
                summary = client.stub.Drain(router_pb2.DrainRequest(endpoint=drained),
                                            timeout=300)
                clean, _ = wait_pool_clean(drained, 5.0)
                drains.append((summary, clean))
                client.stub.Drain(router_pb2.DrainRequest(endpoint=drained, undo=True),
                                  timeout=60)

    drainer = threading.Thread(target=drain_twice)
    drainer.start()
    with ThreadPoolExecutor(LOAD_CONCURRENCY) as pool:
        results = list(pool.map(one, range(LOAD_REQUESTS)))
    drainer.join(timeout=600)
    assert len(drains) == 2, "the drains did not both run"
    for summary, clean in drains:
        assert summary.empty and not summary.failed, summary
        assert clean, f"{drained} kept blocks after its drain: {summary}"
    # The drains found work on the D: searches moved, or ended before their stop (the
    # built-in model's searches last ~70 ms; a move first claims room on the other D).
    assert sum(s.moved + s.finished_in_place for s, _ in drains), f"idle drains: {drains}"
    print(f"load with drains: {LOAD_REQUESTS} requests at {LOAD_CONCURRENCY}; drains "
          + "; ".join(f"moved {s.moved}, in place {s.finished_in_place}, failed {s.failed}, "
                      f"{s.seconds:.2f} s" for s, _ in drains)
          + f"; {sum(1 for r in results if r.moves)} requests moved")
    assert not [r.request_id for r in results if r.stats.recomputed], "recomputed"
    moved = [i for i, r in enumerate(results) if r.moves]
    with RouterClient(two_d["router"]) as client:
        for i in range(0, LOAD_REQUESTS, LOAD_SAMPLE):
            ref = client.generate(_request(f"s2load-ref-{i}", prompts[i], "colocated"),
                                  timeout=300)
            assert_identical(results[i], ref, imported=not results[i].moves)
        for i in moved[:LOAD_SAMPLE]:  # the moved ones, each against its colocated run
            ref = client.generate(_request(f"s2load-mref-{i}", prompts[i], "colocated"),
                                  timeout=300)
            assert_identical(results[i], ref, imported=False)
    assert_servers_clean(two_d["decode"], 2 * LEASE_S + 5)

"""Continuations of a named parent: P holds a parent's exported blocks for its whole lease
(``hold``), so several continuations import it, and frees them when the lease ends. Real
engines, real NIXL."""

from __future__ import annotations

import time

import pytest

from connector.handoff import ImportRequest
from decode_engine.engine import run_beam_stage
from tests.conftest import FAMILY_LEASE_S, FAMILY_PARENT_HOLD_S, LEASE_S
from tests.utils import (
    RACED,
    assert_http_identical,
    assert_identical,
    assert_idle_within,
    long_stage1_request,
    make_request,
    metric_sum,
    move_or_raced,
)
from tools.harness import LOGPROB_TOLERANCE

pytestmark = pytest.mark.engines


def _parent(pair, run, request_id: str, *, hold: bool):
    req = make_request(pair, request_id=request_id, prompt_len=150)
    s1 = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, f"{request_id}-p",
                               export=True, hold=hold))
    prompt = req.prompt_token_ids + s1.token_ids + req.suffix_token_ids
    return req, s1, prompt


def _import(pair, run, req, s1, prompt, request_id: str):
    return run(pair.d.run_stage2(prompt, req.beam, request_id,
                                 handoff=ImportRequest.for_beams(s1.handoff_params, req.beam)))


def _assert_same_beams(got, ref) -> None:
    """Engine-level stage 2s: the beams' token ids in order and their cumulative
    logprobs within the harness's bound (``ref`` computed the parent itself)."""
    from tools.harness import LOGPROB_TOLERANCE

    assert [b.token_ids for b in got.beams] == [b.token_ids for b in ref.beams]
    for a, b in zip(got.beams, ref.beams):
        assert abs(a.cum_logprob - b.cum_logprob) <= LOGPROB_TOLERANCE, (a, b)


def test_a_held_parent_serves_several_continuations_and_is_freed_at_lease_end(
        pair, run, assert_pools_clean):
    req, s1, prompt = _parent(pair, run, "held", hold=True)
    exported_at = time.monotonic()
    reference = run(run_beam_stage(pair.d, prompt, req.beam, "held-ref"))
    results = []
    for i in range(3):
        # D's cache emptied: every continuation reads the whole parent from P again.
        run(pair.d.empty_prefix_cache())
        results.append(_import(pair, run, req, s1, prompt, f"held-c{i}"))
        assert pair.p.pool().num_used_blocks > 0, "P freed a held parent before its lease"
    for r in results:
        assert r.num_imported_tokens == len(prompt) - len(req.suffix_token_ids) - 1
        _assert_same_beams(r, reference)
    assert time.monotonic() - exported_at < LEASE_S
    # The lease ends: P frees the blocks on its own.
    snap = run(pair.p.wait_pool_clean(LEASE_S + 5.0))
    assert snap.is_clean, snap
    assert_pools_clean()


def test_a_parent_held_for_a_shorter_time_than_the_lease_is_freed_then(pair, run,
                                                                       assert_pools_clean):
    """``hold`` in seconds (the router's --parent-hold-s): the handoff's lease says so,
    a continuation within it imports, and P frees the blocks then, not at P's lease."""
    req = make_request(pair, request_id="short-hold", prompt_len=150)
    s1 = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, "short-hold-p",
                               export=True, hold=5.0))
    exported_at = time.time()
    prompt = req.prompt_token_ids + s1.token_ids + req.suffix_token_ids
    lease = s1.handoff_params["kvhandoff"]["lease_expires_at"] - exported_at
    assert 4.0 < lease <= 5.0, lease
    run(pair.d.empty_prefix_cache())
    r = _import(pair, run, req, s1, prompt, "short-hold-c0")
    assert r.num_imported_tokens > 0
    snap = run(pair.p.wait_pool_clean(LEASE_S))
    assert snap.is_clean, snap
    assert time.time() - exported_at < LEASE_S - 2  # the hold's end, not P's lease
    assert_pools_clean()


def test_without_hold_p_frees_the_parent_after_the_first_read(pair, run, assert_pools_clean):
    """The control: the same flow without ``hold`` frees P's blocks once D has read them,
    long before the lease ends (so the hold is what keeps them)."""
    req, s1, prompt = _parent(pair, run, "unheld", hold=False)
    exported_at = time.monotonic()
    run(pair.d.empty_prefix_cache())
    r = _import(pair, run, req, s1, prompt, "unheld-c0")
    assert r.num_imported_tokens > 0
    snap = run(pair.p.wait_pool_clean(LEASE_S / 2))
    assert snap.is_clean, f"P still holds the parent after D read it: {snap}"
    assert time.monotonic() - exported_at < LEASE_S - 2  # well before the lease end
    assert_pools_clean()


def _flush_cache(engine, run) -> None:
    """Push every free block of ``engine``'s pool out of its prefix cache: distinct
    prompts (one token sampled each) whose blocks add up to more than the pool. vLLM's
    own reset refuses while any block is held, so pressure is the flush a held parent
    meets in service."""
    import random

    from kvhandoff.types import Stage1Params

    rng = random.Random(f"flush/{time.monotonic()}")
    length = min(engine.max_model_len - 1, 32 * engine.block_size)
    rounds = -(-engine.num_total_blocks * engine.block_size // length) + 2
    for i in range(rounds):
        prompt = [rng.randrange(6, engine.vocab_size) for _ in range(length)]
        run(engine.run_stage1(prompt, Stage1Params(max_tokens=1, seed=0), f"flush-{i}",
                              export=False))


def test_a_parent_held_on_its_own_engine_computes_only_the_suffix_after_a_flush(
        pair, run, assert_pools_clean):
    """The one-engine path: ``hold`` without export keeps the parent on P (not left to
    the prefix cache), so its continuation on P computes ``len(suffix) + 1`` tokens even
    after the cache was flushed. The control: the same parent not held, the same flush,
    recomputed whole, and both give the same beams."""
    req = make_request(pair, request_id="local", prompt_len=150)
    s1 = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, "local-unheld",
                               export=False))
    assert s1.held_until == 0.0
    prompt = req.prompt_token_ids + s1.token_ids + req.suffix_token_ids
    _flush_cache(pair.p, run)
    control = run(run_beam_stage(pair.p, prompt, req.beam, "local-unheld-c",
                                 held_parent="local-unheld"))
    assert control.num_computed_tokens_first_step == len(prompt), "the flush left a cache hit"

    held = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, "local-held",
                                 export=False, hold=6.0))
    assert held.token_ids == s1.token_ids
    assert 5.0 < held.held_until - time.time() <= 6.0
    _flush_cache(pair.p, run)
    results = [run(run_beam_stage(pair.p, prompt, req.beam, f"local-held-c{i}",
                                  held_parent="local-held")) for i in range(2)]
    for r in results:
        assert r.num_computed_tokens_first_step == len(req.suffix_token_ids) + 1
        _assert_same_beams(r, control)
    assert pair.p.pool().num_used_blocks > 0, "P freed the held parent before its hold"
    # The hold ends: P frees the blocks on its own.
    snap = run(pair.p.wait_pool_clean(10.0))
    assert snap.is_clean, snap
    assert_pools_clean()


def test_a_sampled_continuation_equals_vllms_own_sampling_of_the_whole_prompt(
        pair, run, assert_pools_clean):
    """A continuation that samples (its own seed and parameters), imported on D and
    from a parent held on P, equals vLLM's plain ``generate`` of parent + suffix with the
    same SamplingParams on P (no kvhandoff parameters). Control: another seed differs."""
    from vllm import SamplingParams

    from decode_engine.engine import run_sample_stage
    from kvhandoff.types import BeamParams, Stage1Params

    sampling = Stage1Params(max_tokens=12, temperature=1.0, top_k=50, seed=11,
                            stop_token_ids=(), ignore_eos=True)
    req, s1, prompt = _parent(pair, run, "sampled", hold=True)
    shape = BeamParams(beam_width=1, max_tokens=sampling.max_tokens)
    run(pair.d.empty_prefix_cache())
    on_d = run(pair.d.run_stage2(prompt, shape, "sampled-d",
                                 handoff=ImportRequest.for_beams(s1.handoff_params, shape),
                                 sampling=sampling))
    assert on_d.num_imported_tokens == len(prompt) - len(req.suffix_token_ids) - 1
    assert on_d.num_computed_tokens_first_step == len(req.suffix_token_ids) + 1
    local = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, "sampled-local",
                                  export=False, hold=6.0))
    on_p = run(run_sample_stage(pair.p, prompt, sampling, "sampled-p",
                                held_parent="sampled-local"))
    theirs = run(pair.p.generate(prompt, SamplingParams(
        max_tokens=12, temperature=1.0, top_k=50, seed=11, ignore_eos=True, detokenize=False),
        "sampled-ref"))
    ref = list(theirs.outputs[0].token_ids)
    assert len(ref) == 12 and local.token_ids == s1.token_ids
    assert on_d.beams[0].token_ids == ref and on_p.beams[0].token_ids == ref
    assert on_d.beams[0].cum_logprob == pytest.approx(on_p.beams[0].cum_logprob,
                                                      abs=LOGPROB_TOLERANCE)
    other = run(run_sample_stage(pair.p, prompt, Stage1Params(
        max_tokens=12, temperature=1.0, top_k=50, seed=12, stop_token_ids=(), ignore_eos=True),
        "sampled-o"))
    assert other.beams[0].token_ids != ref, "another seed gave the same tokens"
    assert_pools_clean()


# ---- through the router: StartParent, then Continue ------------------------------------

@pytest.fixture
def family_clean(family):
    from tests.utils import HELD_PARENTS, assert_servers_clean

    yield
    HELD_PARENTS.release_all()
    assert_servers_clean([family["prefill"], *family["decode"]], 2 * FAMILY_LEASE_S + 5.0)


def _stub(address: str):
    import grpc

    from kvhandoff.v1 import router_pb2_grpc

    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(address))
    stub.address = address  # where _start_parent's parents are released
    return stub


def _parent_request(request_id: str, *, seed: int = 3, max_tokens: int = 24,
                    min_tokens: int = 0, prompt_len: int = 120):
    import random

    from kvhandoff.v1 import router_pb2

    rng = random.Random(request_id)
    req = router_pb2.ParentRequest(request_id=request_id)
    req.prompt_token_ids.ids.extend(rng.randrange(10, 1000) for _ in range(prompt_len))
    req.stage1.max_tokens, req.stage1.temperature, req.stage1.seed = max_tokens, 1.0, seed
    req.stage1.min_tokens = min_tokens
    return req


def _start_parent(stub, req, timeout: float = 120):
    """(stage-1 token batches, the Parent), the parent released at the test's end."""
    from tests.utils import HELD_PARENTS

    batches, parent = [], None
    for event in stub.StartParent(req, timeout=timeout):
        if event.HasField("stage1_tokens"):
            batches.append(list(event.stage1_tokens.ids))
        else:
            parent = event.parent
    if parent is not None:
        HELD_PARENTS.add(stub.address, parent.parent_id)
    return batches, parent


def _continue(stub, parent_id: str, *, beam_width: int = 4, strict: bool = False,
              suffix_ids: list[int] | None = None, timeout: float = 120, **kw):
    from kvhandoff.v1 import router_pb2

    req = router_pb2.ContinueRequest(parent_id=parent_id, strict=strict, **kw)
    req.beam.beam_width, req.beam.max_tokens = beam_width, 3
    if suffix_ids is not None:
        req.suffix_token_ids.ids.extend(suffix_ids)
    return stub.Continue(req, timeout=timeout)


def test_continuations_import_a_held_parent_and_equal_the_one_shot(family, family_clean):
    """Three continuations of one held parent (two with the default suffix, one with its
    own) each import it and equal the same request run colocated (stage 1, beams and
    their cumulative logprobs): the first reads the whole parent on a cold D, the later
    ones only what D's prefix cache lacks."""
    from tools.client import RouterClient, make_request

    stub = _stub(family["router"])
    preq = _parent_request("fam-parent")
    batches, parent = _start_parent(stub, preq)
    assert parent.held and not parent.not_held_reason, parent.not_held_reason
    assert sum(batches, []) == list(parent.thinking_token_ids) and parent.parent_id == "fam-parent"
    first = _continue(stub, parent.parent_id)
    again = _continue(stub, parent.parent_id)
    other = _continue(stub, parent.parent_id, suffix_ids=[5, 6, 7])
    # The one-shot references on one engine (same seed: same stage 1).
    with RouterClient(family["router"]) as client:
        ref, ref_other = [client.generate(make_request(
            prompt=list(preq.prompt_token_ids.ids), max_tokens=24, seed=3, beam_width=4,
            suffix=suffix, path="colocated")) for suffix in (None, [5, 6, 7])]
    assert list(parent.thinking_token_ids) == list(ref.thinking_token_ids)
    for resp in (first, again, other):
        assert resp.parent_id == "fam-parent"
    assert_identical(first, ref)
    assert_identical(again, ref, found_on_d=True)
    assert_identical(other, ref_other, found_on_d=True)
    num_parent = len(preq.prompt_token_ids.ids) + len(parent.thinking_token_ids)
    assert first.stats.num_parent_tokens == num_parent
    assert first.stats.num_imported_tokens == num_parent - 1  # a cold D reads it all
    # The second on the same D reads only what its prefix cache lacks.
    a = again.stats
    assert a.num_found_on_d_tokens > 0 and a.num_imported_tokens < num_parent - 1
    assert (a.num_imported_tokens + a.num_found_on_d_tokens + a.num_computed_tokens_first_step
            == num_parent + len(again.suffix_token_ids))
    assert list(other.suffix_token_ids) == [5, 6, 7]


def test_unknown_parents_and_other_models_are_refused_with_the_reason(family, family_clean):
    import grpc

    stub = _stub(family["router"])
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, "never-served")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "never-served" in e.value.details()
    _, parent = _start_parent(stub, _parent_request("fam-model"))
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, parent.parent_id, model="another-model")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another-model" in e.value.details()
    assert not _continue(stub, parent.parent_id, model=parent.model).stats.recomputed


def test_a_continuation_of_a_running_parent_waits_for_it(family, family_clean):
    """A continuation sent while its parent's stage 1 runs waits for it, then imports
    and equals the same request run colocated."""
    import threading

    from tests.utils import HELD_PARENTS
    from tools.client import RouterClient

    stub = _stub(family["router"])
    first_tokens = threading.Event()
    result: dict[str, object] = {}

    def parent():
        for event in stub.StartParent(_parent_request("fam-running", max_tokens=150,
                                                      min_tokens=150), timeout=120):
            if event.HasField("stage1_tokens"):
                first_tokens.set()
            else:
                result["parent"] = event.parent

    t = threading.Thread(target=parent)
    t.start()
    assert first_tokens.wait(60)
    resp = _continue(stub, "fam-running")  # sent while stage 1 runs
    t.join()
    HELD_PARENTS.add(family["router"], "fam-running")
    assert "parent" in result and len(resp.thinking_token_ids) == 150
    with RouterClient(family["router"]) as client:
        ref = client.generate(long_stage1_request(
            list(_parent_request("fam-running").prompt_token_ids.ids), 150, seed=3,
            beam_width=4, path="colocated"))
    assert_identical(resp, ref)


def test_a_released_parent_frees_ps_blocks_at_once_and_is_then_unknown(family,
                                                                      family_clean):
    """Router.ReleaseParent on an exported parent and on one P holds for itself
    (colocated): P's pool is clean within 3 s (its lease is 12 s: without the Release the
    check fails), later continuations and a second release are NOT_FOUND, a parent whose
    stage 1 runs is FAILED_PRECONDITION, and the router counts the releases."""
    import threading

    import grpc

    from kvhandoff.v1 import common_pb2
    from tools.client import RouterClient
    from tools.launch import wait_pool_clean

    stub = _stub(family["router"])
    p = family["prefill"]
    metrics = family["router_metrics"]
    before = metric_sum(metrics, "kvhandoff_router_parent_evictions_total", reason="client")
    exported = _parent_request("fam-release-x")
    local = _parent_request("fam-release-l")
    local.path = common_pb2.PATH_COLOCATED
    with RouterClient(family["router"]) as client:
        for req in (exported, local):
            _, parent = _start_parent(stub, req)
            assert parent.held, parent.not_held_reason
            assert not wait_pool_clean(p.address, 0.5)[0], "P holds nothing for the parent"
            assert client.release_parent(parent.parent_id).hold_ended
            clean, cap = wait_pool_clean(p.address, 3.0)
            assert clean, f"P still holds the released parent: {cap}"
            with pytest.raises(grpc.RpcError) as e:
                _continue(stub, parent.parent_id)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                client.release_parent(parent.parent_id)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value.details()
        started = threading.Event()

        def running():
            for _ in stub.StartParent(_parent_request("fam-release-run", max_tokens=150,
                                                      min_tokens=150), timeout=120):
                started.set()

        t = threading.Thread(target=running)
        t.start()
        assert started.wait(60)
        with pytest.raises(grpc.RpcError) as e:
            client.release_parent("fam-release-run")
        t.join()
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "stage 1 still runs" in e.value.details()
        assert client.release_parent("fam-release-run").hold_ended
    assert metric_sum(metrics, "kvhandoff_router_parent_evictions_total",
                      reason="client") - before == 3


def test_a_parent_p_does_not_hold_is_recomputed_or_refused_when_strict(family, family_clean):
    import grpc

    stub = _stub(family["noshare"])
    _, parent = _start_parent(stub, _parent_request("fam-noshare"))
    assert not parent.held and "share" in parent.not_held_reason
    resp = _continue(stub, parent.parent_id)
    assert resp.stats.recomputed and "not held" in resp.stats.handoff_failure
    assert resp.stats.num_imported_tokens == 0
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, parent.parent_id, strict=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "share" in e.value.details()


def test_on_one_engine_p_holds_the_parent_and_the_continuation_computes_the_suffix(
        family, family_clean):
    """``PATH_COLOCATED`` on the full router, and a router with P alone: P holds the
    parent itself, the continuation runs on P and computes ``len(suffix) + 1`` tokens
    (after a flush too: the engine-level test above), equal to the one-shot run
    colocated (stage 1, beams and their cumulative logprobs)."""
    from kvhandoff.v1 import common_pb2
    from tools.client import RouterClient, make_request

    preq = _parent_request("fam-local")
    with RouterClient(family["router"]) as client:
        ref = client.generate(make_request(prompt=list(preq.prompt_token_ids.ids),
                                           max_tokens=24, seed=3, beam_width=4,
                                           path="colocated"))
    for name, path in (("router", common_pb2.PATH_COLOCATED), ("solo", common_pb2.PATH_AUTO)):
        stub = _stub(family[name])
        req = _parent_request(f"fam-local-{name}")
        req.prompt_token_ids.ids[:] = preq.prompt_token_ids.ids
        req.path = path
        _, parent = _start_parent(stub, req)
        assert parent.held and parent.prefill_endpoint == family["prefill"].address, \
            parent.not_held_reason
        assert parent.lease_expires_at > time.time()
        for _ in range(2):
            resp = _continue(stub, parent.parent_id)
            s = resp.stats
            assert not s.recomputed and s.path == common_pb2.PATH_COLOCATED, s.handoff_failure
            assert s.decode_endpoint == family["prefill"].address
            assert s.num_computed_tokens_first_step == len(resp.suffix_token_ids) + 1
            # Stage 2 on the P holding the parent: no handoff to import.
            assert_identical(resp, ref, imported=False)


def test_sampled_continuations_are_the_same_imported_held_on_p_and_recomputed(
        family, family_clean):
    """A continuation with its own sampling parameters and seed: imported on D, from a
    parent P holds itself, and recomputed (a parent not held: the recompute and its
    reason asserted) give the same tokens and cumulative logprob as the one on P (its
    path asserted colocated); the HTTP front's sampled continuation (no use_beam_search)
    too. Another seed differs."""
    import openai

    from kvhandoff.v1 import common_pb2
    from tests.utils import HELD_PARENTS

    def sampled(stub, parent_id, seed=21):
        from kvhandoff.v1 import router_pb2

        req = router_pb2.ContinueRequest(parent_id=parent_id)
        req.sampling.max_tokens, req.sampling.temperature = 10, 1.0
        req.sampling.seed, req.sampling.ignore_eos = seed, True
        return stub.Continue(req, timeout=120)

    runs = {}
    for name, path in (("router", common_pb2.PATH_AUTO), ("router", common_pb2.PATH_COLOCATED),
                       ("noshare", common_pb2.PATH_AUTO)):
        stub = _stub(family[name])
        req = _parent_request(f"fam-sampled-{name}-{path}", seed=5)
        req.prompt_token_ids.ids[:] = _parent_request("fam-sampled", seed=5).prompt_token_ids.ids
        req.path = path
        _, parent = _start_parent(stub, req)
        resp = sampled(stub, parent.parent_id)
        assert len(resp.beams) == 1 and len(resp.beams[0].token_ids) == 10
        runs[(name, path)] = resp
    imported, local, recomputed = runs.values()
    assert imported.stats.num_imported_tokens > 0 and not imported.stats.recomputed
    assert local.stats.path == common_pb2.PATH_COLOCATED and not local.stats.recomputed
    assert local.stats.num_computed_tokens_first_step == len(local.suffix_token_ids) + 1
    assert local.stats.decode_endpoint == family["prefill"].address
    assert recomputed.stats.recomputed and recomputed.stats.handoff_failure.startswith(
        "parent not held: the share of P's pool for held parents is full"), \
        recomputed.stats.handoff_failure
    tokens = list(local.beams[0].token_ids)
    for resp in (imported, recomputed):
        assert list(resp.beams[0].token_ids) == tokens
        assert abs(resp.beams[0].cum_logprob - local.beams[0].cum_logprob) \
            <= LOGPROB_TOLERANCE, (resp.beams[0].cum_logprob, local.beams[0].cum_logprob)
    client = openai.OpenAI(base_url=f"{family['http']}/v1", api_key="none")
    model = client.models.list().data[0].id
    parent = client.completions.create(model=model, prompt=list(_parent_request(
        "fam-sampled", seed=5).prompt_token_ids.ids), max_tokens=24, temperature=1.0, seed=5)
    HELD_PARENTS.add(family["router"], parent.id)  # the HTTP front's router
    via_http = client.completions.create(
        model=model, prompt="", max_tokens=10, temperature=1.0, seed=21,
        extra_body={"continuation_of": parent.id, "ignore_eos": True})
    assert via_http.choices[0].model_extra["token_ids"] == tokens
    assert not via_http.model_extra["kvhandoff"]["recomputed"], via_http.model_extra
    assert via_http.usage.prompt_tokens_details.model_extra["imported_tokens"] > 0
    assert abs(via_http.choices[0].model_extra["cumulative_logprob"]
               - local.beams[0].cum_logprob) <= LOGPROB_TOLERANCE
    other = sampled(_stub(family["router"]), parent.id, seed=22)
    assert list(other.beams[0].token_ids) != tokens, "another seed gave the same tokens"


def test_after_the_lease_a_continuation_is_recomputed_with_the_same_beams(family, family_clean):
    """Within P's lease a continuation imports; after it, one is recomputed, flagged
    that P's lease ended, and both equal the same request run colocated; a strict one
    is refused."""
    import grpc

    from tools.client import RouterClient, make_request

    stub = _stub(family["router"])
    preq = _parent_request("fam-late")
    _, parent = _start_parent(stub, preq)
    held = _continue(stub, parent.parent_id)
    with RouterClient(family["router"]) as client:
        ref = client.generate(make_request(prompt=list(preq.prompt_token_ids.ids),
                                           max_tokens=24, seed=3, beam_width=4,
                                           path="colocated"))
    assert_identical(held, ref)
    time.sleep(max(0.0, parent.lease_expires_at - time.time()) + 0.5)
    late = _continue(stub, parent.parent_id)
    assert_identical(late, ref,
                     recomputed_for="parent not held: P's lease on its blocks has ended")
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, parent.parent_id, strict=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_the_routers_parent_hold_frees_p_before_its_lease_and_then_recomputes(
        family, family_clean):
    """The router's ``--parent-hold-s`` (``hold``: FAMILY_PARENT_HOLD_S, below P's
    FAMILY_LEASE_S): the parent's lease ends at the hold, a continuation within it imports
    and equals the same request run colocated, and P keeps the blocks after that read;
    P's pool is clean once the hold ends, seconds before P's own lease would end; a
    continuation after it is recomputed, flagged that the lease ended, with the same
    output, and over the HTTP front a strict one is 412 and a lenient one says
    ``recomputed`` and why (README). A router that ignored the flag (P holding for its
    lease) fails the lease, the clean pool's time and the recompute."""
    import openai

    from tools.client import RouterClient, make_request
    from tools.launch import wait_pool_clean

    p = family["prefill"]
    stub = _stub(family["hold"])
    preq = _parent_request("fam-hold")
    with RouterClient(family["router"]) as client:
        ref = client.generate(make_request(prompt=list(preq.prompt_token_ids.ids),
                                           max_tokens=24, seed=3, beam_width=4,
                                           path="colocated"))
    _, parent = _start_parent(stub, preq)
    exported_by = time.time()
    assert parent.held, parent.not_held_reason
    lease = parent.lease_expires_at - exported_by
    assert FAMILY_PARENT_HOLD_S - 2.0 < lease <= FAMILY_PARENT_HOLD_S, \
        f"the parent's lease ends in {lease:.1f} s, not at the router's hold"
    within = _continue(stub, parent.parent_id)
    assert_identical(within, ref)
    assert not wait_pool_clean(p.address, 0.5)[0], "P freed the parent after one read"
    clean, cap = wait_pool_clean(p.address, FAMILY_LEASE_S)
    assert clean, f"P still holds the parent: {cap}"
    assert time.time() < exported_by + FAMILY_LEASE_S - 2, \
        "P freed the parent at its own lease's end, not at the router's hold"
    reason = "parent not held: P's lease on its blocks has ended"
    late = _continue(stub, parent.parent_id)
    assert_identical(late, ref, recomputed_for=reason)
    client = openai.OpenAI(base_url=f"{family['hold_http']}/v1", api_key="unused",
                           max_retries=0)
    model = client.models.list().data[0].id
    body = {"use_beam_search": True, "continuation_of": parent.parent_id}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=model, prompt="", max_tokens=3, n=4,
                                  extra_body={**body, "continuation_strict": True})
    assert e.value.status_code == 412, e.value
    assert "P's lease on its blocks has ended" in e.value.body["message"], e.value.body
    lenient = client.completions.create(model=model, prompt="", max_tokens=3, n=4,
                                        extra_body=body)
    info = lenient.model_extra["kvhandoff"]
    assert info["recomputed"] and info["handoff_failure"].startswith(reason), info
    assert [c.model_extra["token_ids"] for c in lenient.choices] == \
        [list(b.token_ids) for b in ref.beams]
    for c, b in zip(lenient.choices, ref.beams):
        assert abs(c.model_extra["cumulative_logprob"] - b.cum_logprob) <= LOGPROB_TOLERANCE


def test_the_registry_forgets_the_least_recently_used_and_the_expired(family, family_clean):
    import grpc

    def evictions() -> dict[str, float]:
        return {reason: metric_sum(family["small_metrics"],
                                   "kvhandoff_router_parent_evictions_total", reason=reason)
                for reason in ("lru", "ttl")}

    stub = _stub(family["small"])
    before = evictions()
    for name in ("fam-a", "fam-b", "fam-c"):  # holds two: fam-a goes
        _start_parent(stub, _parent_request(name, max_tokens=4))
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, "fam-a")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert not _continue(stub, "fam-c").stats.recomputed
    time.sleep(3.5)  # the time to live
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, "fam-b")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    after = evictions()
    assert {k: after[k] - before[k] for k in after} == {"lru": 1.0, "ttl": 2.0}


def test_over_http_an_evicted_or_expired_parent_is_404_naming_it(family, family_clean):
    """The registry's bounds seen through the HTTP front (``small``: two parents, each
    forgotten 3 s after its last use): a third parent evicts the least recently used,
    whose continuation is 404 naming it, while the newest one's continuation imports and
    equals the same request run colocated; 3.5 s later the other is forgotten too (404
    naming it), and the router counts one "lru" and two "ttl" evictions (deltas). A front
    that kept parents past the registry's bounds, answered another status or forgot the
    wrong parent fails."""
    import openai

    from tests.utils import HELD_PARENTS, metric_sum
    from tools.client import RouterClient, make_request

    def evictions() -> dict[str, float]:
        return {reason: metric_sum(family["small_metrics"],
                                   "kvhandoff_router_parent_evictions_total", reason=reason)
                for reason in ("lru", "ttl")}

    client = openai.OpenAI(base_url=f"{family['small_http']}/v1", api_key="unused",
                           max_retries=0)
    model = client.models.list().data[0].id
    prompts = {name: list(_parent_request(f"fam-http-{name}").prompt_token_ids.ids)
               for name in ("a", "b", "c")}
    with RouterClient(family["router"]) as grpc_client:
        ref = grpc_client.generate(make_request(prompt=prompts["c"], max_tokens=4, seed=3,
                                                beam_width=2, path="colocated"))
    before = evictions()
    parents = {}
    for name, prompt in prompts.items():  # holds two: a goes
        parents[name] = client.completions.create(model=model, prompt=prompt, max_tokens=4,
                                                  temperature=1.0, seed=3)
        HELD_PARENTS.add(family["small"], parents[name].id)

    def continuation(name: str):
        return client.completions.create(
            model=model, prompt="", max_tokens=3, n=2,
            extra_body={"use_beam_search": True, "continuation_of": parents[name].id})

    with pytest.raises(openai.NotFoundError) as e:
        continuation("a")
    assert e.value.status_code == 404 and parents["a"].id in e.value.body["message"], \
        e.value.body
    assert_http_identical(parents["c"], continuation("c"), ref)
    time.sleep(3.5)  # the time to live
    with pytest.raises(openai.NotFoundError) as e:
        continuation("b")
    assert e.value.status_code == 404 and parents["b"].id in e.value.body["message"], \
        e.value.body
    after = evictions()
    assert {k: after[k] - before[k] for k in after} == {"lru": 1.0, "ttl": 2.0}


def test_a_burst_of_continuations_of_one_parent_is_served_from_its_blocks(family,
                                                                         family_clean):
    """Eight continuations of one parent at once: each imports what D's prefix cache
    lacks (none computes the parent) and equals the same request run colocated."""
    from concurrent.futures import ThreadPoolExecutor

    from tools.client import RouterClient, make_request

    stub = _stub(family["router"])
    preq = _parent_request("fam-burst")
    _, parent = _start_parent(stub, preq)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _continue(stub, parent.parent_id), range(8)))
    with RouterClient(family["router"]) as client:
        ref = client.generate(make_request(prompt=list(preq.prompt_token_ids.ids),
                                           max_tokens=24, seed=3, beam_width=4,
                                           path="colocated"))
    num_parent = len(parent.prompt_token_ids) + len(parent.thinking_token_ids)
    for r in results:
        # One may find on D what another imported a moment before.
        assert_identical(r, ref, found_on_d=r.stats.num_found_on_d_tokens > 0)
        s = r.stats
        assert (s.num_imported_tokens + s.num_found_on_d_tokens
                + s.num_computed_tokens_first_step) == num_parent + len(r.suffix_token_ids)
    # Some read from P; none computed the parent (it was read or found on D).
    assert any(r.stats.num_imported_tokens > 0 for r in results)
    assert all(r.stats.num_computed_tokens_first_step <= len(r.suffix_token_ids) + 1
               for r in results)


def test_a_new_parent_ends_the_hold_of_the_least_recently_used_idle_one(family, family_clean):
    """``tight`` may hold one parent (6 of P's 512 blocks). A second parent ends the
    first one's hold on P at once (P's pool holds only the second's blocks well before
    the first one's lease would end), and a continuation of the first is recomputed and
    says why (strict: refused). A parent bigger than the whole share is not held and says
    so (the control: no release makes room for it, and nothing is released)."""
    import grpc

    from tools.launch import pool_state

    def released() -> float:
        return metric_sum(family["tight_metrics"], "kvhandoff_router_parent_evictions_total",
                          reason="released")

    stub = _stub(family["tight"])
    released_before = released()
    _, a = _start_parent(stub, _parent_request("fam-tight-a", max_tokens=4))
    assert a.held, a.not_held_reason
    _, b = _start_parent(stub, _parent_request("fam-tight-b", max_tokens=4))
    assert b.held, b.not_held_reason
    released_at = time.time()
    while True:
        _, cap = pool_state(family["prefill"].address)
        if cap.num_total_blocks - cap.num_free_blocks <= 4 or time.time() > released_at + 5:
            break
        time.sleep(0.1)
    assert cap.num_total_blocks - cap.num_free_blocks <= 4, \
        f"P still holds both parents: {cap.num_total_blocks - cap.num_free_blocks} blocks used"
    assert time.time() < a.lease_expires_at - 3, "the hold ended at its lease, not early"
    assert released() - released_before == 1.0
    resp = _continue(stub, a.parent_id)
    assert resp.stats.recomputed and "released early" in resp.stats.handoff_failure
    with pytest.raises(grpc.RpcError) as e:
        _continue(stub, a.parent_id, strict=True)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not _continue(stub, b.parent_id).stats.recomputed
    _, big = _start_parent(stub, _parent_request("fam-tight-big", max_tokens=200,
                                                  min_tokens=200))
    assert not big.held and "share of P's pool for held parents is full" in \
        big.not_held_reason, big.not_held_reason
    assert released() - released_before == 1.0


def test_the_router_seeds_unseeded_requests_and_the_seed_replays_them(family, family_clean):
    """Stage 1 samples positionally by default: an unseeded request gets a seed from the
    router, returned in the response (Generate and StartParent), and sending it again
    with that seed replays its stage 1 exactly, on either path; two unseeded requests
    get different seeds."""
    from kvhandoff.v1 import router_pb2
    from tools.client import RouterClient, make_request

    prompt = list(_parent_request("fam-seed").prompt_token_ids.ids)
    with RouterClient(family["router"]) as client:
        first = client.generate(make_request(prompt=prompt, max_tokens=24, seed=None,
                                             beam_width=2))
        other = client.generate(make_request(prompt=prompt, max_tokens=24, seed=None,
                                             beam_width=2))
        assert first.stage1_positional and first.stage1_seed and other.stage1_seed
        assert first.stage1_seed != other.stage1_seed
        replay = client.generate(make_request(prompt=prompt, max_tokens=24,
                                              seed=first.stage1_seed, beam_width=2,
                                              path="colocated"))
    assert list(replay.thinking_token_ids) == list(first.thinking_token_ids)
    assert replay.stage1_seed == first.stage1_seed
    stub = _stub(family["router"])
    req = router_pb2.ParentRequest(request_id="fam-seed-parent")
    req.prompt_token_ids.ids.extend(prompt)
    req.stage1.max_tokens = 24
    _, parent = _start_parent(stub, req)
    assert parent.stage1_positional and parent.stage1_seed
    resp = _continue(stub, parent.parent_id)
    assert resp.stage1_seed == parent.stage1_seed


@pytest.mark.migration
def test_a_request_moved_to_d_mid_stage1_streams_on_and_equals_not_moving(family,
                                                                        family_clean):
    """Router.Move after 10 streamed stage-1 tokens (again, up to 3 times, where Move
    answers that stage 1 had ended on P first): P stops after its next token, D
    imports what P had and samples the rest, then runs stage 2. The stream has every
    token once, D's part arrives as D samples it (many events, not one batch), stage 1
    and the beams equal the same request never moved (colocated), and the response
    reports the move (reason, bytes read, pause). Refused: an unknown request (NOT_FOUND), a request
    with vLLM's own sampling and one past stage 1 (FAILED_PRECONDITION)."""
    import grpc

    from kvhandoff.v1 import router_pb2
    from tools.client import RouterClient, make_request

    stub = _stub(family["router"])
    prompt = list(_parent_request("fam-move").prompt_token_ids.ids)

    def request(request_id, **kw):
        # 400 tokens: P decodes ~2 ms a token on an idle machine; the stream lags it.
        req = make_request(prompt=prompt, max_tokens=400, seed=17, beam_width=4,
                           request_id=request_id, **kw)
        req.stage1.min_tokens = 400
        return req

    def stream_and_move(request_id):
        streamed, batches, result, moved = [], [], None, None
        for event in stub.GenerateStream(request(request_id), timeout=120):
            if event.HasField("stage1_tokens"):
                streamed.extend(event.stage1_tokens.ids)
                batches.append(len(streamed))
                if len(streamed) >= 10 and moved is None:
                    moved = move_or_raced(stub, request_id, timeout=30)
            else:
                result = event.result
        return streamed, batches, result, moved

    for attempt in range(3):  # the stream lags P: under load P can end first
        streamed, batches, result, moved = stream_and_move(f"fam-move-{attempt}")
        if moved is not RACED:
            break
        assert not result.moves and len(result.thinking_token_ids) == 400, \
            "Move said nothing moved, yet the request moved or stopped short"
    assert moved is not RACED, "stage 1 ended before every Move of 3"
    assert moved.from_endpoint == family["prefill"].address
    assert moved.to_endpoint == family["decode"][0].address
    with RouterClient(family["router"]) as client:
        ref = client.generate(request("fam-move-ref", path="colocated"))
    assert streamed == list(result.thinking_token_ids) == list(ref.thinking_token_ids)
    assert len(result.moves) == 1, "Move answered OK and the request was not moved"
    move = result.moves[0]
    assert 10 <= move.at_token < 400 and move.to_endpoint == moved.to_endpoint
    assert move.reason == "move"
    assert move.num_bytes_moved > 0 and move.pause_ms > 0
    # D's part streams as D samples it (not as one batch at its end).
    assert sum(1 for n in batches if n > move.at_token) > 10, batches
    assert move.num_imported_tokens == len(prompt) + move.at_token - 1
    # Moved to D, its stage 2 reads D's cache: no handoff to import.
    assert_identical(result, ref, imported=False)
    with pytest.raises(grpc.RpcError) as e:
        stub.Move(router_pb2.MoveRequest(request_id=result.request_id), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    unpositional = request("fam-move-vllm")
    unpositional.stage1.positional = False
    call = stub.GenerateStream(unpositional, timeout=120)
    next(iter(call))  # stage 1 is running
    with pytest.raises(grpc.RpcError) as e:
        stub.Move(router_pb2.MoveRequest(request_id="fam-move-vllm"), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "positional" in e.value.details()
    assert [ev for ev in call][-1].result.moves == []
    # Stage2Stream streams a sampled stage 2 only; the engine says so and keeps serving.
    from kvhandoff.v1 import engine_pb2
    from tests.conftest import engine_stub

    d = engine_stub(family["decode"][0].address)
    with pytest.raises(grpc.RpcError) as e:
        list(d.Stage2Stream(engine_pb2.Stage2Request(request_id="fam-move-beam",
                                                     prompt_token_ids=prompt), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling" in e.value.details()


@pytest.mark.migration
def test_drain_moves_ps_running_stage1s_to_d_and_their_output_is_unchanged(family,
                                                                         family_clean):
    """Router.Drain on P while four stage 1s stream: the three positional ones move to
    their D (reason "drain": any whose stage 1 ended on P before the drain's stop reached
    it is counted in place), the one with vLLM's own sampling finishes on P; the call
    returns once P is empty, and `kvhandoff drain` then says so at once. Every stream has
    each token once and every output equals the same request never moved (colocated).
    While P is drained a new request waits (this router has no other P) and is served
    after `drain --undo`; an engine the router does not know is NOT_FOUND."""
    import concurrent.futures
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    import grpc

    from kvhandoff.v1 import engine_pb2
    from tests.conftest import engine_stub
    from tools.client import RouterClient, make_request

    kvhandoff = str(Path(sys.executable).parent / "kvhandoff")
    stub = _stub(family["router"])
    p_address = family["prefill"].address

    def request(i, path="handoff"):
        prompt = list(_parent_request(f"fam-drain-{i}").prompt_token_ids.ids)
        req = make_request(prompt=prompt, max_tokens=300, seed=40 + i, beam_width=4,
                           request_id=f"fam-drain-{i}-{path}", path=path)
        req.stage1.min_tokens = 300
        req.stage1.positional = i != 3
        return req

    started = [threading.Event() for _ in range(4)]

    def stream(i):
        streamed, result = [], None
        for event in stub.GenerateStream(request(i), timeout=300):
            if event.HasField("stage1_tokens"):
                streamed.extend(event.stage1_tokens.ids)
                if len(streamed) >= 5:
                    started[i].set()
            else:
                result = event.result
        return streamed, result

    def drain(*flags):
        return subprocess.run([kvhandoff, "drain", "--router", family["router"], "--engine",
                               p_address, *flags], capture_output=True, text=True,
                              timeout=300)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        for event in started:
            assert event.wait(120), "a stage 1 did not start"
        try:
            # The drain itself in process: the CLI's start-up (seconds beside the other
            # lane) could outlast the 300-token stage 1s and find nothing to move.
            with RouterClient(family["router"]) as client:
                summary = client.drain(p_address)
            # Three movable, one not. A stage 1 that ended on P before the drain's stop
            # reached it (the streams lag P under load) is counted in place: the
            # per-request check below holds the summary to what happened.
            assert (summary.moved + summary.finished_in_place, summary.failed,
                    summary.empty) == (4, 0, True), summary
            assert summary.moved >= 1, summary
            # The CLI on the drained, empty P: its summary, and it returns at once.
            drained = drain()
            assert drained.returncode == 0, drained.stderr
            assert "0 moved, 0 finished in place, 0 failed" in drained.stdout, drained.stdout
            cap = engine_stub(p_address).GetCapacity(engine_pb2.CapacityRequest(), timeout=10)
            assert cap.num_running_reqs == 0, "drain returned before P was empty"
            late = pool.submit(stub.Generate, request(4), timeout=120)
            # It waits in the router for a P taking work: the drained P never runs it
            # (a second of samples; stage 1 of 300 tokens would show as running).
            until = time.monotonic() + 1.0
            while time.monotonic() < until:
                cap = engine_stub(p_address).GetCapacity(engine_pb2.CapacityRequest(),
                                                         timeout=10)
                assert not cap.num_running_reqs and not cap.num_waiting_reqs, \
                    "a request went to the drained P"
                time.sleep(0.05)
            assert not late.done()
        finally:
            undone = drain("--undo")
        assert undone.returncode == 0, undone.stderr
        assert not late.result().moves
        got = [f.result() for f in futures]
        refs = list(pool.map(lambda i: stub.Generate(request(i, "colocated"), timeout=300),
                             range(4)))
    moved = [i for i, (_, result) in enumerate(got) if result.moves]
    assert len(moved) == summary.moved and 3 not in moved, (moved, summary)
    for i, ((streamed, result), ref) in enumerate(zip(got, refs)):
        assert streamed == list(result.thinking_token_ids), i
        # Moved to D, its stage 2 reads D's cache; one left on P hands off as usual.
        assert_identical(result, ref, imported=i not in moved)
        if i in moved:
            assert [(m.reason, m.from_endpoint, m.to_endpoint) for m in result.moves] == [
                ("drain", p_address, family["decode"][0].address)], i
            assert 5 <= result.moves[0].at_token < 300
    with RouterClient(family["router"]) as client, pytest.raises(grpc.RpcError) as e:
        client.drain("127.0.0.1:1")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and p_address in e.value.details()


@pytest.mark.migration
def test_a_request_cancelled_during_its_move_frees_both_pools(family, family_clean):
    """The client cancels right after Router.Move answered (stage 1 stopped on P, D
    importing or sampling on): neither engine runs or queues the request within ~2 s
    (stage 1 has ~2990 tokens left, seconds of sampling on D: a cancel that does not
    reach the engines fails this), both pools come back clean (the fixture checks) and
    the router serves the next request."""
    from tools.client import RouterClient, make_request

    stub = _stub(family["router"])
    d = family["decode"][0]
    prompt = list(_parent_request("fam-move-cancel").prompt_token_ids.ids)
    generated = metric_sum(d.metrics_url, "vllm:generation_tokens_total")
    for attempt in range(3):  # again when stage 1 ended on P before the stop (Move says)
        req = long_stage1_request(prompt, 3000, seed=5, beam_width=4,
                                  request_id=f"fam-move-cancel-{attempt}")
        call = stub.GenerateStream(req, timeout=120)
        n = 0
        for event in call:
            n += len(event.stage1_tokens.ids)
            if n >= 10:
                moved = move_or_raced(stub, req.request_id, timeout=30)
                break
        call.cancel()
        if moved is not RACED:
            break
    assert moved is not RACED, "stage 1 ended before every Move of 3"
    assert moved.to_endpoint == family["decode"][0].address
    # The cancel acts on both engines within ~2 s (~2990 tokens were left to sample),
    # and D sampled only a part of them.
    assert_idle_within([family["prefill"], *family["decode"]])
    on_d = metric_sum(d.metrics_url, "vllm:generation_tokens_total") - generated
    assert on_d < 2000, f"D sampled {on_d} of the ~2990 tokens left after the move"
    with RouterClient(family["router"]) as client:
        after = client.generate(make_request(prompt=prompt[:40], max_tokens=8, seed=1,
                                             beam_width=4))
    assert after.beams


@pytest.mark.migration
def test_a_move_to_a_drained_d_is_refused_and_the_request_runs_on(family, family_clean):
    """D drained (through the router, with a short timeout: a request bound for it is
    running, so D is not empty when the call returns) refuses moves: Router.Move answers
    FAILED_PRECONDITION naming the drained D, and the request goes on on P, unmoved, to
    the same output as colocated; `--undo` puts D back."""
    import grpc

    from kvhandoff.v1 import router_pb2
    from tools.client import RouterClient, make_request

    stub = _stub(family["router"])
    d_address = family["decode"][0].address
    prompt = list(_parent_request("fam-move-drained").prompt_token_ids.ids)

    def request(request_id, **kw):
        # 400 tokens: on an idle machine P decodes this model in ~2 ms a token, and the
        # request must still run when the drain's 0.1 s are over (CI once saw 200 end
        # within a 0.5 s drain: "empty").
        req = make_request(prompt=prompt, max_tokens=400, seed=8, beam_width=4,
                           request_id=request_id, **kw)
        req.stage1.min_tokens = 400
        return req

    streamed, result, refused, summary = [], None, None, None
    with RouterClient(family["router"]) as client:
        try:
            for event in stub.GenerateStream(request("fam-move-drained"), timeout=120):
                if event.HasField("stage1_tokens"):
                    streamed.extend(event.stage1_tokens.ids)
                    if len(streamed) >= 10 and summary is None:
                        summary = client.drain(d_address, timeout_s=0.1)
                        with pytest.raises(grpc.RpcError) as refused:
                            stub.Move(router_pb2.MoveRequest(request_id="fam-move-drained"),
                                      timeout=30)
                else:
                    result = event.result
        finally:
            client.drain(d_address, undo=True)
        ref = client.generate(request("fam-move-drained-ref", path="colocated"))
    assert not summary.empty and summary.moved == 0 and summary.finished_in_place == 1
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "drained" in refused.value.details() and d_address in refused.value.details()
    assert not result.moves and result.stats.decode_endpoint == d_address
    assert streamed == list(result.thinking_token_ids) == list(ref.thinking_token_ids)
    assert_identical(result, ref)

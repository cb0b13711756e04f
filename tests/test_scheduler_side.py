"""The connector's and D scheduler's logic, driven through vLLM's real Scheduler with no
model: schedule() / update_from_output() by hand, as vLLM's own connector tests do."""

from __future__ import annotations

import time

import pytest

from connector.params import KEY
from tests.utils import (
    BLOCK_SIZE,
    assert_scheduler_clean,
    make_export_params,
    make_import_request,
    make_scheduler,
    model_output,
    reject_at_admission,
)


@pytest.mark.parametrize("num_parent,num_suffix", [(40, 3), (64, 3), (65, 2), (95, 40)])
def test_import_claims_exactly_the_tokens_p_computed(model_dir, fingerprint, num_parent, num_suffix):
    """D imports N-1 tokens (never the suffix) and then computes S+1 tokens."""
    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 10 + num_parent))
    prompt = parent + [7] * num_suffix
    req = make_import_request(prompt, make_export_params(parent, model_fingerprint=fingerprint))

    # STEP 1: admission passes; the request waits for its READ of cdiv(N-1, B) blocks.
    scheduler.add_request(req)
    out = scheduler.schedule()
    meta = out.kv_connector_metadata
    assert req.request_id in meta.reqs_to_recv
    recv = meta.reqs_to_recv[req.request_id]
    assert len(recv.local_block_ids[0]) == -(-(num_parent - 1) // BLOCK_SIZE)
    assert req.num_computed_tokens == num_parent - 1
    assert out.num_scheduled_tokens == {}

    # STEP 2: the READ completes; D schedules only the last parent token + the suffix.
    scheduler.update_from_output(out, model_output(finished_recving={req.request_id}))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {req.request_id: num_suffix + 1}


def test_digest_mismatch_is_refused_before_any_read(model_dir, fingerprint):
    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 60))
    tampered = parent[:20] + [parent[20] + 1] + parent[21:]
    req = make_import_request(tampered + [7, 8],
                              make_export_params(parent, model_fingerprint=fingerprint))
    info = reject_at_admission(scheduler, req)
    assert info["reason"] == "digest" and "digest" in info["error"]


@pytest.mark.fault
def test_expired_lease_is_refused(model_dir, fingerprint):
    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 60))
    params = make_export_params(parent, model_fingerprint=fingerprint,
                                lease_expires_at=time.time() - 1)
    info = reject_at_admission(scheduler, make_import_request(parent + [7], params))
    assert info["reason"] == "expired"


@pytest.mark.parametrize("field,value,reason", [
    ("protocol_version", 999, "protocol"),
    ("model_fingerprint", "0000000000000000", "model"),
])
def test_other_version_or_model_is_refused(model_dir, fingerprint, field, value, reason):
    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 60))
    params = make_export_params(parent, **{"model_fingerprint": fingerprint, field: value})
    info = reject_at_admission(scheduler, make_import_request(parent + [7], params))
    assert info["reason"] == reason


def test_capacity_refusal_names_the_numbers_and_does_not_block_the_queue(model_dir, fingerprint):
    # 20 blocks; a 301-token prompt with 32 beams needs 9 + 1 + 32 = 42 (beam fork
    # keeps step 0's request while the 32 slots copy its partial block).
    scheduler = make_scheduler(model_dir, num_blocks=21)
    parent = list(range(10, 310))
    big = make_import_request(parent + [7], make_export_params(parent, model_fingerprint=fingerprint),
                              request_id="big", beam_width=32)
    info = reject_at_admission(scheduler, big)
    assert info["reason"] == "capacity"
    assert "needs 42 blocks" in info["error"] and "20 free of 20" in info["error"]

    # A request that fits is admitted right after.
    small_parent = list(range(10, 50))
    small = make_import_request(small_parent + [7],
                                make_export_params(small_parent, model_fingerprint=fingerprint),
                                request_id="small", beam_width=2)
    scheduler.add_request(small)
    out = scheduler.schedule()
    assert "small" in out.kv_connector_metadata.reqs_to_recv


def test_admission_leaves_room_for_the_running_stage2s_peaks(model_dir, fingerprint):
    """D's server passes the blocks its running stage 2s may still grow into: an import
    that fits the free blocks now but not beside those peaks is refused."""

    scheduler = make_scheduler(model_dir, num_blocks=21)
    parent = list(range(10, 50))

    def request(request_id: str, reserved: int):
        req = make_import_request(parent + [7], make_export_params(
            parent, model_fingerprint=fingerprint), request_id=request_id, beam_width=2)
        req.kv_transfer_params[KEY]["reserved_blocks"] = reserved
        return req

    info = reject_at_admission(scheduler, request("beside-peaks", reserved=18))
    assert info["reason"] == "capacity" and "(18 reserved by running stage 2s)" in info["error"]
    scheduler.add_request(request("with-room", reserved=10))
    assert "with-room" in scheduler.schedule().kv_connector_metadata.reqs_to_recv


@pytest.mark.migration
def test_p_admits_a_moved_stage1_up_front_and_exports_it_again(model_dir, fingerprint):
    """P's scheduler (a stage 1 moved here from another P): an import P's pool cannot
    hold is refused at admission with the numbers (the source P told to release at
    once) and the queue goes on; one that fits gets its READ of N-1 tokens, then is an
    exporting request (``do_remote_decode``) that is not pulled a second time when
    vLLM asks again (after a preemption)."""
    from connector.params import REEXPORT_KEY

    scheduler = make_scheduler(model_dir, num_blocks=11, prefill=True)

    def moved(parent, request_id, max_tokens):
        req = make_import_request(parent, make_export_params(
            parent, model_fingerprint=fingerprint), request_id=request_id, beam_width=1,
            beam_max_tokens=max_tokens)
        req.kv_transfer_params[REEXPORT_KEY] = True
        return req

    # 10 usable blocks of 32 tokens: 100 tokens and 230 more to sample need 11.
    parent = list(range(10, 110))
    info = reject_at_admission(scheduler, moved(parent, "too-long", 230))
    assert info["reason"] == "capacity"
    assert info["error"].startswith(
        f"prefill pool too small: needs 11 blocks of {BLOCK_SIZE} tokens"), info

    req = moved(parent, "fits", 40)
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert "fits" in out.kv_connector_metadata.reqs_to_recv
    assert req.num_computed_tokens == len(parent) - 1
    params = req.kv_transfer_params
    assert params["do_remote_decode"] and not params["do_remote_prefill"]
    connector = scheduler.connector.connector_scheduler
    assert connector.get_num_new_matched_tokens(req, req.num_computed_tokens) == (0, False)


def test_a_stop_can_address_the_handoff_to_another_engine(model_dir, fingerprint):
    """P's stop (a move): the request ends after its next token; with a retarget its
    handoff is addressed to that engine, without one to the engine it named."""
    from connector.params import RETARGET_KEY, STOP_KEY, TARGET_KEY

    scheduler = make_scheduler(model_dir, prefill=True)
    reqs = {}
    for name in ("a", "b"):
        reqs[name] = make_import_request(list(range(10, 40)), {}, request_id=name)
        reqs[name].kv_transfer_params = {"do_remote_decode": True, TARGET_KEY: "decode-x"}
        scheduler.add_request(reqs[name])
    connector = scheduler.connector.connector_scheduler
    for name, target in (("a", "prefill-y"), ("b", "")):
        stop = make_import_request([1], {}, request_id=f"stop-{name}")
        stop.kv_transfer_params = {STOP_KEY: [name], RETARGET_KEY: target}
        connector.on_new_request(stop)
    scheduler.schedule()
    assert reqs["a"].kv_transfer_params[TARGET_KEY] == "prefill-y"
    assert reqs["b"].kv_transfer_params[TARGET_KEY] == "decode-x"
    assert reqs["a"].max_tokens == reqs["b"].max_tokens == 1


def test_export_attaches_a_typed_handoff(model_dir):
    """P side: a stage-1 request that ends by length exports N-1 computed tokens."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from connector.handoff import Handoff, token_digest

    init_none_hash(sha256)
    scheduler = make_scheduler(model_dir, kv_role="kv_producer")
    prompt = list(range(10, 75))
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    sampling.update_from_generation_config({}, 1)
    req = Request(request_id="s1", prompt_token_ids=prompt, sampling_params=sampling,
                  pooling_params=None, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = {"do_remote_decode": True}
    scheduler.add_request(req)
    final = None
    for token in (500, 501, 502):
        out = scheduler.schedule()
        eco = scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=["s1"], req_id_to_index={"s1": 0}, sampled_token_ids=[[token]]))
        for o in (o for e in eco.values() for o in e.outputs):
            if o.finish_reason is not None:
                final = o
    assert final is not None
    handoff = Handoff.from_params(final.kv_transfer_params)
    assert handoff.num_parent_tokens == len(prompt) + 3
    assert handoff.num_computed_tokens == len(prompt) + 2
    assert handoff.token_digest == token_digest(prompt + [500, 501, 502])
    assert handoff.num_blocks == len(final.kv_transfer_params["remote_block_ids"][0]) == 3
    assert handoff.lease_remaining_s() > 25
    # The blocks stay held for D until it reads them (or the lease ends).
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - 3


# ---- beam fork -------------------------------------------------------------------------
def _beam_request(prompt, beam, request_id):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from connector.params import BEAM_KEY

    init_none_hash(sha256)
    sampling = SamplingParams(max_tokens=1, logprobs=8)
    sampling.update_from_generation_config({}, 1)
    req = Request(request_id=request_id, prompt_token_ids=list(prompt),
                  sampling_params=sampling, pooling_params=None,
                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = {BEAM_KEY: beam}
    return req


def _step(scheduler, sampled=None, finished_sending=()):
    """One schedule() and a model output sampling token 5 for every scheduled request."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    scheduler.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[sampled or 5] for _ in ids],
        kv_connector_output=KVConnectorOutput(finished_sending=set(finished_sending)),
    ))
    return out


def _used_blocks(scheduler):
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def test_beam_fork_copies_the_partial_block_and_releases_the_source(model_dir):
    """70 tokens = 2 full blocks + 6: each child loads those 6 by a copy of block 2 and
    computes 1 token; the kept source is released once its 2 children are scheduled."""
    scheduler = make_scheduler(model_dir)
    prompt = list(range(10, 80))
    source = _beam_request(prompt, {"id": "s0", "keep": True}, "s0-internal")
    scheduler.add_request(source)
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"s0-internal": 70}
    source_blocks = out.scheduled_new_reqs[0].block_ids[0]
    assert _used_blocks(scheduler) == 3, "the kept source holds its blocks"

    children = [_beam_request(prompt + [t], {"id": f"c{t}", "keep": False, "fork_from": "s0",
                                             "fork_children": 2},
                              f"c{t}-internal") for t in (5, 6)]
    for child in children:
        scheduler.add_request(child)
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"c5-internal": 1, "c6-internal": 1}
    meta = out.kv_connector_metadata
    child_blocks = {r.req_id: r.block_ids[0] for r in out.scheduled_new_reqs}
    assert sorted(meta.orders.fork_copies) == sorted(
        (source_blocks[2], child_blocks[c.request_id][2]) for c in children)
    assert meta.orders.fork_release == ["s0-internal"]
    # The worker copies, then reports the source as sent: its blocks are freed.
    _step(scheduler, finished_sending={"s0-internal"})
    assert_scheduler_clean(scheduler)


def test_beam_fork_refuses_a_child_that_does_not_extend_its_source(model_dir):
    scheduler = make_scheduler(model_dir)
    prompt = list(range(10, 80))
    scheduler.add_request(_beam_request(prompt, {"id": "s0", "keep": True}, "s0-internal"))
    _step(scheduler)
    other = prompt[:-1] + [3, 5]  # differs inside the partial block
    scheduler.add_request(_beam_request(other, {"id": "c", "fork_from": "s0",
                                                "fork_children": 1}, "c-internal"))
    out = _step(scheduler)
    assert out.num_scheduled_tokens == {"c-internal": 71 - 64}, "computed, not copied"
    assert out.kv_connector_metadata.orders.fork_copies == []
    assert out.kv_connector_metadata.orders.fork_release == ["s0-internal"]
    _step(scheduler, finished_sending={"s0-internal"})
    assert_scheduler_clean(scheduler)


def test_beam_fork_releases_unclaimed_sources(model_dir):
    """A kept request no child extends (its search failed or was cancelled) is released
    after beam_fork_hold_s."""
    scheduler = make_scheduler(model_dir, extra_config={"beam_fork_hold_s": 0.5})
    scheduler.add_request(_beam_request(list(range(10, 50)), {"id": "a", "keep": True},
                                        "a-internal"))
    out = _step(scheduler)
    held_since = time.monotonic()
    while not out.kv_connector_metadata.orders.fork_release:  # until the hold ends
        assert time.monotonic() - held_since < 5.0, "the kept request was never released"
        time.sleep(0.01)
        out = _step(scheduler)
    assert out.kv_connector_metadata.orders.fork_release == ["a-internal"]
    assert time.monotonic() - held_since >= 0.4
    _step(scheduler, finished_sending={"a-internal"})
    assert_scheduler_clean(scheduler)


def test_import_admitted_without_beam_fork_when_only_that_fits(model_dir, fingerprint):
    """1505 tokens, 32 beams, 3 beam tokens: 80 blocks with fork (step 0 keeps its
    partial block while the 32 slots start), 79 without; with 79 free the import is
    admitted and fork is turned off for it."""
    from connector.params import BEAM_KEY

    scheduler = make_scheduler(model_dir, num_blocks=80)
    parent = list(range(10, 1515))
    req = make_import_request(parent, make_export_params(parent[:-1], model_fingerprint=fingerprint),
                              beam_width=32, beam_max_tokens=3)
    req.kv_transfer_params[BEAM_KEY] = {"id": "b0", "keep": True}
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert req.request_id in out.kv_connector_metadata.reqs_to_recv, "admitted"
    assert req.kv_transfer_params[BEAM_KEY] == {"id": "b0", "keep": False,
                                                "fork_disabled": True}


def test_idle_steps_are_paced_but_never_a_read_step(model_dir):
    """Empty steps back to back for idle_after_ms: the next one pauses idle_pause_ms. The
    first step after the engine slept on its queue (a request just arrived) and a step
    that posts READs do not: an import is never delayed by the pacing."""
    from types import SimpleNamespace

    scheduler = make_scheduler(model_dir, extra_config={"idle_after_ms": 30,
                                                        "idle_pause_ms": 80})
    pacer = scheduler.connector.connector_scheduler
    empty = SimpleNamespace(total_num_scheduled_tokens=0)

    def step_s():
        t0 = time.perf_counter()
        pacer._pace_idle_step(empty)
        return time.perf_counter() - t0

    assert step_s() < 0.02  # first step after a long quiet: a new streak
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.02:  # a streak shorter than idle_after_ms
        assert step_s() < 0.02
        time.sleep(0.005)
    time.sleep(0.015)
    assert step_s() >= 0.07  # the control: past idle_after_ms of empty steps, paced
    pacer._reqs_need_recv["imp"] = object()  # this step posts a READ
    assert step_s() < 0.02
    del pacer._reqs_need_recv["imp"]
    time.sleep(0.1)  # the engine slept on its queue
    assert step_s() < 0.02

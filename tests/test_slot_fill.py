"""A beam group's leader sent with its search's step 0 (``decode_engine.slot_fill``),
over vLLM's real Scheduler with no model (tests/utils): filled in from step 0's result
and started the engine step after step 0, or ended with why when step 0 gives it
nothing to start from. Nothing is left in the scheduler either way."""

from __future__ import annotations

import pytest

from connector.params import KEY, SLOT_KEY
from tests.test_beam_slots import _slot_request, _slot_step

pytestmark = pytest.mark.beams

STEP0_LIVE = [[0, [21], -0.5], [0, [22], -1.0], [0, [23], -1.5]]


def _pair(parent: list[int], *, members: int = 3):
    """Step 0 (group "s", one slot) and the slots' leader sent with it (group "g"): the
    leader's last prompt token a placeholder, its spec naming step 0's group."""
    step0 = _slot_request(parent, group="s", slot=0, width=1, steps=1)
    leader = _slot_request(parent + [parent[-1]], group="g", slot=0, width=members)
    leader.sampling_params.extra_args[SLOT_KEY].update(after="s", live=1, cum=0.0)
    return step0, leader


@pytest.mark.parametrize("parent_len", [60, 63])
@pytest.mark.parametrize("late", [False, True])
def test_a_leader_sent_with_its_step_0_is_filled_in_and_starts_the_step_after(
        model_dir, parent_len, late):
    """The leader waits while step 0 runs (no slot made); at the next step it holds step
    0's first pick as its last prompt token, its block hashes are vLLM's over that
    prompt (with 63 + 1 tokens the placeholder had filled a block: its hash is
    replaced), the other slots are made with step 0's other picks and scores, and the
    group starts whole. ``late``: the leader arrives after step 0 ended and left the
    scheduler."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    from connector.handoff import CLONE_SEP
    from tests.utils import BLOCK_SIZE, assert_scheduler_clean, make_scheduler

    scheduler = make_scheduler(model_dir)
    parent = list(range(10, 10 + parent_len))
    step0, leader = _pair(parent)
    placeholder_hashes = list(leader.block_hashes)
    scheduler.add_request(step0)
    if not late:
        scheduler.add_request(leader)
        assert len(scheduler.requests) == 2, "slots made before step 0 decided"
    decided = {"s": {"step": 1, "parents": [0],
                     "result": {"completed": [], "live": STEP0_LIVE}}}
    out, _ = _slot_step(scheduler, decided)
    assert list(out.num_scheduled_tokens) == [step0.request_id]
    assert step0.request_id not in scheduler.requests  # ended, not kept
    if late:
        scheduler.add_request(leader)
    out, _ = _slot_step(scheduler, {"g": {"step": 1, "parents": [0, 1, 2]}})
    made = [scheduler.requests[f"g0{CLONE_SEP}{i}"] for i in (1, 2)]
    assert sorted(out.num_scheduled_tokens) == sorted(
        ["g0", *(r.request_id for r in made)]), "the group did not start whole"
    assert [leader.prompt_token_ids, *(r.prompt_token_ids for r in made)] == [
        parent + [t] for t in (21, 22, 23)]
    assert list(leader.all_token_ids[:parent_len + 1]) == parent + [21]
    specs = [r.sampling_params.extra_args[SLOT_KEY] for r in (leader, *made)]
    assert [(s["slot"], s["live"], s["cum"], "after" in s) for s in specs] == [
        (0, 3, -0.5, False), (1, 3, -1.0, False), (2, 3, -1.5, False)]
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    fresh = Request("x", list(leader.all_token_ids), leader.sampling_params, None,
                    block_hasher=hasher).block_hashes
    assert leader.block_hashes == fresh
    if parent_len + 1 == 2 * BLOCK_SIZE:
        assert placeholder_hashes[1] != fresh[1], "the control: the placeholder's hash"
    result = {"completed": [], "live": [[0, [5, 5], -1.0], [1, [5, 5], -2.0],
                                        [2, [5, 5], -3.0]]}
    _, outputs = _slot_step(scheduler, {"g": {"step": 2, "parents": [0, 1, 2],
                                              "result": result}})
    assert outputs["g0"].kv_transfer_params[KEY][SLOT_KEY]["live"] == result["live"]
    assert_scheduler_clean(scheduler)


@pytest.mark.parametrize("step0_record,why", [
    ({"step": 1, "error": "a row went missing"}, "its step 0 failed: a row went missing"),
    ({"step": 1, "parents": [0], "result": {"completed": [[0, [1], -0.1]], "live": []}},
     "its step 0 left no live beam"),
])
def test_a_leader_whose_step_0_gives_it_nothing_ends_with_why(model_dir, step0_record,
                                                              why):
    """Step 0 failed, or all its picks ended by EOS: the leader (the front end cancels
    it too) ends with the reason at the next step; no slot is made, nothing is left."""
    from tests.utils import assert_scheduler_clean, make_scheduler

    scheduler = make_scheduler(model_dir)
    step0, leader = _pair(list(range(10, 70)))
    scheduler.add_request(step0)
    scheduler.add_request(leader)
    _slot_step(scheduler, {"s": step0_record})
    out, outputs = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}
    info = outputs["g0"].kv_transfer_params[KEY]
    assert info["reason"] == "beam_group" and why in info["error"], info
    assert_scheduler_clean(scheduler)


def test_a_leader_whose_step_0_never_comes_ends_after_the_start_timeout(model_dir,
                                                                        monkeypatch):
    import decode_engine.beam_slots
    from tests.utils import assert_scheduler_clean, make_scheduler

    monkeypatch.setattr(decode_engine.beam_slots, "START_TIMEOUT_S", 0.0)
    scheduler = make_scheduler(model_dir)
    _, leader = _pair(list(range(10, 70)))
    scheduler.add_request(leader)
    out, outputs = _slot_step(scheduler)
    assert out.num_scheduled_tokens == {}
    assert "its step 0 s did not come" in outputs["g0"].kv_transfer_params[KEY]["error"]
    assert_scheduler_clean(scheduler)


def test_a_step_0s_state_is_kept_for_its_leader_only_while_it_may_come(monkeypatch):
    """An ended step 0 is found by a leader that comes late; one whose leader took its
    result while it ran (kept for the slots to fork from) is not kept once it ends; an
    unclaimed one goes after ``KEEP_S``."""
    import decode_engine.slot_fill
    from decode_engine.beam_group import Group
    from decode_engine.slot_fill import Step0s

    def step0():
        return Group(members=1, first_block=0, tokens_each=1, own_blocks=1)

    step0s = Step0s()
    late, taken = step0(), step0()
    step0s.ended("late", late)
    assert step0s.find("late", {}) == (late, True)
    assert step0s.find("taken", {"taken": taken}) == (taken, False)
    step0s.claim("taken")  # filled while it ran
    step0s.ended("taken", taken)
    assert step0s.find("taken", {}) == (None, False) and len(step0s) == 1
    step0s.claim("late")
    assert len(step0s) == 0
    monkeypatch.setattr(decode_engine.slot_fill, "KEEP_S", -1.0)
    step0s.ended("never claimed", step0())
    step0s.ended("next", step0())
    assert step0s.find("never claimed", {}) == (None, False)

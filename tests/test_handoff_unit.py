"""The typed handoff and its checks, without engines."""

from __future__ import annotations

import time

import pytest

from connector.handoff import Handoff, HandoffError, ImportRequest, token_digest, validate_import
from connector.params import KEY
from kvhandoff.budget import blocks_needed
from kvhandoff.types import continuation_prompt
from tests.utils import make_export_params

PARENT = list(range(100, 171))


def _handoff(**overrides) -> Handoff:
    return Handoff.from_params(make_export_params(PARENT, model_fingerprint="m", **overrides))


def test_round_trip_and_byte_count():
    h = _handoff()
    assert h.num_parent_tokens == 71 and h.num_computed_tokens == 70
    assert h.num_blocks == 3 and h.num_bytes == 3 * h.kv_bytes_per_block


def test_digest_covers_order_and_values():
    assert token_digest([1, 2, 3]) != token_digest([1, 3, 2])
    assert token_digest([1, 2, 3]) != token_digest([1, 2, 3, 0])


@pytest.mark.parametrize("prompt,reason", [
    (PARENT[:-1], "digest"),                      # shorter than the parent
    ([0] + PARENT[1:] + [5], "digest"),           # one token changed
])
def test_validate_rejects_a_prompt_that_does_not_continue_the_parent(prompt, reason):
    with pytest.raises(HandoffError) as err:
        validate_import(_handoff(), prompt, model_fingerprint="m")
    assert err.value.reason == reason


def test_validate_rejects_expiry_within_the_safety_margin():
    now = time.time()  # one clock reading for both checks: no slack to run out
    h = _handoff(lease_expires_at=now + 1.0)
    with pytest.raises(HandoffError) as err:
        validate_import(h, PARENT + [1], model_fingerprint="m", safety_margin_s=2.0, now=now)
    assert err.value.reason == "expired"
    validate_import(h, PARENT + [1], model_fingerprint="m", safety_margin_s=0.5, now=now)


def test_import_params_are_a_fresh_copy_each_time():
    export = make_export_params(PARENT, model_fingerprint="m")
    wanted = ImportRequest(export, beam_width=4, beam_max_tokens=3, reserved_blocks=7)
    a = wanted.to_params()
    a["do_remote_prefill"] = False
    a[KEY]["beam_width"] = 99
    b = wanted.to_params()
    assert b["do_remote_prefill"] is True and b[KEY]["beam_width"] == 4
    assert "beam_width" not in export[KEY]
    # What D's scheduler reads back is what D's engine put in.
    handoff, parsed = ImportRequest.parse(b)
    assert handoff.num_parent_tokens == len(PARENT)
    assert (parsed.beam_width, parsed.beam_max_tokens, parsed.reserved_blocks) == (4, 3, 7)


def test_import_params_leave_out_p_s_cache_hits():
    """vLLM reports ``remote_prefill_cached_tokens`` as D's cached tokens: kept, a cold
    import's first step would count every imported token as computed on D."""
    export = {**make_export_params(PARENT, model_fingerprint="m"),
              "remote_prefill_cached_tokens": 0}
    params = ImportRequest(export, beam_width=4, beam_max_tokens=3).to_params()
    assert "remote_prefill_cached_tokens" not in params
    assert params["remote_engine_id"] == export["remote_engine_id"]


@pytest.mark.parametrize("n,w,t,expected,with_fork", [
    (64, 1, 1, 2 + 1, 2 + 1),      # two full blocks shared, one tail block (no next step)
    # 1 + 3 tail tokens fit one block per slot; with fork, step 0's kept request holds
    # its own block while the slots start.
    (65, 4, 3, 2 + 4 * 1, 2 + 1 + 4),
    # 31 + 3 tail tokens need two blocks per slot: more than the slots' start.
    (95, 32, 3, 2 + 32 * 2, 2 + 32 * 2),
    (96, 4, 2, 3 + 4 * 1, 3 + 0 + 4),  # step 0 holds no private block
])
def test_blocks_needed(n, w, t, expected, with_fork):
    assert blocks_needed(n, 32, w, t) == expected
    # Beam fork keeps step 0's request until the slots copied from it.
    assert blocks_needed(n, 32, w, t, beam_fork=True) == with_fork


@pytest.mark.parametrize("n,w,t,expected", [
    # Slots start at the parent: its last token's block is each slot's own.
    (65, 4, 3, 2 + 4 * 1),         # 1 + 3 tokens in the own block
    (64, 4, 3, 1 + 4 * 2),         # the full last block (32) + 3: two own blocks each
    (95, 32, 3, 2 + 32 * 2),       # 31 + 3 tokens
])
def test_blocks_needed_when_the_slots_start_at_the_parent(n, w, t, expected):
    """A search kept in a catalog (``kvhandoff.budget``): one more own block per slot
    where the parent ends a block; with fork, step 0's kept block besides."""
    assert blocks_needed(n, 32, w, t, from_parent=True) == expected
    assert blocks_needed(n, 32, w, t, beam_fork=True, from_parent=True) == expected + 1



def test_a_prompt_not_known_yet_is_counted_at_the_most_any_length_reserves():
    """``stage2_reservation_upto``: the largest over every length, not the longest's
    (3000 tokens reserve 157 blocks for 32 beams of 16, 3008 tokens 126); one length
    is that length's own reservation."""
    from kvhandoff.budget import stage2_reservation, stage2_reservation_upto

    args = (32, 32, 16, True, 1000)
    assert stage2_reservation(3008, *args) == 126 < stage2_reservation(3000, *args) == 157
    assert stage2_reservation_upto(3000, 3008, *args) == 157
    assert stage2_reservation_upto(3008, 3008, *args) == 126
    assert stage2_reservation_upto(2990, 3008, *args) == max(
        stage2_reservation(n, *args) for n in range(2990, 3009))


def test_a_stage_2_the_pool_cannot_hold_reserves_nothing_on_d():
    """D's admission refuses it whatever else runs; meanwhile it must not count against
    the stage 2s that fit (``decode_engine.engine.reserving``)."""
    from types import SimpleNamespace

    from decode_engine.engine import reserving

    engine = SimpleNamespace(num_total_blocks=135, num_reserved_blocks=10)
    with reserving(engine, 157):
        assert engine.num_reserved_blocks == 10
    with reserving(engine, 135):
        assert engine.num_reserved_blocks == 145
    assert engine.num_reserved_blocks == 10


def test_an_import_admission_must_refuse_reserves_nothing_and_none_reserves_past_its_room():
    """A burst on D with one search running (100 of 135 blocks reserved): an import
    whose fewest blocks (fork off) exceed the room admission checks it in (35) is
    refused and reserves nothing; one that fits reserves at most its room. The control,
    the same burst counted without rooms (as before): the refused one's 60 count against
    the next, "160 reserved of 135"."""
    import contextlib
    from types import SimpleNamespace

    from decode_engine.engine import reserving

    burst = [(60, 40), (30, 25), (20, 4)]  # (reservation with fork, fewest blocks)
    for with_room in (True, False):
        engine = SimpleNamespace(num_total_blocks=135, num_reserved_blocks=100)
        seen = []
        with contextlib.ExitStack() as stack:
            for blocks, least in burst:
                room = engine.num_total_blocks - engine.num_reserved_blocks
                stack.enter_context(reserving(engine, blocks, room=room if with_room else None,
                                              least=least))
                seen.append(engine.num_reserved_blocks)
        assert engine.num_reserved_blocks == 100
        if with_room:
            assert seen == [100, 130, 135]  # refused: 0; fits: 30; fits in 5: at most 5
        else:
            assert seen == [160, 190, 210]
    # A stage 2 no admission checks (the colocated path) is counted whole.
    engine = SimpleNamespace(num_total_blocks=135, num_reserved_blocks=100)
    with reserving(engine, 60):
        assert engine.num_reserved_blocks == 160

def test_suffix_does_not_repeat_think_end():
    assert continuation_prompt([5, 3], [3, 9, 4], think_end_id=3) == [5, 3, 9, 4]
    assert continuation_prompt([5, 1], [3, 9, 4], think_end_id=3) == [5, 1, 3, 9, 4]


@pytest.mark.parametrize("fault", ["zero-block", "duplicate-block", "swap-full-blocks",
                                   "layer-swap"])
def test_a_worker_fault_leaves_an_import_too_short_for_it_alone(fault):
    """D's worker faults touch one or two imported blocks: an import with fewer (a short
    parent, ``kvhandoff verify --inject`` on every case) is left as read, not indexed
    past its end (that killed D's engine core), and the fault says it did nothing."""
    import torch

    from connector.faults import FAULTS, corrupt_imported

    need = max(FAULTS[fault].min_full_blocks, 1)
    for blocks in (list(range(need - 1)), list(range(need))):
        views = [(torch.arange(4 * 3, dtype=torch.float32).reshape(4, 3) + 100 * layer, 0)
                 for layer in range(2)]
        before = [t.clone() for t, _ in views]
        done = corrupt_imported(fault, views, [b + 1 for b in blocks], 1)
        changed = any(not torch.equal(t, b) for (t, _), b in zip(views, before))
        assert done == changed == (len(blocks) >= need), (fault, blocks)


def test_an_injected_fault_reaches_the_engine_counters_through_the_connector_stats():
    """A fault counted on the worker or the scheduler side travels in the connector's
    stats like NIXL's own (a stats object holding only faults is not empty: vLLM would
    drop it) and lands in the engine's ``faults_injected``."""
    from connector.stats import ContinuationStats
    from engine.stats import EngineCounters

    worker, scheduler = ContinuationStats(), ContinuationStats()
    assert worker.is_empty()
    worker.record_fault()
    scheduler.record_fault()
    assert not worker.is_empty()
    merged = worker.clone_and_reset().aggregate(scheduler)
    assert worker.is_empty()
    counters = EngineCounters()
    counters.add_connector_stats(merged.data)
    assert counters.faults_injected == 2 and counters.transfers == 0

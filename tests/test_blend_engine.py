"""An approximate composition on a real P (``connector.blend``): chunks pinned on P,
copied into a stage 1's blocks with their keys moved, exported under the composition's
cache salt and imported by a real D under the same salt.

A chunk copied where it was prefilled (position 0, no context before it) is exactly full
prefill's KV: token ids and logprobs identical, with only the query computed. A chunk
moved behind another is approximate (it never attended to what now precedes it): near
full prefill with its keys moved, far from it without (the ``unrotated`` fault: the
negative control that the keys really are moved)."""

from __future__ import annotations

import pytest

from connector.blend_spec import Blend, BlendPart
from connector.handoff import ImportRequest
from kvhandoff.types import BeamParams, Stage1Params, StageError
from prefill_engine.engine import PINNED

pytestmark = [pytest.mark.engines, pytest.mark.chunks]

A = [11 + k % 900 for k in range(48)]
B = [301 + (k * 7) % 500 for k in range(40)]
QUERY = [5, 6, 7, 8, 9]
GREEDY = Stage1Params(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)
ONLY_A = Blend((BlendPart("chunk-bl-0-a", 0, 48, 0),), 48)
A_THEN_B = Blend((BlendPart("chunk-bl-0-a", 0, 48, 0), BlendPart("chunk-bl-1-b", 0, 40, 48)),
                 88)


def _logprobs(result) -> list[float]:
    return [lp.logprob for lp in result.logprobs]


def _gap(result, reference) -> float:
    return sum(abs(a - b) for a, b in zip(_logprobs(result), _logprobs(reference),
                                          strict=True))


def test_chunks_copied_into_a_stage_1_exact_in_place_near_when_moved_and_salted_on_d(
        pair, run, assert_pools_clean):
    p, d = pair.p, pair.d
    pin = Stage1Params(max_tokens=1, seed=0)
    run(p.run_stage1(A, pin, "chunk-bl-0-a", export=False, hold=PINNED))
    run(p.run_stage1(B, pin, "chunk-bl-1-b", export=False, hold=PINNED))
    prompt = A + B + QUERY
    try:
        def composed(name: str, blend: Blend, fault: str | None = None):
            s1 = run(p.run_stage1(prompt, GREEDY, name, export=True,
                                  target=d.handoff_target, blend=blend, fault=fault))
            beam = BeamParams(beam_width=1, max_tokens=2)
            s2 = run(d.run_stage2(prompt + s1.token_ids + [4], beam, f"{name}-d",
                                  handoff=ImportRequest.for_beams(s1.handoff_params, beam),
                                  sampling=Stage1Params(max_tokens=2, temperature=0)))
            # D imported the salted export whole: the parent but its last token.
            assert s2.num_imported_tokens == len(prompt) + len(s1.token_ids) - 1, name
            return s1

        in_place = composed("bl-a", ONLY_A)
        moved = composed("bl-ab", A_THEN_B)
        unrotated = composed("bl-ab-unrotated", A_THEN_B, fault="unrotated")

        # Full prefill, after them: the salt kept their approximate KV apart. The same
        # prompt sent plain finds on P only chunk A's exact held block (32 of its 48
        # tokens), and on D nothing (it imports the whole parent).
        full = run(p.run_stage1(prompt, GREEDY, "bl-full", export=True,
                                target=d.handoff_target))
        assert full.num_computed_tokens == len(prompt) - 32
        beam = BeamParams(beam_width=1, max_tokens=2)
        plain = run(d.run_stage2(prompt + full.token_ids + [4], beam, "bl-full-d",
                                 handoff=ImportRequest.for_beams(full.handoff_params, beam),
                                 sampling=Stage1Params(max_tokens=2, temperature=0)))
        assert plain.num_imported_tokens == len(prompt) + len(full.token_ids) - 1, \
            "D served an unsalted request from an approximate composition's blocks"

        assert (in_place.num_blended_tokens, in_place.blend_refused) == (48, "")
        assert in_place.num_computed_tokens == len(prompt) - 48
        assert (in_place.token_ids, _logprobs(in_place)) == (full.token_ids, _logprobs(full))
        assert moved.num_blended_tokens == 88 and moved.num_computed_tokens == len(QUERY)
        assert unrotated.num_blended_tokens == 88
        assert _gap(moved, full) > 0, "a moved chunk matched full prefill exactly"
        assert _gap(unrotated, full) > 3 * _gap(moved, full), (
            f"keys left at their old positions are no further from full prefill "
            f"({_gap(unrotated, full):.3f}) than moved ones ({_gap(moved, full):.3f})")

        # D's admission: the salted KV does not go into a request without the salt.
        again = run(p.run_stage1(prompt, GREEDY, "bl-ab-2", export=True,
                                 target=d.handoff_target, blend=A_THEN_B))
        beam = BeamParams(beam_width=1, max_tokens=2)
        with pytest.raises(StageError) as refused:
            run(_unsalted_import(d, prompt + again.token_ids + [4], beam,
                                 ImportRequest.for_beams(again.handoff_params, beam)))
        assert refused.value.reason == "salt", refused.value
    finally:
        run(p.release(["chunk-bl-0-a", "chunk-bl-1-b"]))
    assert_pools_clean()


async def _unsalted_import(d, prompt, beam, handoff: ImportRequest):
    """D's import of ``handoff`` as a request without a cache salt would make it."""
    from decode_engine.engine import run_sample_stage

    return await run_sample_stage(d, prompt, Stage1Params(max_tokens=2, temperature=0),
                                  "bl-unsalted", first_step_extra_args={
                                      "kv_transfer_params": handoff.to_params()})


def test_p_refuses_an_approximate_composition_it_cannot_honour_and_computes_it(
        pair, run, assert_pools_clean):
    """A source not held there: nothing copied, the prompt computed, the reason said;
    and a composition held for continuations on P is refused up front."""
    from kvhandoff.types import InvalidRequest

    prompt = A + B + QUERY
    # Sources never held here (and a salt of their own: no earlier composition's blocks).
    gone = Blend((BlendPart("chunk-bl-9-gone", 0, 48, 0),
                  BlendPart("chunk-bl-9-gone-too", 0, 40, 48)), 88)
    s1 = run(pair.p.run_stage1(prompt, GREEDY, "bl-gone", export=False, blend=gone))
    assert s1.num_blended_tokens == 0 and "not held here" in s1.blend_refused
    assert s1.num_computed_tokens == len(prompt)
    with pytest.raises(InvalidRequest, match="blend"):
        run(pair.p.run_stage1(prompt, GREEDY, "bl-held", export=False, hold=True,
                              blend=A_THEN_B))
    assert_pools_clean()

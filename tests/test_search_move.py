"""A running beam search moved from one D to another (issue 59, engine level): D stops it
at a beam step and exports its prompt's KV; the other D imports that over NIXL, recomputes
each live beam's own tokens, and runs the steps left. Real engines, real NIXL. The final
beams must equal the unmoved search's and vLLM's own ``beam_search``'s; the negative
controls (a wrong state handed over, a block of the moved KV lost) must not."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from connector.handoff import ImportRequest
from decode_engine.engine import run_beam_stage
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.types import BeamParams
from tests.utils import make_request
from tools.harness import LOGPROB_TOLERANCE

pytestmark = [pytest.mark.engines, pytest.mark.beams]


def _stage2_prompt(pair, run, rid: str, prompt_len: int = 150) -> tuple[list[int], object]:
    """A parent exported by P (stage 1 ending at </think>) and stage 2's prompt."""
    req = make_request(pair, request_id=rid, prompt_len=prompt_len)
    s1 = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, f"{rid}-p", export=True))
    return req.prompt_token_ids + s1.token_ids + req.suffix_token_ids, s1


def _stopped(pair, run, rid: str, beam: BeamParams, k: int, prompt_len: int = 150):
    """Stage 2 by handoff on D, stopped to move once ``k`` beam steps ran."""
    prompt, s1 = _stage2_prompt(pair, run, rid, prompt_len)
    out = run(pair.d.run_stage2(prompt, beam, rid,
                                handoff=ImportRequest.for_beams(s1.handoff_params, beam),
                                stop_at=k))
    assert out.beams == [] and out.stopped is not None, "the search was not stopped"
    return prompt, out.stopped


def _resume(pair, run, stopped, beam: BeamParams, rid: str, fault: str | None = None):
    return run(pair.d2.run_stage2(stopped.prompt, beam, rid, moved=stopped,
                                  handoff=ImportRequest.for_beams(stopped.export, beam,
                                                                  fault=fault)))


def _same(got, ref) -> bool:
    return ([list(b.token_ids) for b in got] == [list(b.token_ids) for b in ref]
            and all(abs(a.cum_logprob - b.cum_logprob) <= LOGPROB_TOLERANCE
                    for a, b in zip(got, ref)))


@pytest.mark.parametrize("width,steps,k", [(4, 3, 1), (4, 3, 2), (4, 8, 7), (32, 8, 1),
                                           (32, 3, 2)])
def test_a_search_moved_at_step_k_ends_as_the_unmoved_one_and_as_vllms(
        pair, run, assert_pools_clean, width, steps, k):
    beam = BeamParams(beam_width=width, max_tokens=steps)
    rid = f"smove-{width}-{steps}-{k}"
    prompt, stopped = _stopped(pair, run, rid, beam, k)
    assert stopped.steps_done == k
    assert all(len(tokens) == k for tokens, _ in stopped.live)
    assert stopped.prompt == prompt
    moved = _resume(pair, run, stopped, beam, f"{rid}-r")
    # D' read the prompt's KV from D (all but its last token) and computed each live
    # beam's own tokens at the slots' first step, one token per beam after that.
    assert moved.num_imported_tokens == len(prompt) - 1
    assert moved.step_computed_tokens[2:] == [len(stopped.live)] * (steps - k - 1)
    unmoved = run(run_beam_stage(pair.d, prompt, beam, f"{rid}-u"))
    theirs = run(vllm_beam_search(pair.d.llm, pair.tokenizer, prompt, beam, f"{rid}-v"))
    assert _same(moved.beams, unmoved.beams), (moved.beams, unmoved.beams)
    assert _same(moved.beams, theirs), (moved.beams, theirs)
    assert_pools_clean()
    snap = run(pair.d2.wait_pool_clean(5.0))
    assert snap.is_clean, snap


def test_a_constrained_search_moves_inside_its_catalog(pair, run, assert_pools_clean):
    """The catalog's trie state is rebuilt on D' from each beam's tokens so far."""
    beam = BeamParams(beam_width=8, max_tokens=6, catalog="shop")
    prompt, stopped = _stopped(pair, run, "smove-cat", beam, 3)
    moved = _resume(pair, run, stopped, beam, "smove-cat-r")
    unmoved = run(run_beam_stage(pair.d, prompt, beam, "smove-cat-u"))
    assert moved.beams and _same(moved.beams, unmoved.beams), (moved.beams, unmoved.beams)
    assert moved.num_dropped_beams == unmoved.num_dropped_beams
    assert_pools_clean()


@pytest.mark.parametrize("control", ["swap-tails", "step-off-by-one", "zero-block"])
def test_negative_controls_a_wrong_move_gives_other_beams(pair, run, assert_pools_clean,
                                                          control):
    """Each a fault in what the move hands over: two live beams' tokens swapped (their
    scores kept), the step counter one too many, and (an injected READ fault) one block
    of the prompt's moved KV zeroed on D'. Each must fail the identity check. EOS is
    ignored: every beam runs all its steps (the built-in model's beams would end by EOS
    before a lost step shows)."""
    beam = BeamParams(beam_width=4, max_tokens=8, ignore_eos=True)
    prompt, stopped = _stopped(pair, run, f"smove-ctl-{control}", beam, 4)
    fault = None
    if control == "swap-tails":
        live = list(stopped.live)
        (a, ca), (b, cb) = live[0], live[1]
        assert a != b
        live[0], live[1] = (b, ca), (a, cb)
        stopped = dataclasses.replace(stopped, live=live)
    elif control == "step-off-by-one":
        stopped = dataclasses.replace(stopped, steps_done=stopped.steps_done + 1)
    else:
        fault = control
    before = pair.d2.counters.faults_injected
    moved = _resume(pair, run, stopped, beam, f"smove-ctl-{control}-r", fault=fault)
    if fault is not None:
        assert pair.d2.counters.faults_injected > before, "the fault never took effect"
    unmoved = run(run_beam_stage(pair.d, prompt, beam, f"smove-ctl-{control}-u"))
    assert not _same(moved.beams, unmoved.beams), f"{control}: the moved beams are the same"
    run(pair.d2.empty_prefix_cache())  # the zeroed block must not serve anyone later
    assert_pools_clean()


def test_the_engines_stop_moves_a_running_search(pair, run, assert_pools_clean):
    """``stop_searches`` (what the router's Move sends) stops a search while it runs,
    whatever step it is at: the stage 2 returns stopped, D keeps nothing once D' has
    read the export, and the resumed beams are the unmoved ones. A stop naming no
    running search changes nothing."""
    beam = BeamParams(beam_width=8, max_tokens=8)
    prompt, s1 = _stage2_prompt(pair, run, "smove-live")

    async def stop_while_running(rid: str, handoff):
        stage2 = asyncio.ensure_future(pair.d.run_stage2(prompt, beam, rid, handoff=handoff))
        # As the router does: D drops a stop that reaches it before the search does.
        while not stage2.done():
            await pair.d.stop_searches([rid, "no-such-search"])
            await asyncio.sleep(0.02)
        return await stage2

    for attempt in range(3):  # a search may still end before a stop reaches it
        if attempt:
            _, s1 = _stage2_prompt(pair, run, "smove-live")
        out = run(stop_while_running(f"smove-live-{attempt}",
                                     ImportRequest.for_beams(s1.handoff_params, beam)))
        if out.stopped is not None:
            break
    assert out.stopped is not None, "every search of 3 ended before the stop reached it"
    assert 1 <= out.stopped.steps_done < beam.max_tokens
    moved = _resume(pair, run, out.stopped, beam, "smove-live-r")
    unmoved = run(run_beam_stage(pair.d, prompt, beam, "smove-live-u"))
    assert _same(moved.beams, unmoved.beams), (moved.beams, unmoved.beams)
    # The stop of an id that ran no search was dropped: the next search runs to its end.
    again = run(run_beam_stage(pair.d, prompt, beam, "no-such-search"))
    assert again.stopped is None and _same(again.beams, unmoved.beams)
    assert_pools_clean()


def test_a_move_whose_beams_share_a_whole_block_of_their_own_tokens(
        pair, run, assert_pools_clean):
    """Stage 2's prompt ends 2 tokens before a block edge and the search moves after 4
    steps: each live beam's own tokens fill that block, and beams that start alike
    hold the same tokens in it. On D' they must still hold it each alone (a parent's
    blocks are copied into its children's, which must be theirs alone), not share it as
    a prefix hit: each slot computes its own tokens. Colocated on D (D computes the
    prompt), so its length is exact."""
    import random

    rng = random.Random(7)
    block = pair.d.block_size
    prompt = [rng.randrange(6, pair.d.vocab_size) for _ in range(5 * block - 2)]
    beam = BeamParams(beam_width=16, max_tokens=12, ignore_eos=True)
    out = run(run_beam_stage(pair.d, prompt, beam, "smove-edge", stop_at=4))
    stopped = out.stopped
    assert stopped is not None and stopped.steps_done == 4
    starts = [tuple(tokens[:2]) for tokens, _ in stopped.live]
    assert len(set(starts)) < len(starts), "no two live beams share the block's tokens"
    moved = _resume(pair, run, stopped, beam, "smove-edge-r")
    # Each slot computed all its own tokens: none found another's block as a hit.
    assert moved.beam_steps["first_computed"] == len(stopped.live) * stopped.steps_done
    unmoved = run(run_beam_stage(pair.d, prompt, beam, "smove-edge-u"))
    assert _same(moved.beams, unmoved.beams), (moved.beams, unmoved.beams)
    assert_pools_clean()


def test_a_search_under_a_cache_salt_moves_under_it(pair, run, assert_pools_clean):
    """A search run under a cache salt (an approximate composition's) exports its
    prompt's KV under that salt, and the D it moves to resumes it under the same one
    (its blocks hash under it: nothing unsalted finds them)."""
    import random

    from connector.params import KEY

    rng = random.Random(11)
    prompt = [rng.randrange(6, pair.d.vocab_size) for _ in range(140)]
    beam = BeamParams(beam_width=4, max_tokens=6, ignore_eos=True)
    out = run(run_beam_stage(pair.d, prompt, beam, "smove-salt", cache_salt="blend-x",
                             stop_at=3))
    stopped = out.stopped
    assert stopped is not None and stopped.export[KEY]["cache_salt"] == "blend-x"
    moved = _resume(pair, run, stopped, beam, "smove-salt-r")
    assert moved.num_imported_tokens == len(prompt) - 1
    unmoved = run(run_beam_stage(pair.d, prompt, beam, "smove-salt-u", cache_salt="blend-x"))
    assert _same(moved.beams, unmoved.beams), (moved.beams, unmoved.beams)
    run(pair.d2.empty_prefix_cache())
    assert_pools_clean()

"""Our beam search on a real engine against vLLM's own (the unit level, on a scripted
model: ``tests/test_beam_slots.py``)."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_engine.beam import beam_search
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.types import BeamParams

pytestmark = pytest.mark.beams


@pytest.mark.engines
@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (4, 1.0), (8, 0.5)])
def test_same_beams_as_vllms_own_beam_search(pair, run, width, length_penalty):
    """With and without beam fork, token for token; with it, the slots' first step
    computes one token per beam (without it, each slot recomputes the partial last
    block of the parent), and every later step one per beam."""
    rng = random.Random(width)
    prompt = [rng.randrange(6, pair.d.vocab_size) for _ in range(90)]
    params = BeamParams(beam_width=width, max_tokens=3, length_penalty=length_penalty)
    theirs = run(vllm_beam_search(pair.d.llm, pair.tokenizer, prompt, params, f"vllm-{width}"))
    for fork in (True, False):
        out = run(beam_search(pair.d.generate, prompt, params, eos_token_id=pair.eos_id,
                              request_id=f"ours-{width}-{fork}", fork=fork))
        assert [b.token_ids for b in out.beams] == [b.token_ids for b in theirs], fork
        for a, b in zip(out.beams, theirs):
            assert abs(a.cum_logprob - b.cum_logprob) <= 1e-5
        later = out.step_computed_tokens[1:]
        if fork:
            assert later == [width, width], out.step_computed_tokens
            assert out.recomputed_tokens == 0
        else:
            # A slot's prompt is 91 tokens: 27 past the last full 32-token block.
            assert later == [width * 27, width], out.step_computed_tokens
            assert out.recomputed_tokens == width * 26
    assert run(pair.d.wait_pool_clean(15.0)).is_clean


@pytest.mark.fault
@pytest.mark.engines
def test_prefix_blocks_evicted_before_the_slots_are_recomputed_and_reported(pair, run):
    """D's pool under pressure after step 0, at its most extreme: the whole prefix cache
    is dropped before the slots start. The beams are the same; the outcome reports the
    recomputed context."""
    rng = random.Random(7)
    prompt = [rng.randrange(6, pair.d.vocab_size) for _ in range(90)]
    params = BeamParams(beam_width=4, max_tokens=3)
    reset: list[asyncio.Future] = []
    step0_done = asyncio.Event()

    async def evicting_generate(tokens, sampling, request_id):
        if request_id.startswith("evict-g"):  # a slot ("<request>-g<slot>")
            # The slots' leader goes with step 0: it waits for step 0's end and the
            # drop, made while D is idle; the engine then fills it in from step 0's
            # result kept past its request (decode_engine.slot_fill).
            await step0_done.wait()
            if not reset:
                reset.append(asyncio.ensure_future(pair.d.llm.reset_prefix_cache()))
            await reset[0]
        try:
            return await pair.d.generate(tokens, sampling, request_id)
        finally:
            if request_id.endswith("-s0"):
                step0_done.set()

    kept = run(beam_search(pair.d.generate, prompt, params, eos_token_id=pair.eos_id,
                           request_id="evict-ref"))
    evicted = run(beam_search(evicting_generate, prompt, params, eos_token_id=pair.eos_id,
                              request_id="evict"))
    assert [f.result() for f in reset] == [True], "the prefix cache could not be dropped"
    assert [b.token_ids for b in evicted.beams] == [b.token_ids for b in kept.beams]
    for a, b in zip(evicted.beams, kept.beams):
        assert abs(a.cum_logprob - b.cum_logprob) <= 1e-5
    # Slot 0 recomputes all 90 + 1 - 1 context tokens; the others share the full blocks
    # it computes in the same step, so they redo only the partial block.
    assert evicted.recomputed_tokens > kept.recomputed_tokens
    assert evicted.step_computed_tokens[1] >= 90 + 3 * 27
    assert run(pair.d.wait_pool_clean(15.0)).is_clean

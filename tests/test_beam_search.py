"""Our beam search: vLLM's semantics, checked against a scripted model and against
vLLM's own beam search on a real engine."""

from __future__ import annotations

import asyncio
import math
import random
from types import SimpleNamespace

import pytest

from decode_engine.beam import beam_score, beam_search, vllm_beam_search
from kvhandoff.types import BeamParams

EOS = 1
VOCAB = 12


def _scripted_generate(calls: list):
    """A fake engine: deterministic logprobs per prefix (a unit test of this layer only)."""

    async def generate(prompt, sampling, request_id):
        calls.append((list(prompt), sampling.extra_args, request_id))
        rng = random.Random(str(prompt))
        logits = [rng.gauss(0, 2) for _ in range(VOCAB)]
        z = math.log(sum(math.exp(x) for x in logits))
        ranked = sorted(range(VOCAB), key=lambda t: -logits[t])[: sampling.logprobs]
        lp = {t: SimpleNamespace(logprob=logits[t] - z) for t in ranked}
        return SimpleNamespace(
            outputs=[SimpleNamespace(logprobs=[lp], finish_reason="length")],
            prompt_token_ids=list(prompt), num_cached_tokens=len(prompt) - 1,
            kv_transfer_params=None,
        )

    return generate


def _exhaustive_greedy(prompt, steps):
    seq, calls = list(prompt), []
    for _ in range(steps):
        out = asyncio.run(_scripted_generate(calls)(seq, SimpleNamespace(logprobs=1, extra_args=None), "g"))
        ((token, _),) = out.outputs[0].logprobs[0].items()
        seq.append(token)
        if token == EOS:
            break
    return seq[len(prompt):]


def test_width_one_is_greedy():
    prompt = [5, 6, 7]
    out = asyncio.run(beam_search(_scripted_generate([]), prompt, BeamParams(beam_width=1, max_tokens=5),
                                  eos_token_id=EOS, request_id="r"))
    assert out.beams[0].token_ids == _exhaustive_greedy(prompt, 5)


def test_import_args_ride_on_step_zero_only_and_one_request_per_live_beam():
    calls: list = []
    params = BeamParams(beam_width=4, max_tokens=3, ignore_eos=True)
    out = asyncio.run(beam_search(_scripted_generate(calls), [5, 6, 7], params, eos_token_id=EOS,
                                  request_id="r", first_step_extra_args={"kv_transfer_params": {"x": 1}}))
    assert [c[1] for c in calls] == [{"kv_transfer_params": {"x": 1}}] + [None] * 8
    assert len({c[2] for c in calls}) == len(calls), "request ids must be unique"
    assert len(out.beams) == 4 and all(len(b.token_ids) == 3 for b in out.beams)
    scores = [beam_score([5, 6, 7] + b.token_ids, b.cum_logprob, EOS, 1.0) for b in out.beams]
    assert scores == sorted(scores, reverse=True)
    assert out.step_computed_tokens == [1, 4, 4] and out.recomputed_tokens == 0


def test_score_matches_vllm():
    from vllm.entrypoints.generate.beam_search.utils import get_beam_search_score

    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))]
        cum, lp = -rng.random() * 10, rng.choice([0.0, 0.5, 1.0, 2.0])
        assert beam_score(tokens, cum, EOS, lp) == get_beam_search_score(tokens, cum, EOS, lp)


@pytest.mark.engines
@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (4, 1.0), (8, 0.5)])
def test_same_beams_as_vllms_own_beam_search(pair, run, width, length_penalty):
    """With and without beam fork, token for token; with it, later steps compute one
    token per beam (without it, each beam recomputes its partial last block)."""
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
            # 90 + step tokens: 26 + step tokens past the last full 32-token block.
            assert later == [width * 27, width * 28], out.step_computed_tokens
            assert out.recomputed_tokens == width * 26 + width * 27
    assert run(pair.d.wait_pool_clean(15.0)).is_clean


@pytest.mark.fault
@pytest.mark.engines
def test_prefix_blocks_evicted_between_steps_are_recomputed_and_reported(pair, run):
    """D's pool under pressure between beam steps, at its most extreme: the whole prefix
    cache is dropped before every step after the first. The beams are the same; the
    outcome reports the recomputed context."""
    rng = random.Random(7)
    prompt = [rng.randrange(6, pair.d.vocab_size) for _ in range(90)]
    params = BeamParams(beam_width=4, max_tokens=3)
    resets: dict[str, asyncio.Future] = {}

    async def evicting_generate(tokens, sampling, request_id):
        step = request_id.rsplit("b", 1)[0]  # "evict-s1"
        if not step.endswith("-s0"):
            # Every request of the step waits for the drop, made while D is idle.
            if step not in resets:
                resets[step] = asyncio.ensure_future(pair.d.llm.reset_prefix_cache())
            await resets[step]
        return await pair.d.generate(tokens, sampling, request_id)

    kept = run(beam_search(pair.d.generate, prompt, params, eos_token_id=pair.eos_id,
                           request_id="evict-ref"))
    evicted = run(beam_search(evicting_generate, prompt, params, eos_token_id=pair.eos_id,
                              request_id="evict"))
    assert [f.result() for f in resets.values()] == [True, True], \
        "the prefix cache could not be dropped between steps"
    assert [b.token_ids for b in evicted.beams] == [b.token_ids for b in kept.beams]
    for a, b in zip(evicted.beams, kept.beams):
        assert abs(a.cum_logprob - b.cum_logprob) <= 1e-5
    # Step 1's first beam recomputes all 90 + 1 - 1 context tokens; its siblings share
    # the blocks it recomputed (full blocks only), so they redo only their partial block.
    assert evicted.recomputed_tokens > kept.recomputed_tokens
    assert evicted.step_computed_tokens[1] >= 90 + 3 * 27
    assert run(pair.d.wait_pool_clean(15.0)).is_clean

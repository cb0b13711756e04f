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


def _tied_generate(prompt, logprobs_num):
    """A scripted step whose logprobs come in steps of 1/4 (exactly equal values, as bf16's
    coarse logits give): every step has ties, at the cutoff too. Dict order is rank order
    with ties in token order, as vLLM's logprobs come (the sampled token first)."""
    rng = random.Random(str(prompt))
    logits = [round(rng.gauss(0, 1.5) * 4) / 4 for _ in range(VOCAB)]
    z = math.log(sum(math.exp(x) for x in logits))
    ranked = sorted(range(VOCAB), key=lambda t: -logits[t])[:logprobs_num]
    return {t: SimpleNamespace(logprob=logits[t] - z, rank=r + 1, decoded_token=None)
            for r, t in enumerate(ranked)}


def _vllm_online_beam_search(prompt, params):
    """vLLM's own online beam search (the code, unchanged) over the scripted model."""
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.inputs import tokens_input
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import BeamSearchParams

    async def generate(prompt_item, sampling, request_id, **_):
        tokens = list(prompt_item["prompt_token_ids"])
        yield RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=tokens,
            prompt_logprobs=None, finished=True,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None,
                                      logprobs=[_tied_generate(tokens, sampling.logprobs)],
                                      finish_reason="length")])

    class Peer(BeamSearchOnlineMixin):
        engine_client = SimpleNamespace(generate=generate, input_processor=SimpleNamespace(
            resolve_watermarking=lambda p: None))
        renderer = SimpleNamespace(get_tokenizer=lambda: SimpleNamespace(
            eos_token_id=EOS, decode=lambda tokens, **_: ""))

    search = BeamSearchParams(beam_width=params.beam_width, max_tokens=params.max_tokens,
                              length_penalty=params.length_penalty,
                              ignore_eos=params.ignore_eos, include_stop_str_in_output=True)

    async def final():
        outs = [out async for out in Peer().beam_search(tokens_input(prompt), "r", search)]
        return [(list(c.token_ids), c.cumulative_logprob) for c in outs[-1].outputs]

    return asyncio.run(final())


def _ours_on_tied(prompt, params):
    async def generate(tokens, sampling, request_id):
        return SimpleNamespace(
            outputs=[SimpleNamespace(logprobs=[_tied_generate(tokens, sampling.logprobs)],
                                     finish_reason="length")],
            prompt_token_ids=list(tokens), num_cached_tokens=len(tokens) - 1,
            kv_transfer_params=None)

    out = asyncio.run(beam_search(generate, prompt, params, eos_token_id=EOS, request_id="r"))
    return [(b.token_ids, b.cum_logprob) for b in out.beams]


#: (prompt, width, max_tokens, length penalty, ignore_eos): widths at, under and over
#: the scripted vocabulary's candidates per step.
TIED_CASES = [([3 + i % 7, 4, i], w, t, lp, ie)
              for i, (w, t, lp, ie) in enumerate([(2, 4, 1.0, False), (3, 3, 1.0, False),
                                                  (4, 4, 0.5, False), (5, 3, 1.0, True),
                                                  (8, 3, 2.0, False), (16, 3, 1.0, False),
                                                  (24, 3, 1.0, True), (7, 5, 1.0, False)])]


def test_exact_ties_resolve_as_in_vllms_own_beam_search(monkeypatch):
    """Scores tie exactly at every step; our beams equal vLLM's online beam search's
    (token ids, order and cumulative logprobs, bit for bit). Control: the same search
    picking a step's W in candidate order (a stable sort, our rule before) leaves vLLM's
    beams on some of these cases."""
    import numpy as np

    import decode_engine.beam

    for prompt, width, tokens, lp, ignore_eos in TIED_CASES:
        params = BeamParams(beam_width=width, max_tokens=tokens, length_penalty=lp,
                            ignore_eos=ignore_eos)
        assert _ours_on_tied(prompt, params) == _vllm_online_beam_search(prompt, params), (
            prompt, width)

    def stable(cums, width):
        return np.argsort(-cums, kind="stable")[:width]

    monkeypatch.setattr(decode_engine.beam, "top_candidates", stable)
    differ = [case for case in TIED_CASES
              if _ours_on_tied(case[0], BeamParams(*case[1:3], length_penalty=case[3],
                                                   ignore_eos=case[4]))
              != _vllm_online_beam_search(case[0], BeamParams(*case[1:3],
                                                               length_penalty=case[3],
                                                               ignore_eos=case[4]))]
    assert differ, "no case has a tie that numpy resolves otherwise than candidate order"


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

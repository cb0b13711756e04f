"""Beam search over any engine's ``generate``, with vLLM's beam-search semantics.

vLLM v1 runs beam search in its frontend (the online one its server runs,
``BeamSearchOnlineMixin.beam_search``): every step sends one ``max_tokens=1,
logprobs=2W`` request per live beam, extends each beam by every returned candidate,
moves EOS-terminated candidates to ``completed``, keeps the W candidates of highest
``cum_logprob``, and at the end returns the W best of ``completed`` and the live beams
by ``cum_logprob / len(tokens) ** length_penalty`` (len counts the prompt, minus a
trailing EOS). This module does the same, token for token, but over our own
``generate`` so that step 0 can carry ``kv_transfer_params`` (the import) and later
steps hit the stage-2 engine's prefix cache. Ties resolve as there: a step's W are
picked by the same numpy calls on the candidates in the same order (``top_candidates``),
the final order by a stable sort.

With ``fork=True`` (engines running our connector) every step's requests are kept
when they end, and each next-step beam copies the partial last block of the request
it extends instead of recomputing it (see ``connector.nixl_continuation``): a step
then computes one token per beam rather than up to ``block_size``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from connector.handoff import BEAM_KEY, KEY
from kvhandoff.types import Beam, BeamParams, StageError

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

GenerateFn = Callable[[list[int], "SamplingParams", str], Awaitable["RequestOutput"]]


@dataclass(slots=True)
class _Sequence:
    tokens: list[int]  # prompt + generated, as in vLLM's BeamSearchSequence
    cum_logprob: float = 0.0
    source: str | None = None  # the request whose output gave the last token


def _fork_params(beams: list[_Sequence], names: list[str], previous: list[str],
                 keep: bool, group: str) -> list[dict[str, Any]]:
    """Per request of one step: its name, whether it is kept, which request it extends,
    how many siblings extend that one, (first request) the kept ones nobody extends, and
    the step it belongs to with its number of requests (D schedules them together)."""
    children: dict[str, int] = {}
    for seq in beams:
        if seq.source is not None:
            children[seq.source] = children.get(seq.source, 0) + 1
    out = []
    for i, (seq, name) in enumerate(zip(beams, names)):
        beam: dict[str, Any] = {"id": name, "keep": keep, "step_group": group,
                                "step_size": len(beams)}
        if seq.source is not None:
            beam["fork_from"] = seq.source
            beam["fork_children"] = children[seq.source]
        if i == 0:
            beam["fork_release"] = [n for n in previous if n not in children]
        out.append(beam)
    return out


def beam_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
               length_penalty: float) -> float:
    """vLLM's ``get_beam_search_score``."""
    seq_len = len(tokens)
    if tokens[-1] == eos_token_id:
        seq_len -= 1
    return cum_logprob / (max(seq_len, 1) ** length_penalty)


@dataclass(slots=True)
class BeamSearchOutcome:
    beams: list[Beam]
    first_output: Any  # the RequestOutput of step 0 (carries the import stats)
    first_step_s: float
    #: Per step: tokens computed by the engine (prompt tokens minus cached tokens).
    step_computed_tokens: list[int] = field(default_factory=list)
    #: Tokens beam steps after the first computed beyond the one new token per beam: the
    #: context they found neither cached nor forked (a partial last block without the
    #: fork; prefix blocks evicted between steps when D's pool is under pressure).
    recomputed_tokens: int = 0


def error_message(out: Any) -> str:
    params = out.kv_transfer_params or {}
    info = params.get("kvhandoff") or {}
    return info.get("error") or "the engine finished the request with an error"


def _step_extras(beams: list[_Sequence], names: list[str], step: int, params: BeamParams,
                 first_step_extra_args: dict[str, Any] | None, fork: bool,
                 previous: list[str]) -> tuple[list[dict[str, Any] | None], list[str]]:
    """Each request's ``extra_args`` for one step, and the names kept for the next."""
    extras: list[dict[str, Any] | None] = [
        first_step_extra_args if step == 0 else None for _ in beams
    ]
    if not fork:
        return extras, previous
    keep = step + 1 < params.max_tokens
    group = names[0].rsplit("b", 1)[0]  # "<request id>-s<step>"
    for i, beam in enumerate(_fork_params(beams, names, previous, keep, group)):
        extra = dict(extras[i] or {})
        extra["kv_transfer_params"] = {**(extra.get("kv_transfer_params") or {}), BEAM_KEY: beam}
        extras[i] = extra
    return extras, names if keep else []


def _check_outputs(outputs: list[Any]) -> None:
    """A step whose request the engine ended with an error or abort ends the search."""
    for out in outputs:
        if out.outputs[0].finish_reason in ("error", "abort"):
            reason = ((out.kv_transfer_params or {}).get("kvhandoff") or {}).get(
                "reason", out.outputs[0].finish_reason
            )
            raise StageError("stage2", reason, error_message(out))


def top_candidates(cum_logprobs: np.ndarray, width: int) -> np.ndarray:
    """Indices of the ``width`` candidates of highest cumulative logprob, best first,
    picked by the numpy calls vLLM's online beam search makes (vllm 0.32,
    ``entrypoints/generate/beam_search/online.py``). Neither call is stable: among
    exactly equal scores (frequent in bf16) the pick is numpy's, deterministic for a given
    array, so the same candidates in the same order give vLLM's beams, ties included."""
    if len(cum_logprobs) <= width:
        return np.argsort(-cum_logprobs)
    top = np.argpartition(-cum_logprobs, width - 1)[:width]
    return top[np.argsort(-cum_logprobs[top])]


def _extend(beams: list[_Sequence], outputs: list[Any], names: list[str], step: int,
            request_id: str, eos_token_id: int | None, ignore_eos: bool,
            completed: list[_Sequence], width: int) -> list[_Sequence]:
    """The ``width`` best candidates of one step; those ending by EOS go to ``completed``.
    Candidates are ranked before their token lists are built: at W=32 a step has 2048
    of them, and copying each parent's ~600 tokens cost ~10 ms a step."""
    candidates: list[tuple[float, _Sequence, int, str]] = []
    for seq, out, name in zip(beams, outputs, names):
        logprobs = out.outputs[0].logprobs
        assert logprobs, f"{request_id}: step {step} returned no logprobs"
        for token_id, lp in logprobs[0].items():
            cum = seq.cum_logprob + lp.logprob
            if token_id == eos_token_id and not ignore_eos:
                completed.append(_Sequence(seq.tokens + [token_id], cum, name))
                continue
            candidates.append((cum, seq, token_id, name))
    cums = np.fromiter((c[0] for c in candidates), dtype=np.float64, count=len(candidates))
    return [_Sequence(seq.tokens + [token_id], cum, name)
            for cum, seq, token_id, name in (candidates[int(i)]
                                             for i in top_candidates(cums, width))]


async def beam_search(
    generate: GenerateFn,
    prompt_token_ids: list[int],
    params: BeamParams,
    *,
    eos_token_id: int | None,
    request_id: str,
    first_step_extra_args: dict[str, Any] | None = None,
    fork: bool = False,
    held_parent: str | None = None,
) -> BeamSearchOutcome:
    """Run beam search; ``first_step_extra_args`` go on the single step-0 request;
    ``fork`` shares each beam's partial last block with the next step (see above);
    ``held_parent`` (with ``fork``): a parent held on this engine that step 0 copies
    what its prefix-cache hit lacks from (``connector.beam_fork``)."""
    from vllm import SamplingParams

    def sampling(extra_args: dict[str, Any] | None) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width,
                              detokenize=False, extra_args=extra_args)

    def score(seq: _Sequence) -> float:
        return beam_score(seq.tokens, seq.cum_logprob, eos_token_id, params.length_penalty)

    beams = [_Sequence(tokens=list(prompt_token_ids), source=held_parent if fork else None)]
    completed: list[_Sequence] = []
    t0 = time.perf_counter()
    first_output, first_step_s = None, 0.0
    step_computed: list[int] = []
    recomputed = 0
    previous: list[str] = []
    for step in range(params.max_tokens):
        if not beams:
            break
        names = [f"{request_id}-s{step}b{i}" for i in range(len(beams))]
        extras, previous = _step_extras(beams, names, step, params, first_step_extra_args,
                                        fork, previous)
        outputs = await asyncio.gather(*(
            generate(seq.tokens, sampling(extra), name)
            for seq, extra, name in zip(beams, extras, names)))
        if step == 0:
            first_output, first_step_s = outputs[0], time.perf_counter() - t0
            info = ((first_output.kv_transfer_params or {}).get(KEY)) or {}
            if info.get("beam_fork_disabled"):
                fork, previous = False, []  # step 0 was not kept either
        _check_outputs(outputs)
        computed = [len(out.prompt_token_ids) - (out.num_cached_tokens or 0) for out in outputs]
        step_computed.append(sum(computed))
        if step > 0:
            recomputed += sum(max(n - 1, 0) for n in computed)
        beams = _extend(beams, outputs, names, step, request_id, eos_token_id,
                        params.ignore_eos, completed, params.beam_width)

    completed.extend(beams)
    best = sorted(completed, key=score, reverse=True)[:params.beam_width]
    return BeamSearchOutcome(
        beams=[_beam(seq, len(prompt_token_ids), eos_token_id, params.ignore_eos)
               for seq in best],
        first_output=first_output,
        first_step_s=first_step_s,
        step_computed_tokens=step_computed,
        recomputed_tokens=recomputed,
    )


def _beam(seq: _Sequence, prompt_len: int, eos_token_id: int | None, ignore_eos: bool) -> Beam:
    ended_by_eos = seq.tokens[-1] == eos_token_id and not ignore_eos
    return Beam(token_ids=seq.tokens[prompt_len:], cum_logprob=seq.cum_logprob,
                finish_reason="stop" if ended_by_eos else "length")


async def vllm_beam_search(llm: Any, tokenizer: Any, prompt_token_ids: list[int],
                           params: BeamParams, request_id: str) -> list[Beam]:
    """vLLM's own beam search (the online one its server runs) on an AsyncLLM: the peer
    our beam search is compared with. It cannot carry ``kv_transfer_params``."""
    from types import SimpleNamespace

    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.inputs import tokens_input
    from vllm.sampling_params import BeamSearchParams

    class _Peer(BeamSearchOnlineMixin):
        engine_client = llm
        renderer = SimpleNamespace(get_tokenizer=lambda: tokenizer)

    search = BeamSearchParams(beam_width=params.beam_width, max_tokens=params.max_tokens,
                              length_penalty=params.length_penalty,
                              ignore_eos=params.ignore_eos, include_stop_str_in_output=True)
    final = None
    async for out in _Peer().beam_search(tokens_input(prompt_token_ids), request_id, search):
        final = out
    assert final is not None
    return [Beam(token_ids=list(c.token_ids), cum_logprob=c.cumulative_logprob,
                 finish_reason=c.finish_reason) for c in final.outputs]

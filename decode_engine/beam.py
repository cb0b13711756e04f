"""Beam search with vLLM's beam-search semantics, over a handed-off (or held) parent.

vLLM v1 runs beam search in its frontend (the online one its server runs,
``BeamSearchOnlineMixin.beam_search``): every step sends one ``max_tokens=1,
logprobs=2W`` request per live beam, extends each beam by every returned candidate,
moves EOS-terminated candidates to ``completed``, keeps the W candidates of highest
``cum_logprob``, and at the end returns the W best of ``completed`` and the live beams
by ``cum_logprob / len(tokens) ** length_penalty`` (len counts the prompt, minus a
trailing EOS). Here, token for token the same, but inside the engine:

- **Step 0** is one request over ``parent + suffix`` that carries the import
  (``first_step_extra_args``) and is a beam group of one slot: the engine's logits
  processor picks its W best first tokens from its row, as vLLM reads them from a
  ``2W``-logprobs request (ties by vLLM's numpy calls: ``decode_engine.beam_search``), and
  they come back on its output; no logprobs travel.
- **Steps 1 to T-1** run in the engine: W slot requests, slot ``i`` over ``parent +
  [token i]``, each decoding ``T - 1`` tokens (slot 0 is sent, the engine's scheduler
  makes the others from it: one prompt through the front end, not W); at every engine
  step the logits processor picks the W new beams and forces each slot's token, and the
  scheduler copies each parent beam's KV into its children's slots
  (``decode_engine.beam_slots``). No request is made per step; slot 0's final output
  carries the beams.
- **Slot 0 goes with step 0**, before step 0's picks are known: the engine's scheduler
  writes them into it once step 0 decided (``decode_engine.slot_fill``), so the slots
  start in the engine step after step 0's with no round trip through here, and C
  searches whose step 0s ran in one engine step run every later step together. A
  search resumed after a move sends its slots after its step 0 (their beams are known
  already; they fork from its step 0).

With ``fork`` (engines running our connector) the slots copy step 0's partial last
block instead of recomputing it (``connector.beam_fork``): each computes one token at
its first step; without it, up to ``block_size``.

**Constrained to a catalog** (``params.catalog``), the same steps with every beam's
candidates limited to the catalog's, step 0's included (its first tokens are items'
first tokens); the slots start one token into an item and return only whole items
(``decode_engine.beam_search``: the rules; ``tools/harness/constrained.py``: the reference).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.params import BEAM_KEY, KEY, SLOT_KEY, ImportReport, Refusal
from decode_engine.slot_spec import GroupResult, slot_spec
from kvhandoff.types import Beam, BeamParams, StageError

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

GenerateFn = Callable[[list[int], "SamplingParams", str], Awaitable["RequestOutput"]]

__all__ = ["BeamSearchOutcome", "StoppedSearch", "beam_score", "beam_search",
           "error_message", "resume_search"]


@dataclass(slots=True)
class _Sequence:
    tokens: list[int]  # prompt + generated, as in vLLM's BeamSearchSequence
    cum_logprob: float = 0.0


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
    #: Per step: tokens computed by the engine (prompt tokens minus cached tokens; the
    #: slots' later steps compute one token each).
    step_computed_tokens: list[int] = field(default_factory=list)
    #: Tokens the slots' first step computed beyond the one new token per slot: the
    #: context they found neither cached nor forked (a partial last block without the
    #: fork; prefix blocks evicted after step 0 when D's pool is under pressure).
    recomputed_tokens: int = 0
    #: The slots' steps inside the engine: the logits processor's milliseconds per step
    #: (``select_ms``) and the blocks copied after each (``copied_blocks``); None when
    #: the search ended at step 0.
    slot_steps: dict[str, list[float]] | None = None
    #: Constrained: live beams at the last step that were not whole items (left out).
    num_dropped: int = 0
    #: The search stopped to move before its end (then ``beams`` is empty): its state.
    stopped: StoppedSearch | None = None


@dataclass(slots=True)
class StoppedSearch:
    """A beam search stopped on one engine to go on on another (``resume_search``):
    stage 2's prompt (the shared prefix), the live beams (each its tokens after the
    prompt and its cumulative logprob, in the search's order) and the completed ones
    (in vLLM's order), the beam steps run (step 0 included: every live beam has that
    many tokens), the slots it ran with, and ``export``: the ``kv_transfer_params`` of
    the stopping engine's export of the prompt's KV (the handoff another engine
    imports; ``decode_engine.search_stops``)."""

    prompt: list[int]
    live: list[tuple[list[int], float]]
    completed: list[tuple[list[int], float]]
    steps_done: int
    members: int
    export: dict[str, Any]

    @classmethod
    def of(cls, prompt: list[int], beams: list[_Sequence], completed: list[_Sequence],
           result: GroupResult, out: Any, members: int, done: int) -> StoppedSearch:
        """From the group stopped after ``result.stopped`` steps in all (``beams``:
        the ones it started with, ``done`` steps into the search; ``out``: its slot 0's
        final output, the export)."""
        n = len(prompt)
        ended = [*completed, *(_Sequence(beams[o].tokens + list(t), float(c))
                               for o, t, c in result.completed)]
        live = [(beams[o].tokens[n:] + list(t), float(c)) for o, t, c in result.live]
        export = dict(out.kv_transfer_params or {})
        fields = dict(export.get(KEY) or {})
        fields.pop(SLOT_KEY, None)
        export[KEY] = fields
        if "remote_block_ids" not in export:
            raise StageError("stage2", "move", "the stopped search exported no handoff "
                                               "of its prompt (an engine without the "
                                               "connector cannot move a search)")
        return cls(prompt=prompt, live=live, completed=[(s.tokens[n:], s.cum_logprob)
                                                        for s in ended],
                   steps_done=result.stopped, members=members, export=export)


def error_message(out: Any) -> str:
    return (Refusal.read(out.kv_transfer_params).error
            or "the engine finished the request with an error")


def _check_outputs(outputs: list[Any]) -> None:
    """A request the engine ended with an error or abort ends the search."""
    for out in outputs:
        if out.outputs[0].finish_reason in ("error", "abort"):
            reason = (Refusal.read(out.kv_transfer_params).reason
                      or out.outputs[0].finish_reason)
            raise StageError("stage2", reason, error_message(out))


def _step0_extra(extra_args: dict[str, Any] | None, fork: bool, keep: bool, name: str,
                 held_parent: str | None) -> dict[str, Any] | None:
    """Step 0's ``extra_args``: the import's, plus (with fork) being kept for the slots
    and copying a held parent's partial block."""
    if not fork:
        return extra_args
    beam: dict[str, Any] = {"id": name, "keep": keep}
    if held_parent:
        beam.update(fork_from=held_parent, fork_children=1)
    extra = dict(extra_args or {})
    extra["kv_transfer_params"] = {**(extra.get("kv_transfer_params") or {}), BEAM_KEY: beam}
    return extra


async def _run_slots(generate: GenerateFn, beams: list[_Sequence], params: BeamParams, *,
                     eos_token_id: int | None, request_id: str, fork_from: str | None,
                     members: int | None = None, steps: int | None = None, tail: int = 1,
                     stop_at: int = 0, after: str = "") -> tuple[GroupResult, Any]:
    """The steps inside the engine: a slot per beam (``members`` slots, the first
    ``len(beams)`` starting with a live beam, the rest waiting to be forked into), each
    running the search's remaining ``steps`` (default: all but step 0). Only slot 0 is
    sent; the engine makes the others from it (``decode_engine.beam_slots``). Each beam's
    last ``tail`` tokens are its own (1: step 0's pick; more in a resumed search).
    ``after``: sent with step 0, whose group it names, before its picks are known
    (``beams``: one, the prompt and a placeholder token); the engine fills them in
    (``decode_engine.slot_fill``). The search's result, from slot 0's final output
    (``decode_engine.beam_search.GroupSearch.result``, with the steps' figures), and
    that output."""
    from vllm import SamplingParams

    group, live = _unique(f"{request_id}-g"), len(beams)
    members = max(members or live, live)
    steps = params.max_tokens - 1 if steps is None else steps

    starts = [beams[min(i, live - 1)] for i in range(members)]
    beam = {"fork_from": fork_from, "fork_children": members} if fork_from else {}
    spec = slot_spec(group=group, slot=0, members=members, width=params.beam_width,
                     live=live, steps=steps,
                     cum_logprob=starts[0].cum_logprob, eos_token_id=eos_token_id,
                     ignore_eos=params.ignore_eos, catalog=params.catalog,
                     in_item=params.catalog is not None, tail=tail, stop_at=stop_at,
                     after=after,
                     # The other slots are made in the engine from this one
                     # (decode_engine.beam_slots): each the same prompt with its own
                     # last tokens.
                     clones=None if after else [
                         (tuple(seq.tokens[-tail:]) if tail > 1 else seq.tokens[-1],
                          seq.cum_logprob) for seq in starts[1:]])
    sampling = SamplingParams(max_tokens=steps, temperature=0.0,
                              ignore_eos=True, detokenize=False, extra_args={
                                  SLOT_KEY: spec, "kv_transfer_params": {BEAM_KEY: beam}})
    out = await generate(starts[0].tokens, sampling, f"{group}0")
    return _group_result(out), out


def _unique(name: str) -> str:
    """A beam group's name on the engine: a request id may come again (a retry), a group
    name must not while the engine still holds the last one's state."""
    return f"{name}:{uuid.uuid4().hex[:8]}"


def _group_result(out: Any) -> GroupResult:
    """A beam group's result, from its slot 0's final output."""
    _check_outputs([out])
    info = (out.kv_transfer_params or {}).get(KEY) or {}
    if SLOT_KEY not in info:
        raise StageError("stage2", Refusal.read(out.kv_transfer_params).reason or "beam_group",
                         error_message(out))
    return GroupResult.read(info[SLOT_KEY])


async def _first_step(generate: GenerateFn, prompt: list[int], params: BeamParams, *,
                      eos_token_id: int | None, name: str,
                      first_step_extra_args: dict[str, Any] | None, fork: bool,
                      held_parent: str | None, group: str = ""
                      ) -> tuple[Any, GroupResult, bool, float]:
    """Step 0: one request over the prompt (carrying the import), a beam group of one
    slot (``group``; default: a new name) whose processor picks the first W beams;
    kept for the slots to fork from (``fork``). Returns its output, its result, whether
    the slots fork, its seconds."""
    from vllm import SamplingParams

    extra = dict(_step0_extra(first_step_extra_args, fork, params.max_tokens > 1, name,
                              held_parent) or {})
    extra[SLOT_KEY] = slot_spec(
        group=group or _unique(name), slot=0, members=1, width=params.beam_width, live=1, steps=1,
        cum_logprob=0.0, eos_token_id=eos_token_id, ignore_eos=params.ignore_eos,
        catalog=params.catalog, goes_on=params.max_tokens > 1)
    t0 = time.perf_counter()
    first = await generate(prompt, SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra),
        name)
    first_step_s = time.perf_counter() - t0
    step0 = _group_result(first)
    if ImportReport.read(first.kv_transfer_params).beam_fork_disabled:
        fork = False  # D admitted the import only without it: step 0 was not kept
    return first, step0, fork, first_step_s


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
    max_live: int | None = None,
    stop_at: int = 0,
) -> BeamSearchOutcome:
    """Run beam search (module docstring); ``first_step_extra_args`` go on step 0;
    ``fork``: the slots copy step 0's partial last block; ``held_parent`` (with
    ``fork``): a parent held on this engine that step 0 copies what its prefix-cache hit
    lacks from (``connector.beam_fork``); ``max_live`` (constrained): the most beams the
    catalog lets live at once, the slots made (``Catalog.max_live``; default W);
    ``stop_at``: stop the search to move it once this many beam steps ran (the
    harness's move at step k; the engine's ``stop`` stops it at its next step):
    the outcome is then ``stopped``, with no beams."""
    prompt = list(prompt_token_ids)
    name = f"{request_id}-s0"
    step0_group = _unique(name)
    # The slots: W, or room for the beams the catalog may grow to.
    members = min(params.beam_width, max_live or params.beam_width)
    step0_task = asyncio.ensure_future(_first_step(
        generate, prompt, params, eos_token_id=eos_token_id, name=name,
        first_step_extra_args=first_step_extra_args, fork=fork, held_parent=held_parent,
        group=step0_group))
    leader = None
    if params.max_tokens > 1 and members > 1:
        # The slots' leader goes with step 0 (after it: its request is added first);
        # the engine fills in step 0's picks and starts the slots at the next engine
        # step, with no round trip through here (decode_engine.slot_fill).
        await asyncio.sleep(0)
        leader = asyncio.ensure_future(_run_slots(
            generate, [_Sequence(prompt + prompt[-1:], 0.0)], params,
            eos_token_id=eos_token_id, request_id=request_id,
            fork_from=name if fork else None, members=members,
            stop_at=stop_at if stop_at >= 1 else 0, after=step0_group))
    try:
        first, step0, fork, first_step_s = await step0_task
        return await _search(
            generate, prompt, params, first, first_step_s, step0,
            [_Sequence(prompt + list(t), float(c)) for _, t, c in step0.live],
            [_Sequence(prompt + list(t), float(c)) for _, t, c in step0.completed],
            eos_token_id=eos_token_id, request_id=request_id,
            fork_from=name if fork else None, members=members, done=1, stop_at=stop_at,
            leader=leader)
    finally:
        for task in (step0_task, leader):
            if task is not None and not task.done():
                task.cancel()  # aborts its request on the engine
                with contextlib.suppress(BaseException):
                    await task


async def resume_search(generate: GenerateFn, moved: StoppedSearch, params: BeamParams, *,
                        eos_token_id: int | None, request_id: str,
                        first_step_extra_args: dict[str, Any] | None = None,
                        fork: bool = False, stop_at: int = 0) -> BeamSearchOutcome:
    """A search stopped on another engine (``moved``) goes on here from its next step:
    step 0 imports the shared prefix (``first_step_extra_args``: the import of
    ``moved.export``) and is kept (its own pick is not used); the slots start with the
    live beams, each computing its own tokens so far (forked from step 0: the partial
    block of the prefix is copied, the beam's tokens recomputed), and run the steps
    left. The beams equal those of the search left unmoved (the processor's decisions
    depend only on the beams' scores and the logits). ``stop_at``: as in
    :func:`beam_search` (counting the steps run before the move)."""
    if stop_at and stop_at <= moved.steps_done:
        raise ValueError(f"stop_at {stop_at}: the search ran {moved.steps_done} steps "
                         "before it moved here")
    prompt = list(moved.prompt)
    name = f"{request_id}-s0"
    first, _, fork, first_step_s = await _first_step(
        generate, prompt, params, eos_token_id=eos_token_id, name=name,
        first_step_extra_args=first_step_extra_args, fork=fork, held_parent=None)
    return await _search(
        generate, prompt, params, first, first_step_s, None,
        [_Sequence(prompt + list(t), c) for t, c in moved.live],
        [_Sequence(prompt + list(t), c) for t, c in moved.completed],
        eos_token_id=eos_token_id, request_id=request_id,
        fork_from=name if fork else None, members=moved.members, done=moved.steps_done,
        stop_at=stop_at)


async def _search(generate: GenerateFn, prompt: list[int], params: BeamParams, first: Any,
                  first_step_s: float, step0: GroupResult | None, beams: list[_Sequence],
                  completed: list[_Sequence], *, eos_token_id: int | None, request_id: str,
                  fork_from: str | None, members: int, done: int,
                  stop_at: int, leader: asyncio.Future | None = None) -> BeamSearchOutcome:
    """The slots' part of a search whose first ``done`` beam steps ran (``beams``: the
    live ones, ``completed``: those that ended, in vLLM's order), and its outcome.
    ``leader``: the slots' leader sent with step 0 (``_run_slots``' ``after``), awaited
    if the search goes on (else its caller cancels it)."""
    def score(seq: _Sequence) -> float:
        return beam_score(seq.tokens, seq.cum_logprob, eos_token_id, params.length_penalty)

    step_computed = [len(first.prompt_token_ids) - (first.num_cached_tokens or 0)]
    recomputed, slot_steps, dropped = 0, None, step0.dropped if step0 else 0
    if params.max_tokens > done and beams:
        members = max(members, len(beams))
        result, out = await (leader if leader is not None else _run_slots(
            generate, beams, params, eos_token_id=eos_token_id, request_id=request_id,
            fork_from=fork_from, members=members, steps=params.max_tokens - done,
            tail=done, stop_at=stop_at if stop_at >= done else 0))
        slot_steps = result.steps or {}
        first_computed = int(slot_steps.get("first_computed", members))
        # The slots' steps that ran: fewer than planned when no live beam was left.
        ran = len(slot_steps.get("select_ms") or ()) or params.max_tokens - done
        step_computed += [first_computed] + [members] * (ran - 1)
        recomputed = max(first_computed - members * done, 0)
        dropped = result.dropped
        if result.stopped:
            return BeamSearchOutcome(
                beams=[], first_output=first, first_step_s=first_step_s,
                step_computed_tokens=step_computed, slot_steps=slot_steps,
                stopped=StoppedSearch.of(prompt, beams, completed, result, out, members,
                                         done))
        for found in (result.completed, result.live):
            completed.extend(_Sequence(beams[origin].tokens + list(tokens), float(cum))
                             for origin, tokens, cum in found)
    else:
        completed.extend(beams)
    best = sorted(completed, key=score, reverse=True)[:params.beam_width]
    return BeamSearchOutcome(
        beams=[_beam(seq, len(prompt), eos_token_id, params.ignore_eos) for seq in best],
        first_output=first,
        first_step_s=first_step_s,
        step_computed_tokens=step_computed,
        recomputed_tokens=recomputed,
        slot_steps=slot_steps,
        num_dropped=dropped,
    )


def _beam(seq: _Sequence, prompt_len: int, eos_token_id: int | None, ignore_eos: bool) -> Beam:
    ended_by_eos = seq.tokens[-1] == eos_token_id and not ignore_eos
    return Beam(token_ids=seq.tokens[prompt_len:], cum_logprob=seq.cum_logprob,
                finish_reason="stop" if ended_by_eos else "length")

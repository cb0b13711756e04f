"""A two-stage request, run either across P and D (handoff) or on one engine (colocated).

The colocated path is the correctness reference and the fallback for requests not worth
disaggregating: stage 2 reuses stage 1's KV through the engine's own prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from connector.faults import FAULTS
from connector.handoff import ImportRequest
from decode_engine.engine import run_beam_stage
from kvhandoff.types import (
    BeamParams,
    InvalidRequest,
    Stage1Params,
    Stage1Result,
    Stage2Result,
    check_beam_width,
    continuation_prompt,
    validate_prompt,
    validate_token_ids,
)

if TYPE_CHECKING:
    from decode_engine.engine import DecodeEngine
    from prefill_engine.engine import PrefillEngine

Path = Literal["handoff", "colocated"]


@dataclass(frozen=True)
class TwoStageRequest:
    request_id: str
    prompt_token_ids: list[int]
    suffix_token_ids: list[int]
    stage1: Stage1Params = field(default_factory=Stage1Params)
    beam: BeamParams = field(default_factory=BeamParams)
    #: ``</think>``: not repeated when stage 1 already ended with it.
    think_end_id: int | None = None
    #: The LoRA adapter both stages run under ("": the base model).
    adapter: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise InvalidRequest("request_id", "is empty")


@dataclass(slots=True)
class TwoStageResult:
    path: Path
    prompt_token_ids: list[int]
    stage1: Stage1Result
    #: What was appended to the parent to form stage 2's prompt.
    suffix_token_ids: list[int]
    stage2: Stage2Result

    @property
    def parent_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.stage1.token_ids


def check_request(req: TwoStageRequest, stage1_engine: PrefillEngine,
                  stage2_engine: PrefillEngine | DecodeEngine) -> None:
    """Everything that can be checked before stage 1 runs. Checking late would leave P
    holding exported blocks for a stage 2 that never comes (until the lease ends)."""
    engine = stage1_engine
    validate_prompt(
        req.prompt_token_ids,
        vocab_size=engine.vocab_size,
        max_model_len=min(engine.max_model_len, stage2_engine.max_model_len),
        num_new_tokens=req.stage1.max_tokens + len(req.suffix_token_ids) + req.beam.max_tokens,
    )
    validate_token_ids(req.suffix_token_ids, vocab_size=engine.vocab_size, field_name="suffix")
    validate_token_ids(req.stage1.stop_token_ids, vocab_size=engine.vocab_size,
                       field_name="stage1.stop_token_ids")
    check_beam_width(req.beam.beam_width, stage2_engine.max_beam_width,
                     "the stage-2 engine (max_logprobs/2, max_num_seqs, vocabulary/2)")


def stage2_prompt(req: TwoStageRequest, stage1: Stage1Result) -> tuple[list[int], list[int]]:
    """Stage 2's prompt (parent + suffix) and the part of it after the parent."""
    parent = req.prompt_token_ids + stage1.token_ids
    prompt = continuation_prompt(parent, req.suffix_token_ids, req.think_end_id)
    return prompt, prompt[len(parent):]


async def run_handoff(p: PrefillEngine, d: DecodeEngine, req: TwoStageRequest, *,
                      fault: str | None = None, d_adapter: str | None = None
                      ) -> TwoStageResult:
    """Stage 1 on P, KV handed to D over NIXL, stage 2 on D. ``fault`` names an injected
    fault of ``connector.faults`` (negative controls; the engines must allow it);
    ``d_adapter``: stage 2 under another adapter than the request's (D must refuse it)."""
    check_request(req, p, d)
    side = FAULTS[fault].side if fault is not None else None
    stage1 = await p.run_stage1(req.prompt_token_ids, req.stage1, f"{req.request_id}-p", export=True,
                               target=d.handoff_target,
                               fault=fault if side == "prefill" else None,
                               adapter=req.adapter)
    assert stage1.handoff_params is not None
    if side == "prefill":
        await p.run_one_step()  # P's workers apply the fault before D reads
    prompt, suffix = stage2_prompt(req, stage1)
    stage2 = await d.run_stage2(
        prompt, req.beam, f"{req.request_id}-d", handoff=ImportRequest.for_beams(
            stage1.handoff_params, req.beam,
            fault=fault if side not in (None, "prefill") else None),
        adapter=req.adapter if d_adapter is None else d_adapter)
    return TwoStageResult("handoff", list(req.prompt_token_ids), stage1, suffix, stage2)


async def run_moved(p: PrefillEngine, d: DecodeEngine, req: TwoStageRequest, at: int
                    ) -> tuple[TwoStageResult, Stage2Result]:
    """Stage 1 moved from P to D at token ``at``: P samples ``at`` tokens and exports them
    (the partial last block included: the export a live stop makes), D imports them and
    samples the rest of stage 1 with the same (positional or greedy) sampling, then runs
    stage 2 from its prefix cache. Returns the result and D's move step (the rest)."""
    check_request(req, p, d)
    head = await _stage1_head(p, req, at, d.handoff_target)
    return await _rest_on_d(d, req, head.token_ids, head.handoff_params, head.elapsed_s,
                            f"{req.request_id}-m2", f"{req.request_id}-m3")


@dataclass(frozen=True, slots=True)
class MoveStep:
    """What one move's destination imported and computed (its first step)."""

    to: str
    at: int
    num_imported_tokens: int
    num_computed_tokens: int
    num_imported_bytes: int


async def run_moved_via_p(p: PrefillEngine, p2: PrefillEngine, d: DecodeEngine,
                          req: TwoStageRequest, at: int, then_at: int | None = None,
                          fault: str | None = None) -> tuple[TwoStageResult, list[MoveStep]]:
    """Stage 1 moved from P to another P (``p2``) at token ``at``: P samples ``at`` tokens
    and exports them to P' (the export a live stop makes, addressed to P'), P' imports
    them and samples on with the same sampling. With ``then_at`` it is moved again at
    that token, to D (as ``run_moved``'s D: D samples the rest of stage 1, stage 2 from
    its prefix cache); without, P' finishes stage 1 and D imports the parent from P' for
    stage 2. Returns the result and each move's step. ``fault``: an import fault of
    ``connector.faults`` injected into P''s import (the negative control of P''s counts)."""
    check_request(req, p, d)
    s1 = req.stage1
    head = await _stage1_head(p, req, at, p2.handoff_target)
    end = then_at if then_at is not None else s1.max_tokens
    mid_params = replace(s1, max_tokens=end - at,
                         min_tokens=max(0, min(s1.min_tokens, end) - at))
    mid = await p2.run_stage1(
        req.prompt_token_ids + head.token_ids, mid_params, f"{req.request_id}-m2",
        export=True, target=d.handoff_target, handoff=ImportRequest.for_beams(
            head.handoff_params, BeamParams(beam_width=1, max_tokens=mid_params.max_tokens),
            fault=fault))
    steps = [MoveStep("P'", at, mid.num_imported_tokens, mid.num_computed_tokens,
                      mid.num_imported_bytes)]
    token_ids = head.token_ids + mid.token_ids
    if then_at is None:
        stage1 = Stage1Result(token_ids=token_ids, finish_reason=mid.finish_reason,
                              handoff_params=mid.handoff_params,
                              elapsed_s=head.elapsed_s + mid.elapsed_s)
        prompt, suffix = stage2_prompt(req, stage1)
        stage2 = await d.run_stage2(prompt, req.beam, f"{req.request_id}-m3",
                                    handoff=ImportRequest.for_beams(mid.handoff_params,
                                                                    req.beam))
        return TwoStageResult("handoff", list(req.prompt_token_ids), stage1, suffix,
                              stage2), steps
    if mid.finish_reason != "length" or mid.handoff_params is None:
        raise RuntimeError(f"{req.request_id}: stage 1 ended by {mid.finish_reason} on P' "
                           f"before token {then_at}: nothing to move")
    result, move = await _rest_on_d(d, req, token_ids, mid.handoff_params,
                                    head.elapsed_s + mid.elapsed_s,
                                    f"{req.request_id}-m3", f"{req.request_id}-m4")
    steps.append(MoveStep("D", then_at, move.num_imported_tokens,
                          move.num_computed_tokens_first_step, move.num_imported_bytes))
    return result, steps


async def _stage1_head(p: PrefillEngine, req: TwoStageRequest, at: int, target: str
                       ) -> Stage1Result:
    """P samples stage 1's first ``at`` tokens and exports them for ``target``: the
    export a live stop after token ``at`` makes."""
    s1 = req.stage1
    head = await p.run_stage1(
        req.prompt_token_ids, replace(s1, max_tokens=at, min_tokens=min(s1.min_tokens, at)),
        f"{req.request_id}-m1", export=True, target=target)
    if head.finish_reason != "length" or head.handoff_params is None:
        raise RuntimeError(f"{req.request_id}: stage 1 ended by {head.finish_reason} before "
                           f"token {at}: nothing to move")
    return head


async def _rest_on_d(d: DecodeEngine, req: TwoStageRequest, token_ids: list[int],
                     handoff_params: dict, elapsed_s: float, rest_id: str, stage2_id: str
                     ) -> tuple[TwoStageResult, Stage2Result]:
    """D imports stage 1's first ``len(token_ids)`` tokens (exported as
    ``handoff_params``), samples the rest of it, then runs stage 2 from its prefix cache.
    Returns the result and D's move step."""
    s1, at = req.stage1, len(token_ids)
    rest_params = replace(s1, max_tokens=s1.max_tokens - at,
                          min_tokens=max(0, s1.min_tokens - at))
    shape = BeamParams(beam_width=1, max_tokens=rest_params.max_tokens)
    move = await d.run_stage2(
        req.prompt_token_ids + token_ids, shape, rest_id,
        handoff=ImportRequest.for_beams(handoff_params, shape), sampling=rest_params)
    rest = move.beams[0]
    stage1 = Stage1Result(token_ids=token_ids + rest.token_ids,
                          finish_reason=rest.finish_reason, handoff_params=None,
                          elapsed_s=elapsed_s + move.elapsed_s)
    prompt, suffix = stage2_prompt(req, stage1)
    stage2 = await run_beam_stage(d, prompt, req.beam, stage2_id)
    return TwoStageResult("handoff", list(req.prompt_token_ids), stage1, suffix, stage2), move


async def run_colocated(engine: PrefillEngine, req: TwoStageRequest) -> TwoStageResult:
    """Both stages on one engine, stage 2 from token ids through its prefix cache."""
    check_request(req, engine, engine)
    stage1 = await engine.run_stage1(
        req.prompt_token_ids, req.stage1, f"{req.request_id}-c1", export=False,
        adapter=req.adapter)
    prompt, suffix = stage2_prompt(req, stage1)
    stage2 = await run_beam_stage(engine, prompt, req.beam, f"{req.request_id}-c2",
                                  adapter=req.adapter)
    return TwoStageResult("colocated", list(req.prompt_token_ids), stage1, suffix, stage2)

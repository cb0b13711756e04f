"""What makes a harness case pass: its handoff (or move) against the references it
computed without one, as a :class:`~tools.harness.report.CaseReport`.

A case passes when
- stage-1 tokens are identical on P and on D (the same seed on another engine),
- the handoff's beams equal the colocated reference's (token ids and order, exactly)
  with cumulative logprobs within the case's bound, and equal vLLM's own
  ``beam_search`` on the same continuation prompt (a reference we did not write) within
  the same bound,
- the engine's own noise on the case is below ``NOISE_CEILING`` (see below),
- D imported exactly the parent's ``N - 1`` tokens it did not already hold and computed
  ``len(suffix) + 1`` tokens for the import step; after a move, each destination
  imported the prompt and the tokens it was given but the last, and computed one.
Every rule that fails is named in the report's ``failures``.

The logprob bound (``judge_beams``, the one rule for the engines' path and the unit
tests). The engine's own spread is measured twice, without any handoff: the colocated
reference's stage 2 run again on P beside an unrelated request (another batch, so
another float summation order), and vLLM's beam_search run on D from an empty prefix
cache against the same on P (another engine, the prompt computed in D's own chunks: on
CPU the shape of the computation moves results where the batch does not;
docs/decisions.md, "bf16: the shape of the computation"). The case's *noise* is the
largest |delta cumulative logprob| within either pair, and the handoff is held to::

    bound = max(LOGPROB_TOLERANCE, NOISE_FACTOR * noise)      # floor 1e-5, factor 10

The guard: a bound that grows with the noise must not swallow a fault (the injected ones
move cumulative logprobs by 0.1 or more). A case whose noise exceeds ``NOISE_CEILING``
(1e-3), or either of whose pairs chose different token ids, is *noisy*: it FAILS, and
its beams are judged at the floor; the bound is never widened past
``NOISE_FACTOR * NOISE_CEILING`` (1e-2), ten times below the smallest fault's shift.
Token ids are compared exactly whatever the noise.

Ties. Beams whose cumulative logprobs are exactly equal (frequent in bf16, where many
logits round to the same value) are compared in their order too, against vLLM's beams
as against the colocated run's: our beam search picks each step's W by the same numpy
calls as vLLM's online beam search (``decode_engine.beam_search.top_candidates``), so a tie
resolves the same way on both (``tests/test_beam_search.py`` checks it against vLLM's
code on a model whose scores tie at every step).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from connector.faults import FAULTS, applies
from kvhandoff.budget import stage2_reservation
from kvhandoff.types import Beam, Stage2Result
from tools.harness.cases import Case
from tools.harness.report import LOGPROB_TOLERANCE, CaseReport
from tools.pipeline import MoveStep, TwoStageRequest, TwoStageResult

if TYPE_CHECKING:
    from decode_engine.engine import DecodeEngine


#: The handoff may differ from the colocated reference by this many times the engine's
#: own noise: the rerun that measures the noise differs from the reference in one place
#: (the batch), the handoff in several (the parent's tail from P's decode steps instead
#: of a prefill, another engine, D's batch), and rounding differences add up.
NOISE_FACTOR = 10.0
#: Noise above this is not rounding: the case fails as noisy instead of widening its
#: bound. ``NOISE_FACTOR * NOISE_CEILING`` (1e-2) stays ten times below the smallest
#: shift an injected fault makes (0.1).
NOISE_CEILING = 1e-3


def _beam_dicts(beams: list[Beam]) -> list[dict[str, Any]]:
    return [asdict(b) for b in beams]


def compare_beams(ours: list[Beam], theirs: list[Beam]) -> tuple[bool, float]:
    """Whether the beams' token ids and order are equal, and the largest difference of
    their cumulative logprobs (a NaN counts as infinite: it never passes a bound)."""
    same = [b.token_ids for b in ours] == [b.token_ids for b in theirs]
    diffs = [abs(a.cum_logprob - b.cum_logprob) for a, b in zip(ours, theirs)]
    return same, max((math.inf if math.isnan(d) else d for d in diffs), default=0.0)


def logprob_bound(noise: float) -> float:
    """What a case's cumulative logprobs may differ by, given its measured noise."""
    return max(LOGPROB_TOLERANCE, NOISE_FACTOR * noise)


@dataclass(frozen=True, slots=True)
class Noise:
    """The engine's own noise on a case, the larger of two spreads measured without any
    handoff: the colocated reference's stage 2 against its rerun under another batch
    composition, and vLLM's ``beam_search`` on P against the same on D from an empty
    prefix cache (another engine, the whole prompt computed in D's own chunks: the
    shape of the computation, which on CPU moves results where the batch does not)."""

    #: The largest |delta cumulative logprob| within either pair.
    value: float
    #: Each pair chose the same beams (token ids and order).
    reproducible: bool
    #: Which pair chose other beams, when one did: "batch" or "engine".
    unreproducible: str = ""

    @classmethod
    def measure(cls, reference: list[Beam], rerun: list[Beam],
                vllm: list[Beam] | None = None, vllm_elsewhere: list[Beam] | None = None
                ) -> Noise:
        same, diff = compare_beams(rerun, reference)
        which = "" if same else "batch"
        if vllm is not None and vllm_elsewhere is not None:
            same_there, diff_there = compare_beams(vllm_elsewhere, vllm)
            diff = max(diff, diff_there)
            if not same_there:
                which = which or "engine"
            same = same and same_there
        return cls(diff, same, which)

    @property
    def is_noisy(self) -> bool:
        return not (self.reproducible and self.value <= NOISE_CEILING)

    @property
    def bound(self) -> float:
        """``logprob_bound(value)``; the floor for a noisy case, which fails anyway."""
        return LOGPROB_TOLERANCE if self.is_noisy else logprob_bound(self.value)

    def failure(self) -> str | None:
        """Why the case is noisy (None: it is not)."""
        if not self.reproducible:
            where = ("vLLM's beam_search on D chose other beams than on P"
                     if self.unreproducible == "engine" else
                     "the colocated reference's rerun under another batch chose other "
                     "beams")
            return f"noisy: {where} (token ids differ)"
        if self.is_noisy:
            return (f"noisy: the engine's own runs differ by {self.value:.2e} > ceiling "
                    f"{NOISE_CEILING:.0e}; the bound is not widened")
        return None


@dataclass(frozen=True, slots=True)
class BeamMatch:
    """The handoff's beams against one reference's, at the case's bound."""

    ids_same: bool
    diff: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.ids_same and self.diff <= self.bound


@dataclass(frozen=True, slots=True)
class BeamVerdict:
    """The handoff's beams against the colocated reference and vLLM's beam_search."""

    noise: Noise
    colocated: BeamMatch
    vllm: BeamMatch
    failures: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.failures


def judge_beams(got: list[Beam], colocated: list[Beam], colocated_rerun: list[Beam],
                vllm: list[Beam], vllm_elsewhere: list[Beam] | None = None) -> BeamVerdict:
    """The handoff's beams ``got`` against the colocated reference's (measured run
    ``colocated``, its rerun under another batch ``colocated_rerun``) and vLLM's beam
    search ``vllm`` (on P; ``vllm_elsewhere``: the same on D from an empty cache), by
    the bound in the module docstring."""
    noise = Noise.measure(colocated, colocated_rerun, vllm, vllm_elsewhere)
    bound = noise.bound
    ours = BeamMatch(*compare_beams(got, colocated), bound)
    theirs = BeamMatch(*compare_beams(got, vllm), bound)
    why_noisy = noise.failure()
    failures = [why_noisy] if why_noisy is not None else []
    if not ours.ids_same:
        failures.append("beams differ from the colocated reference (token ids or order)")
    if not ours.diff <= bound:
        failures.append(f"cumulative logprobs differ by {ours.diff:.2e} > bound "
                        f"{bound:.2e} (noise {noise.value:.1e})")
    if not theirs.ok:
        failures.append(f"beams differ from vLLM's beam_search (ids "
                        f"{'same' if theirs.ids_same else 'differ'}, logprobs by "
                        f"{theirs.diff:.2e}, bound {bound:.2e})")
    return BeamVerdict(noise, ours, theirs, tuple(failures))


@dataclass
class Reference:
    """What a case computes without any handoff; reused by the fault runs."""

    seed: int
    prompt: list[int]
    request: TwoStageRequest
    colocated: TwoStageResult
    d_stage1_token_ids: list[int]
    vllm_beams: list[Beam]
    #: The colocated stage 2 run again on the same engine beside an unrelated request:
    #: the engine's noise on this case (``Noise``).
    colocated_rerun_beams: list[Beam]
    #: vLLM's beam_search on D, from an empty prefix cache (``Noise``); None: not run.
    vllm_beams_on_d: list[Beam] | None = None


def _import_failures(d: DecodeEngine, case: Case, got: TwoStageResult, found: int
                     ) -> list[str]:
    """What D read from P, against the parent and D's cache state."""
    s2, parent_len, b = got.stage2, len(got.parent_token_ids), d.block_size
    if case.d_state == "warm":
        full = (parent_len - 1) // b * b
        if found != full:
            return [f"D found {found} parent tokens in its prefix cache, expected its "
                    f"{full} full-block tokens"]
    elif s2.num_imported_tokens != parent_len - 1:
        return [f"D imported {s2.num_imported_tokens} tokens, expected {parent_len - 1}"]
    if case.d_state == "fill":
        need = stage2_reservation(parent_len + len(got.suffix_token_ids), b,
                                  case.beam_width, case.beam_max_tokens,
                                  d.config.beam_fork, d.num_total_blocks)
        if need != d.num_total_blocks:
            return [f"the stage 2 needs {need} of D's {d.num_total_blocks} blocks, "
                    "not all of them"]
    return []


def _roundtrip_tokens(tokenizer: Any, parent: list[int], suffix: list[int]) -> int | None:
    if tokenizer is None:
        return None
    text = tokenizer.decode(parent + suffix, skip_special_tokens=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _move_failures(d: DecodeEngine, case: Case, got: TwoStageResult, move: Stage2Result
                   ) -> list[str]:
    """A move at t: D imported the prompt and t - 1 tokens (all P had KV for) and
    computed one; stage 2 then found the parent's full blocks in D's prefix cache."""
    failures = []
    expected = len(got.prompt_token_ids) + case.move_at - 1
    if move.num_imported_tokens != expected:
        failures.append(f"D imported {move.num_imported_tokens} tokens at the move, "
                        f"expected len(prompt) + t - 1 = {expected}")
    if move.num_computed_tokens_first_step != 1:
        failures.append(f"D computed {move.num_computed_tokens_first_step} tokens at the "
                        "move, expected 1")
    b = d.block_size
    cached = (len(got.parent_token_ids) - 1) // b * b
    stage2_computed = len(got.parent_token_ids) + len(got.suffix_token_ids) - cached
    if got.stage2.num_computed_tokens_first_step != stage2_computed:
        failures.append(f"stage 2 on D computed {got.stage2.num_computed_tokens_first_step} "
                        f"tokens, expected {stage2_computed} (the parent's full blocks "
                        "from D's prefix cache)")
    return failures


def _p_move_failures(got: TwoStageResult, steps: list[MoveStep]) -> list[str]:
    """Moves through another P: each destination imported the prompt and the tokens
    it was given but the last (all its source had KV for) and computed one."""
    failures = []
    for step in steps:
        expected = len(got.prompt_token_ids) + step.at - 1
        if step.num_imported_tokens != expected:
            failures.append(f"{step.to} imported {step.num_imported_tokens} tokens at "
                            f"the move at {step.at}, expected len(prompt) + t - 1 = "
                            f"{expected}")
        if step.num_computed_tokens != 1:
            failures.append(f"{step.to} computed {step.num_computed_tokens} tokens at "
                            f"the move at {step.at}, expected 1")
    return failures


def _as_stage2(step: MoveStep) -> Stage2Result:
    """A move's import step in the figures a case reports."""
    return Stage2Result(beams=[], num_prompt_tokens=0,
                        num_imported_tokens=step.num_imported_tokens,
                        num_imported_bytes=step.num_imported_bytes,
                        num_computed_tokens_first_step=step.num_computed_tokens,
                        num_computed_tokens_total=step.num_computed_tokens,
                        first_step_s=0.0, elapsed_s=0.0)


def compare(case: Case, ref: Reference, got: TwoStageResult, *, d: DecodeEngine,
            tokenizer: Any, fault: str | None = None, move: Stage2Result | None = None,
            steps: list[MoveStep] | None = None) -> CaseReport:
    """``got`` (the case run with its handoff or moves, ``fault`` injected if given)
    against ``ref`` by the rules above. ``d``: the D that ran stage 2; ``tokenizer``:
    for the text round trip's token count (None: not counted); ``move``: the import step
    of a move to D; ``steps``: the moves through another P, in order."""
    failures = []
    if case.adapters_differ:
        failures.append(f"D imported a parent computed under {_named(case.adapter)} into "
                        f"a stage 2 under {_named(case.stage2_adapter)}: it must refuse")
    stage1_same = ref.colocated.stage1.token_ids == got.stage1.token_ids
    if not stage1_same:
        failures.append("stage-1 tokens differ")
    stage1_same_d = ref.d_stage1_token_ids == got.stage1.token_ids
    if not stage1_same_d:
        failures.append("stage-1 tokens differ between P and D")
    if case.ending == "length" and got.stage1.finish_reason != "length":
        failures.append(f"stage 1 ended by {got.stage1.finish_reason}, expected length")
    beams = judge_beams(got.stage2.beams, ref.colocated.stage2.beams,
                        ref.colocated_rerun_beams, ref.vllm_beams, ref.vllm_beams_on_d)
    failures += beams.failures
    s2 = got.stage2
    parent_len = len(got.parent_token_ids)
    found = parent_len - 1 - s2.num_imported_tokens if case.d_state == "warm" else 0
    if steps is not None:
        moved = _p_move_failures(got, steps[:1])
        if case.then_at is not None:  # P' -> D: stage 2 on D's prefix cache
            moved += _move_failures(d, replace(case, move_at=case.then_at), got,
                                    _as_stage2(steps[1]))
        else:  # P' exported the parent: D imported it as from any P
            moved += _import_failures(d, case, got, 0)
            if s2.num_computed_tokens_first_step != len(got.suffix_token_ids) + 1:
                moved.append(f"D computed {s2.num_computed_tokens_first_step} tokens for "
                             "the import step, expected len(suffix)+1")
        computed_ok = not moved
        failures += moved
        s2 = _as_stage2(steps[0])  # the first move's import: report its figures
    elif move is not None:
        moved = _move_failures(d, case, got, move)
        computed_ok = not moved
        failures += moved
        s2 = move  # the import step is the move's: report its figures
    else:
        expected_computed = len(got.suffix_token_ids) + 1
        computed_ok = s2.num_computed_tokens_first_step == expected_computed
        if not computed_ok:
            failures.append(f"D computed {s2.num_computed_tokens_first_step} tokens for "
                            f"the import step, expected len(suffix)+1 = {expected_computed}")
        failures += _import_failures(d, case, got, found)

    return CaseReport(
        name=case.name,
        prompt_token_ids=ref.prompt,
        stage1_seed=ref.seed,
        stage1_token_ids=got.stage1.token_ids,
        stage1_finish_reason=got.stage1.finish_reason,
        suffix_token_ids=got.suffix_token_ids,
        beam=asdict(ref.request.beam),
        d_state=(case.d_state if case.move_at is None else f"@{case.move_at}"
                 + ("P'" if case.via_p else "")),
        colocated_beams=_beam_dicts(ref.colocated.stage2.beams),
        handoff_beams=_beam_dicts(got.stage2.beams),
        vllm_beams=_beam_dicts(ref.vllm_beams),
        num_parent_tokens=parent_len,
        num_imported_tokens=s2.num_imported_tokens,
        num_found_on_d_tokens=found,
        num_computed_tokens_d_first_step=s2.num_computed_tokens_first_step,
        num_computed_tokens_d_total=s2.num_computed_tokens_total,
        num_bytes_moved=s2.num_imported_bytes,
        num_text_roundtrip_tokens=_roundtrip_tokens(tokenizer, got.parent_token_ids,
                                                    got.suffix_token_ids),
        stage1_identical=stage1_same,
        stage1_identical_on_d=stage1_same_d,
        beams_identical=beams.colocated.ids_same,
        beams_match_vllm=beams.vllm.ok,
        max_logprob_diff=beams.colocated.diff,
        max_logprob_diff_vllm=beams.vllm.diff,
        logprob_noise=beams.noise.value,
        logprob_bound=beams.noise.bound,
        noisy=beams.noise.is_noisy,
        computed_as_expected=computed_ok,
        move_at=case.move_at,
        fault=fault,
        fault_applies=fault is None or applies(FAULTS[fault], parent_len, d.block_size,
                                               case.adapters_differ),
        failures=failures,
    )


def refused(case: Case, ref: Reference, message: str, fault: str | None) -> CaseReport:
    """A case whose stage 2 names another adapter than its parent's, refused by D as it
    must be (``connector.adapters``): it passes; nothing ran on D to compare."""
    parent = ref.prompt + ref.colocated.stage1.token_ids
    return CaseReport(
        name=case.name, prompt_token_ids=ref.prompt, stage1_seed=ref.seed,
        stage1_token_ids=ref.colocated.stage1.token_ids,
        stage1_finish_reason=ref.colocated.stage1.finish_reason,
        suffix_token_ids=ref.colocated.suffix_token_ids, beam=asdict(ref.request.beam),
        d_state=case.d_state, colocated_beams=_beam_dicts(ref.colocated.stage2.beams),
        handoff_beams=[], vllm_beams=_beam_dicts(ref.vllm_beams),
        num_parent_tokens=len(parent), num_imported_tokens=0, num_found_on_d_tokens=0,
        num_computed_tokens_d_first_step=0, num_computed_tokens_d_total=0,
        num_bytes_moved=0, num_text_roundtrip_tokens=None, stage1_identical=True,
        stage1_identical_on_d=ref.d_stage1_token_ids == ref.colocated.stage1.token_ids,
        beams_identical=False, beams_match_vllm=False, max_logprob_diff=0.0,
        max_logprob_diff_vllm=0.0, logprob_noise=0.0, logprob_bound=LOGPROB_TOLERANCE,
        noisy=False, computed_as_expected=True, fault=fault,
        fault_applies=fault is None or FAULTS[fault].needs_adapter, refused=message)


def _named(adapter: str) -> str:
    return f"adapter {adapter!r}" if adapter else "no adapter"

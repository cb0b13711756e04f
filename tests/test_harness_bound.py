"""The harness's logprob bound without engines: a case's cumulative logprobs are held to
``max(LOGPROB_TOLERANCE, NOISE_FACTOR * noise)`` (noise: the colocated reference against
its rerun under another batch), token ids exactly, and a noise above ``NOISE_CEILING``
fails the case instead of widening its bound (``tools.harness.checks``)."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace

import pytest

from kvhandoff.types import Beam, BeamParams, Stage1Params, Stage1Result, Stage2Result
from tools.harness import (
    LOGPROB_TOLERANCE,
    NOISE_CEILING,
    NOISE_FACTOR,
    Case,
    Harness,
    HarnessReport,
    Reference,
    compare,
    format_table,
    judge_beams,
    logprob_bound,
    write_json,
)
from tools.harness import run as run_module
from tools.pipeline import TwoStageRequest, TwoStageResult

#: The smallest shift of a cumulative logprob the injected faults made (issue 30).
SMALLEST_FAULT_SHIFT = 0.1


def beams(*cum_logprobs: float, token_ids: list[list[int]] | None = None) -> list[Beam]:
    """Beams with these cumulative logprobs (token ids: [[10], [11], ...] unless given)."""
    ids = token_ids or [[10 + i] for i in range(len(cum_logprobs))]
    return [Beam(list(t), c, "length") for t, c in zip(ids, cum_logprobs)]


REF = (-1.25, -2.5, -3.75)


def shifted(by: float, base: tuple[float, ...] = REF) -> list[Beam]:
    return beams(*(c + by for c in base))


# --- the bound ---------------------------------------------------------------------


def test_the_bound_is_the_floor_for_the_built_in_models_noise():
    # The built-in model's noise is 0 or about 1e-7: the bound stays what it was.
    assert logprob_bound(0.0) == LOGPROB_TOLERANCE == 1e-5
    assert logprob_bound(1e-7) == LOGPROB_TOLERANCE
    assert logprob_bound(9e-7) == LOGPROB_TOLERANCE


def test_the_bound_grows_with_the_noise_by_the_stated_factor():
    assert NOISE_FACTOR == 10
    assert logprob_bound(3e-6) == pytest.approx(3e-5)
    assert logprob_bound(NOISE_CEILING) == pytest.approx(1e-2)


def test_no_bound_a_case_can_pass_with_reaches_a_faults_shift():
    # The widest bound of a case that is not noisy stays ten times below a fault's shift.
    assert logprob_bound(NOISE_CEILING) * 10 <= SMALLEST_FAULT_SHIFT
    verdict = judge_beams(shifted(SMALLEST_FAULT_SHIFT), beams(*REF),
                          shifted(NOISE_CEILING), beams(*REF))
    assert not verdict.ok and not verdict.noise.is_noisy
    assert verdict.noise.bound == pytest.approx(1e-2)


# --- the decision ------------------------------------------------------------------


def test_vllms_own_spread_across_engines_sets_the_bound_too():
    """The W=64 fill case (measured: handoff 1.07e-5 off the colocated run, vLLM's
    beam_search on D 3.3e-6 off the same on P, the batch rerun 0): the engines' own
    spread sets a bound of 3.3e-5 and the case passes; without it, held to the floor,
    it failed. vLLM's runs choosing other beams on the two engines make the case noisy
    (a fail), and a fault's shift still fails it."""
    vllm = shifted(-5.6e-6)
    elsewhere = shifted(-5.6e-6 + 3.3e-6)
    got = shifted(1.07e-5)
    verdict = judge_beams(got, beams(*REF), beams(*REF), vllm, elsewhere)
    assert verdict.ok, verdict.failures
    assert verdict.noise.value == pytest.approx(3.3e-6)
    assert verdict.noise.bound == pytest.approx(3.3e-5)
    assert not judge_beams(got, beams(*REF), beams(*REF), vllm).ok  # the floor alone
    swapped = beams(*REF[:2], token_ids=[[11], [10]])
    noisy = judge_beams(got, beams(*REF), beams(*REF), vllm, swapped)
    assert not noisy.ok and noisy.noise.unreproducible == "engine"
    assert "vLLM's beam_search on D chose other beams" in noisy.failures[0]
    assert not judge_beams(shifted(SMALLEST_FAULT_SHIFT), beams(*REF), beams(*REF), vllm,
                           elsewhere).ok


def test_equal_tokens_within_the_bound_pass():
    # The case: 1.08e-5 off the colocated run, 1.88e-5 off vLLM's beam_search,
    # on an engine whose rerun moved the logprobs by 2e-6 (bound 2e-5).
    verdict = judge_beams(shifted(1.08e-5), beams(*REF), shifted(2e-6),
                          shifted(1.08e-5 - 1.88e-5))
    assert verdict.ok, verdict.failures
    assert verdict.noise.value == pytest.approx(2e-6)
    assert verdict.noise.bound == pytest.approx(2e-5)
    assert verdict.colocated.diff == pytest.approx(1.08e-5)
    assert verdict.vllm.diff == pytest.approx(1.88e-5)
    assert verdict.colocated.ok and verdict.vllm.ok


def test_identical_beams_on_a_quiet_engine_pass():
    verdict = judge_beams(beams(*REF), beams(*REF), beams(*REF), beams(*REF))
    assert verdict.ok and verdict.noise.value == 0.0
    assert verdict.noise.bound == LOGPROB_TOLERANCE


def test_a_difference_above_the_bound_fails():
    # The same 1.08e-5 on an engine with no noise: held to the floor, as before.
    verdict = judge_beams(shifted(1.08e-5), beams(*REF), beams(*REF), beams(*REF))
    assert not verdict.ok
    assert verdict.failures == ("cumulative logprobs differ by 1.08e-05 > bound 1.00e-05 "
                                "(noise 0.0e+00)",
                                "beams differ from vLLM's beam_search (ids same, logprobs "
                                "by 1.08e-05, bound 1.00e-05)")


def test_vllms_beam_search_is_held_to_the_same_bound():
    # Within the bound against the colocated run, above it against vLLM's.
    verdict = judge_beams(shifted(1e-6), beams(*REF), shifted(2e-6), shifted(-3e-5))
    assert verdict.colocated.ok and not verdict.vllm.ok
    assert verdict.vllm.bound == verdict.colocated.bound == pytest.approx(2e-5)
    assert [f.split(" (")[0] for f in verdict.failures] == [
        "beams differ from vLLM's beam_search"]


def test_equal_scores_are_held_to_vllms_order_too():
    """Our beam search resolves ties as vLLM's does (``tests/test_beam_search.py``), so
    beams of exactly equal score in another order than vLLM's are a difference."""
    tied = (-1.25, -2.5, -2.5, -3.75)
    ours = beams(*tied)
    swapped = beams(*tied, token_ids=[[10], [12], [11], [13]])
    assert judge_beams(ours, beams(*tied), beams(*tied), beams(*tied)).ok
    verdict = judge_beams(ours, beams(*tied), beams(*tied), swapped)
    assert verdict.colocated.ok and not verdict.vllm.ok
    assert not judge_beams(swapped, ours, ours, ours).colocated.ok


@pytest.mark.parametrize("other", [
    [[10], [11], [99]],  # another token
    [[11], [10], [12]],  # the same beams in another order
    [[10], [11]],  # a beam missing
], ids=["token", "order", "missing"])
def test_different_tokens_fail_whatever_the_logprobs(other):
    got = beams(*REF[:len(other)], token_ids=other)
    verdict = judge_beams(got, beams(*REF), beams(*REF), beams(*REF))
    assert not verdict.ok and verdict.colocated.diff == 0.0
    assert "beams differ from the colocated reference (token ids or order)" in verdict.failures
    assert not verdict.vllm.ok


def test_noise_above_the_ceiling_fails_and_does_not_widen_the_bound():
    # The handoff equals the reference exactly; the engine itself is too noisy to vouch.
    verdict = judge_beams(beams(*REF), beams(*REF), shifted(2 * NOISE_CEILING), beams(*REF))
    assert not verdict.ok and verdict.noise.is_noisy
    assert verdict.noise.bound == LOGPROB_TOLERANCE
    assert verdict.failures == (f"noisy: the engine's own runs differ by 2.00e-03 > "
                                f"ceiling {NOISE_CEILING:.0e}; the bound is not widened",)
    # A fault on a noisy engine is named too, at the floor.
    faulty = judge_beams(shifted(0.3), beams(*REF), shifted(2 * NOISE_CEILING), beams(*REF))
    assert any(f.startswith("cumulative logprobs differ by 3.00e-01 > bound 1.00e-05")
               for f in faulty.failures)


def test_a_rerun_that_chooses_other_beams_is_noisy():
    rerun = beams(*REF, token_ids=[[10], [11], [42]])
    verdict = judge_beams(beams(*REF), beams(*REF), rerun, beams(*REF))
    assert not verdict.ok and verdict.noise.is_noisy and not verdict.noise.reproducible
    assert verdict.failures[0].startswith("noisy: the colocated reference's rerun under "
                                          "another batch chose other beams")


def test_a_nan_logprob_never_passes():
    verdict = judge_beams(beams(math.nan, *REF[1:]), beams(*REF), beams(*REF), beams(*REF))
    assert not verdict.ok and verdict.colocated.diff == math.inf
    assert judge_beams(beams(*REF), beams(*REF), beams(math.nan, *REF[1:]),
                       beams(*REF)).noise.is_noisy


# --- the case and its report ---------------------------------------------------------


def _case_report(handoff: list[Beam], rerun: list[Beam], vllm: list[Beam]):
    """``compare`` (the engines' path) on a cold-D case with synthetic results: D
    imported the parent's N - 1 tokens and computed len(suffix) + 1."""
    case = Case("synthetic-w3", 4, "length", 3, stage1_max_tokens=2)
    prompt, suffix = [1, 2, 3, 4], [7, 8]
    req = TwoStageRequest("verify-synthetic", prompt, suffix, Stage1Params(max_tokens=2),
                          BeamParams(beam_width=3, max_tokens=1))
    stage1 = Stage1Result([5, 6], "length", None, 0.0)

    def result(path: str, stage2_beams: list[Beam], imported: int) -> TwoStageResult:
        stage2 = Stage2Result(stage2_beams, 8, imported, 64 * imported, len(suffix) + 1,
                              len(suffix) + 1, 0.0, 0.0)
        return TwoStageResult(path, prompt, stage1, suffix, stage2)  # type: ignore[arg-type]

    ref = Reference(0, prompt, req, result("colocated", beams(*REF), 0), [5, 6], vllm, rerun)
    d = SimpleNamespace(block_size=32, config=SimpleNamespace(beam_fork=False),
                        num_total_blocks=128)
    return compare(case, ref, result("handoff", handoff, len(prompt) + 1), d=d,
                   tokenizer=None)


def _harness_report(*cases) -> HarnessReport:
    return HarnessReport(model_dir="m", block_size=32, logprob_tolerance=LOGPROB_TOLERANCE,
                         noise_factor=NOISE_FACTOR, noise_ceiling=NOISE_CEILING,
                         cases=list(cases), pools_clean=True, pool_details={},
                         elapsed_s=1.0)


def test_a_case_reports_its_noise_differences_and_bound():
    c = _case_report(shifted(1.08e-5), shifted(2e-6), shifted(1.08e-5 - 1.88e-5))
    assert c.ok, c.failures
    assert c.logprob_noise == pytest.approx(2e-6) and not c.noisy
    assert c.max_logprob_diff == pytest.approx(1.08e-5)
    assert c.max_logprob_diff_vllm == pytest.approx(1.88e-5)
    assert c.logprob_bound == pytest.approx(2e-5)
    assert c.beams_identical and c.beams_match_vllm and c.computed_as_expected

    noisy = _case_report(beams(*REF), shifted(5e-3), beams(*REF))
    assert not noisy.ok and noisy.noisy and noisy.logprob_bound == LOGPROB_TOLERANCE


def test_the_table_and_the_json_show_noise_differences_and_bound(tmp_path):
    ok = _case_report(shifted(1.08e-5), shifted(2e-6), shifted(1.08e-5 - 1.88e-5))
    noisy = _case_report(beams(*REF), shifted(5e-3), beams(*REF))
    report = _harness_report(ok, noisy)
    table = format_table(report).splitlines()
    assert table[0].split()[-7:] == ["noise", "d", "coloc", "d", "vllm", "bound", "result"]
    row = table[2].split()
    # noise, d coloc, d vllm, bound, then the result.
    assert row[-5:] == ["2.0e-06", "1.1e-05", "1.9e-05", "2.0e-05", "identical"]
    assert "5.0e-03" in table[3] and "FAIL: noisy:" in table[3]
    assert "logprobs within max(1e-05, 10 x noise), noise at most 1e-03" in table[-1]
    assert table[-1].startswith("1/2 cases identical")

    path = tmp_path / "verify.json"
    write_json(report, path)
    data = json.loads(path.read_text())
    assert data["ok"] is False
    assert (data["logprob_tolerance"], data["noise_factor"], data["noise_ceiling"]) == (
        LOGPROB_TOLERANCE, NOISE_FACTOR, NOISE_CEILING)
    first = data["cases"][0]
    assert first["logprob_noise"] == pytest.approx(2e-6)
    assert first["max_logprob_diff"] == pytest.approx(1.08e-5)
    assert first["max_logprob_diff_vllm"] == pytest.approx(1.88e-5)
    assert first["logprob_bound"] == pytest.approx(2e-5)
    assert first["noisy"] is False and data["cases"][1]["noisy"] is True


# --- the second reference run ---------------------------------------------------------


class _FakeP:
    """A P whose stage 1 streams a token per event-loop turn until cancelled."""

    vocab_size = 64
    max_model_len = 4096

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.events: list[str] = []
        self.num_beside_tokens = 0

    async def stream_stage1(self, prompt_token_ids, params, request_id, *, export):
        assert not export and params.temperature == 0.0 and params.ignore_eos
        self.events.append(f"start {request_id} ({len(prompt_token_ids)} tokens)")
        if self.fail:
            raise RuntimeError("engine core died")
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(0)
                self.num_beside_tokens += 1
                yield [i], [], None
        except asyncio.CancelledError:
            self.events.append(f"aborted {request_id}")
            raise
        self.events.append(f"finished {request_id}")


def test_the_rerun_runs_beside_an_unrelated_request_then_aborts_it(monkeypatch):
    p = _FakeP()

    async def rerun(engine, prompt, beam, request_id, adapter=""):
        # STEP 2: the rerun starts once the unrelated request decodes, and runs beside it.
        assert engine is p and p.num_beside_tokens >= 1
        p.events.append(f"rerun {request_id} on {len(prompt)} tokens, W={beam.beam_width}")
        for _ in range(5):
            await asyncio.sleep(0)
        return Stage2Result(beams(*REF), len(prompt), 0, 0, 1, 1, 0.0, 0.0)

    monkeypatch.setattr(run_module, "run_beam_stage", rerun)
    harness = Harness(p, None, tokenizer=None, think_end_id=1, eos_id=2, suffix_ids=[3])
    case = Case("p40-think-w4", 40, "think_end", 4)

    async def main() -> tuple[list[Beam], list[str]]:
        got = await harness.rerun_beside(case, list(range(10, 50)),
                                         BeamParams(beam_width=4, max_tokens=3))
        return got, list(p.events)  # as rerun_beside left P, before asyncio.run tidies

    # STEP 1: P starts the unrelated request; STEP 3: it is aborted once the rerun ends.
    got, events = asyncio.run(main())
    assert got == beams(*REF)
    assert events == [
        f"start verify-p40-think-w4-beside ({run_module.BESIDE_PROMPT_LEN} tokens)",
        "rerun verify-p40-think-w4-rerun on 40 tokens, W=4",
        "aborted verify-p40-think-w4-beside",
    ]
    assert p.num_beside_tokens < run_module.BESIDE_MAX_TOKENS


def test_a_failed_unrelated_request_fails_the_rerun(monkeypatch):
    async def rerun(*args, **kwargs):
        raise AssertionError("no rerun without the unrelated request beside it")

    monkeypatch.setattr(run_module, "run_beam_stage", rerun)
    harness = Harness(_FakeP(fail=True), None, tokenizer=None, think_end_id=1, eos_id=2,
                      suffix_ids=[3])
    with pytest.raises(RuntimeError, match="engine core died"):
        asyncio.run(harness.rerun_beside(Case("c", 40, "think_end", 4), [5] * 40,
                                         BeamParams(beam_width=4, max_tokens=3)))

"""Handoff-correctness harness: every case through the colocated reference and through
the P -> D handoff, compared token for token.

A case passes when stage-1 tokens are identical, the beams are identical (token ids and
order) with cumulative logprobs within ``LOGPROB_TOLERANCE``, and D computed exactly
``len(suffix) + 1`` tokens for the import step. After all cases both pools must be
clean: P holds no exported block, D holds only prefix-cached (free) blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvhandoff.pipeline import TwoStageRequest, TwoStageResult, run_colocated, run_handoff
from kvhandoff.types import BeamParams, Stage1Params

if TYPE_CHECKING:
    from decode_engine.engine import DecodeEngine
    from prefill_engine.engine import PrefillEngine

logger = logging.getLogger(__name__)

#: Cumulative logprobs of the two paths may differ by float rounding (the reference
#: recomputes the parent's partial last block; D imports it). Stated and small.
LOGPROB_TOLERANCE = 1e-5

Ending = Literal["think_end", "eos", "length"]


@dataclass(frozen=True)
class Case:
    """One harness case. The stage-1 seed is searched so stage 1 ends by ``ending``."""

    name: str
    prompt_len: int
    ending: Ending
    beam_width: int
    stage1_max_tokens: int = 48
    beam_max_tokens: int = 3
    extra_suffix_len: int = 0
    seed: int = 0


def default_cases(quick: bool = False) -> list[Case]:
    cases = [
        Case("p31-think-w4", 31, "think_end", 4),
        Case("p32-eos-w4", 32, "eos", 4),
        Case("p33-len-w4", 33, "length", 4, stage1_max_tokens=31),
        Case("p63-think-w1", 63, "think_end", 1),
        Case("p64-len-w32", 64, "length", 32, stage1_max_tokens=32),
        Case("p65-eos-w4", 65, "eos", 4),
        Case("p64-think-longsuffix-w4", 64, "think_end", 4, extra_suffix_len=37),
        Case("p100-think-w32-s1", 100, "think_end", 32, seed=1),
        Case("p100-think-w32-s2", 100, "think_end", 32, seed=2),
        Case("p500-len200-w32", 500, "length", 32, stage1_max_tokens=200),
    ]
    if quick:
        keep = {"p31-think-w4", "p32-eos-w4", "p33-len-w4", "p64-think-longsuffix-w4",
                "p500-len200-w32"}
        cases = [c for c in cases if c.name in keep]
    return cases


@dataclass
class CaseReport:
    name: str
    prompt_token_ids: list[int]
    stage1_seed: int
    stage1_token_ids: list[int]
    stage1_finish_reason: str
    suffix_token_ids: list[int]
    beam: dict[str, Any]
    colocated_beams: list[dict[str, Any]]
    handoff_beams: list[dict[str, Any]]
    num_parent_tokens: int
    num_imported_tokens: int
    num_computed_tokens_d_first_step: int
    num_computed_tokens_d_total: int
    num_bytes_moved: int
    #: What a text round-trip would compute: the re-tokenised parent + suffix.
    num_text_roundtrip_tokens: int | None
    stage1_identical: bool
    beams_identical: bool
    max_logprob_diff: float
    computed_as_expected: bool
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class HarnessReport:
    model_dir: str
    block_size: int
    logprob_tolerance: float
    cases: list[CaseReport]
    pools_clean: bool
    pool_details: dict[str, Any]
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.pools_clean and all(c.ok for c in self.cases)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _prompt(length: int, key: str, token_ids: list[int]) -> list[int]:
    """Random non-special token ids, distinct per case, so no case finds another's
    parent in D's prefix cache (the import must cover the whole parent)."""
    rng = random.Random(key)
    return [rng.choice(token_ids) for _ in range(length)]


class Harness:
    def __init__(self, p: PrefillEngine, d: DecodeEngine, *, tokenizer: Any,
                 think_end_id: int, eos_id: int, suffix_ids: list[int]):
        self.p, self.d = p, d
        self.tokenizer = tokenizer
        self.think_end_id = think_end_id
        self.eos_id = eos_id
        self.suffix_ids = suffix_ids
        special = set(getattr(tokenizer, "all_special_ids", None) or [])
        self.normal_ids = [i for i in range(p.vocab_size) if i not in special]

    async def _find_seed(self, case: Case, prompt: list[int], stage1: Stage1Params) -> int:
        """A stage-1 seed for which stage 1 ends the way the case asks."""
        for seed in range(case.seed * 1000, case.seed * 1000 + 400):
            probe = Stage1Params(**{**asdict(stage1), "seed": seed})
            out = await self.p.run_stage1(prompt, probe, f"probe-{case.name}-{seed}", export=False)
            last = out.token_ids[-1]
            ended = ("length" if out.finish_reason == "length"
                     else "think_end" if last == self.think_end_id
                     else "eos" if last == self.eos_id else None)
            if ended == case.ending:
                return seed
        raise RuntimeError(f"{case.name}: no seed in 400 makes stage 1 end by {case.ending}")

    def build_request(self, case: Case, seed: int, prompt: list[int]) -> TwoStageRequest:
        extra = _prompt(case.extra_suffix_len, f"{case.name}/suffix", self.normal_ids)
        return TwoStageRequest(
            request_id=f"verify-{case.name}",
            prompt_token_ids=prompt,
            suffix_token_ids=self.suffix_ids + extra,
            stage1=Stage1Params(max_tokens=case.stage1_max_tokens, temperature=1.0,
                                seed=seed, stop_token_ids=(self.think_end_id,)),
            beam=BeamParams(beam_width=case.beam_width, max_tokens=case.beam_max_tokens),
            think_end_id=self.think_end_id,
        )

    async def run_case(self, case: Case) -> CaseReport:
        prompt = _prompt(case.prompt_len, case.name, self.normal_ids)
        base = Stage1Params(max_tokens=case.stage1_max_tokens, temperature=1.0,
                            stop_token_ids=(self.think_end_id,))
        seed = await self._find_seed(case, prompt, base)
        req = self.build_request(case, seed, prompt)
        ref = await run_colocated(self.p, req)
        got = await run_handoff(self.p, self.d, req)
        return self.compare(case, seed, req, ref, got)

    def _roundtrip_tokens(self, parent: list[int], suffix: list[int]) -> int | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(parent + suffix, skip_special_tokens=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def compare(self, case: Case, seed: int, req: TwoStageRequest,
                ref: TwoStageResult, got: TwoStageResult) -> CaseReport:
        failures = []
        stage1_same = ref.stage1.token_ids == got.stage1.token_ids
        if not stage1_same:
            failures.append("stage-1 tokens differ")
        if case.ending == "length" and got.stage1.finish_reason != "length":
            failures.append(f"stage 1 ended by {got.stage1.finish_reason}, expected length")
        ids_same = [b.token_ids for b in ref.stage2.beams] == [b.token_ids for b in got.stage2.beams]
        diffs = [abs(a.cum_logprob - b.cum_logprob) for a, b in zip(ref.stage2.beams, got.stage2.beams)]
        max_diff = max(diffs, default=0.0)
        if not ids_same:
            failures.append("beams differ (token ids or order)")
        if max_diff > LOGPROB_TOLERANCE:
            failures.append(f"cumulative logprobs differ by {max_diff:.2e} > {LOGPROB_TOLERANCE:.0e}")
        s2 = got.stage2
        parent_len = len(got.parent_token_ids)
        expected_computed = len(got.suffix_token_ids) + 1
        computed_ok = s2.num_computed_tokens_first_step == expected_computed
        if not computed_ok:
            failures.append(f"D computed {s2.num_computed_tokens_first_step} tokens for the "
                            f"import step, expected len(suffix)+1 = {expected_computed}")
        if s2.num_imported_tokens != parent_len - 1:
            failures.append(f"D imported {s2.num_imported_tokens} tokens, expected {parent_len - 1}")

        def beams(r: TwoStageResult) -> list[dict[str, Any]]:
            return [asdict(b) for b in r.stage2.beams]

        return CaseReport(
            name=case.name,
            prompt_token_ids=req.prompt_token_ids,
            stage1_seed=seed,
            stage1_token_ids=got.stage1.token_ids,
            stage1_finish_reason=got.stage1.finish_reason,
            suffix_token_ids=got.suffix_token_ids,
            beam=asdict(req.beam),
            colocated_beams=beams(ref),
            handoff_beams=beams(got),
            num_parent_tokens=parent_len,
            num_imported_tokens=s2.num_imported_tokens,
            num_computed_tokens_d_first_step=s2.num_computed_tokens_first_step,
            num_computed_tokens_d_total=s2.num_computed_tokens_total,
            num_bytes_moved=s2.num_imported_bytes,
            num_text_roundtrip_tokens=self._roundtrip_tokens(got.parent_token_ids, got.suffix_token_ids),
            stage1_identical=stage1_same,
            beams_identical=ids_same,
            max_logprob_diff=max_diff,
            computed_as_expected=computed_ok,
            failures=failures,
        )

    async def run(self, cases: list[Case], *, model_dir: str, progress: Any = None) -> HarnessReport:
        t0 = time.perf_counter()
        reports = []
        for case in cases:
            reports.append(await self.run_case(case))
            if progress is not None:
                progress(reports[-1])
        p_pool = await self.p.wait_pool_clean()
        d_pool = await self.d.wait_pool_clean()
        return HarnessReport(
            model_dir=model_dir,
            block_size=self.p.block_size,
            logprob_tolerance=LOGPROB_TOLERANCE,
            cases=reports,
            pools_clean=p_pool.is_clean and d_pool.is_clean,
            pool_details={"prefill": asdict(p_pool), "decode": asdict(d_pool)},
            elapsed_s=time.perf_counter() - t0,
        )


def format_table(report: HarnessReport) -> str:
    head = (f"{'case':<26}{'parent':>7}{'stage1':>8}{'suffix':>7}{'W':>4}{'imported':>9}"
            f"{'D comp':>7}{'text rt':>8}{'KiB moved':>10}{'dlogp':>9}  result")
    lines = [head, "-" * len(head)]
    for c in report.cases:
        lines.append(
            f"{c.name:<26}{c.num_parent_tokens:>7}{len(c.stage1_token_ids):>4} "
            f"{c.stage1_finish_reason[:3]:>3}{len(c.suffix_token_ids):>7}{c.beam['beam_width']:>4}"
            f"{c.num_imported_tokens:>9}{c.num_computed_tokens_d_first_step:>7}"
            f"{(c.num_text_roundtrip_tokens or 0):>8}{c.num_bytes_moved / 1024:>10.0f}"
            f"{c.max_logprob_diff:>9.1e}  {'identical' if c.ok else 'FAIL: ' + '; '.join(c.failures)}"
        )
    n_ok = sum(c.ok for c in report.cases)
    lines.append("-" * len(head))
    lines.append(
        f"{n_ok}/{len(report.cases)} cases identical (beams exact, logprobs within "
        f"{report.logprob_tolerance:.0e}); pools clean: {'yes' if report.pools_clean else 'NO'} "
        f"{report.pool_details if not report.pools_clean else ''}; {report.elapsed_s:.1f}s"
    )
    return "\n".join(lines)


def write_json(report: HarnessReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")


async def verify(model: str | None, *, quick: bool, json_path: str | None,
                 lease_s: int = 30) -> HarnessReport:
    """Start P and D on ``model``, run the harness, shut both down."""
    from kvhandoff.local import local_pair

    async with local_pair(model, lease_s=lease_s) as pair:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids)
        cases = default_cases(quick)

        def progress(c: CaseReport) -> None:
            print(f"  [{len(done) + 1}/{len(cases)}] {c.name}: "
                  f"{'identical' if c.ok else 'FAIL ' + '; '.join(c.failures)}", flush=True)
            done.append(c)

        done: list[CaseReport] = []
        report = await harness.run(cases, model_dir=str(pair.model_dir), progress=progress)
    if json_path:
        write_json(report, json_path)
    return report


def main_verify(model: str | None, quick: bool, json_path: str | None) -> int:
    report = asyncio.run(verify(model, quick=quick, json_path=json_path))
    print(format_table(report))
    return 0 if report.ok else 1

"""Handoff-correctness harness: every case through the colocated reference and through
the P -> D handoff, compared token for token.

A case passes when
- stage-1 tokens are identical on P and on D (the same seed on another engine),
- the handoff's beams equal the colocated reference's (token ids and order) with
  cumulative logprobs within ``LOGPROB_TOLERANCE``, and equal vLLM's own
  ``beam_search`` on the same continuation prompt (a reference we did not write),
- D imported exactly the parent's ``N - 1`` tokens it did not already hold and computed
  ``len(suffix) + 1`` tokens for the import step.
After all cases both pools must be clean: P holds no exported block, D only
prefix-cached (free) blocks.

Negative controls: ``run(..., fault=F)`` injects a fault of :mod:`connector.faults` into
the real connector on every handoff; a case the fault applies to must then FAIL and
name what differs (``tests/test_harness.py`` asserts it for every fault).
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

from connector.faults import FAULTS, applies
from decode_engine.beam import vllm_beam_search
from kvhandoff.budget import stage2_reservation
from kvhandoff.corpus import HISTORY_PREFIX, ITEMS
from kvhandoff.types import Beam, BeamParams, Stage1Params
from prefill_engine.engine import stage1_sampling
from tools.pipeline import (
    TwoStageRequest,
    TwoStageResult,
    run_colocated,
    run_handoff,
    stage2_prompt,
)

if TYPE_CHECKING:
    from decode_engine.engine import DecodeEngine
    from prefill_engine.engine import PrefillEngine

logger = logging.getLogger(__name__)

#: Cumulative logprobs of the two paths may differ by float rounding (the reference
#: recomputes the parent's partial last block; D imports it). Stated and small.
LOGPROB_TOLERANCE = 1e-5

#: D's pool for ``kvhandoff verify``, in blocks: 128 usable plus vLLM's null block, so the
#: ``fill-d-pool`` case can fill it within a 4096-token context.
VERIFY_D_POOL_BLOCKS = 129

Ending = Literal["think_end", "eos", "length"]
#: ``cold``: D's prefix cache is reset before the handoff (the import reads the whole
#: parent); ``warm``: D ran the same stage 1 first, so it holds the parent's full blocks
#: and the import reads only the rest; ``fill``: the prompt is sized so the stage 2
#: needs D's whole pool, to the last block.
DState = Literal["cold", "warm", "fill"]


@dataclass(frozen=True)
class Case:
    """One harness case. The stage-1 seed is searched so stage 1 ends by ``ending``;
    with ``length`` and a ``stage1_max_tokens`` below the shortest thinking span the
    parent length is exact: N = prompt_len + stage1_max_tokens."""

    name: str
    prompt_len: int
    ending: Ending
    beam_width: int
    stage1_max_tokens: int = 48
    beam_max_tokens: int = 3
    extra_suffix_len: int = 0
    seed: int = 0
    d_state: DState = "cold"


def default_cases(quick: bool = False) -> list[Case]:
    # B = 32. Parent edges: N - 1 = kB - 1, kB, kB + 1 for k = 2 and k = 8.
    cases = [
        Case("n64-edge-w4", 60, "length", 4, stage1_max_tokens=4),
        Case("n65-edge-w1", 61, "length", 1, stage1_max_tokens=4),
        Case("n66-edge-w32", 62, "length", 32, stage1_max_tokens=4),
        Case("n256-edge-w32", 252, "length", 32, stage1_max_tokens=4),
        Case("n257-edge-w4", 253, "length", 4, stage1_max_tokens=4),
        Case("n258-edge-w1", 254, "length", 1, stage1_max_tokens=4),
        Case("p40-think-w4", 40, "think_end", 4),
        Case("p33-eos-w4", 33, "eos", 4),
        Case("p50-think-w4-t5", 50, "think_end", 4, beam_max_tokens=5),
        Case("p64-think-longsuffix-w4", 64, "think_end", 4, extra_suffix_len=37),
        Case("p100-think-w32-s1", 100, "think_end", 32, seed=1),
        Case("p690-think-w32", 690, "think_end", 32, seed=2),
        Case("warm-d-p200-w4", 200, "think_end", 4, d_state="warm"),
        Case("fill-d-pool-w1", 0, "length", 1, stage1_max_tokens=4, d_state="fill"),
    ]
    if quick:
        keep = {"n65-edge-w1", "n66-edge-w32", "p33-eos-w4", "p50-think-w4-t5",
                "p64-think-longsuffix-w4", "p690-think-w32", "warm-d-p200-w4"}
        cases = [c for c in cases if c.name in keep]
    return cases


def fault_cases() -> list[Case]:
    """Cases every fault is run on: a parent with two full blocks and a partial one,
    one that ends exactly at a block boundary, and a long one."""
    keep = {"n66-edge-w32", "n257-edge-w4", "p100-think-w32-s1"}
    return [c for c in default_cases() if c.name in keep]


@dataclass
class CaseReport:
    name: str
    prompt_token_ids: list[int]
    stage1_seed: int
    stage1_token_ids: list[int]
    stage1_finish_reason: str
    suffix_token_ids: list[int]
    beam: dict[str, Any]
    d_state: str
    colocated_beams: list[dict[str, Any]]
    handoff_beams: list[dict[str, Any]]
    vllm_beams: list[dict[str, Any]]
    num_parent_tokens: int
    num_imported_tokens: int
    #: Parent tokens D already held in its prefix cache (not read from P).
    num_found_on_d_tokens: int
    num_computed_tokens_d_first_step: int
    num_computed_tokens_d_total: int
    num_bytes_moved: int
    #: What a text round-trip would compute: the re-tokenised parent + suffix.
    num_text_roundtrip_tokens: int | None
    stage1_identical: bool
    stage1_identical_on_d: bool
    beams_identical: bool
    beams_match_vllm: bool
    max_logprob_diff: float
    computed_as_expected: bool
    fault: str | None = None
    #: False: the injected fault cannot corrupt this parent (e.g. no partial block).
    fault_applies: bool = True
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
    fault: str | None = None

    @property
    def ok(self) -> bool:
        return self.pools_clean and all(c.ok for c in self.cases)

    @property
    def caught(self) -> list[str]:
        """Cases whose failures the injected fault caused (the fault applied)."""
        return [c.name for c in self.cases if c.fault_applies and not c.ok]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def history_prompt(length: int, key: str, tokenizer: Any) -> list[int]:
    """A corpus-like prompt of exactly ``length`` tokens (``history: items\n<think>``),
    its items drawn from ``key``: distinct per case, so no case finds another's parent
    in D's prefix cache."""
    head = tokenizer.encode(HISTORY_PREFIX, add_special_tokens=False)
    tail = tokenizer.encode("\n<think>", add_special_tokens=False)
    items = [tokenizer.encode(" " + item, add_special_tokens=False) for item in ITEMS]
    assert all(len(i) == 1 for i in items), "corpus items must be single tokens"
    rng = random.Random(key)
    num_items = length - len(head) - len(tail)
    if num_items < 2:
        raise ValueError(f"a history prompt needs at least {len(head) + len(tail) + 2} tokens")
    return head + [rng.choice(items)[0] for _ in range(num_items)] + tail


def _beam_dicts(beams: list[Beam]) -> list[dict[str, Any]]:
    return [asdict(b) for b in beams]


def _compare_beams(ours: list[Beam], theirs: list[Beam]) -> tuple[bool, float]:
    same = [b.token_ids for b in ours] == [b.token_ids for b in theirs]
    diffs = [abs(a.cum_logprob - b.cum_logprob) for a, b in zip(ours, theirs)]
    return same, max(diffs, default=0.0)


@dataclass
class _Reference:
    """What a case computes without any handoff; reused by the fault runs."""

    seed: int
    prompt: list[int]
    request: TwoStageRequest
    colocated: TwoStageResult
    d_stage1_token_ids: list[int]
    vllm_beams: list[Beam]


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
        self._references: dict[str, _Reference] = {}

    def _prompt_len(self, case: Case) -> int:
        if case.d_state != "fill":
            return case.prompt_len
        # The longest prompt whose stage 2 fits D's pool and the model's context; with
        # 4096 tokens and 128 blocks of 32 it needs every block.
        b, total = self.d.block_size, self.d.num_total_blocks
        max_len = min(self.p.max_model_len, self.d.max_model_len)
        suffix = len(self.suffix_ids) + case.extra_suffix_len
        for n in range(max_len - case.beam_max_tokens - suffix - case.stage1_max_tokens,
                       0, -1):
            parent_and_suffix = n + case.stage1_max_tokens + suffix
            if stage2_reservation(parent_and_suffix, b, case.beam_width, case.beam_max_tokens,
                                  self.d.config.beam_fork, total) <= total:
                return n
        raise RuntimeError("no prompt fits D's pool")

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
        rng = random.Random(f"{case.name}/suffix")
        extra = [rng.choice(self.normal_ids) for _ in range(case.extra_suffix_len)]
        return TwoStageRequest(
            request_id=f"verify-{case.name}",
            prompt_token_ids=prompt,
            suffix_token_ids=self.suffix_ids + extra,
            stage1=Stage1Params(max_tokens=case.stage1_max_tokens, temperature=1.0,
                                seed=seed, stop_token_ids=(self.think_end_id,)),
            beam=BeamParams(beam_width=case.beam_width, max_tokens=case.beam_max_tokens),
            think_end_id=self.think_end_id,
        )

    @staticmethod
    async def _reset_cache(engine: Any) -> None:
        """Empty an idle engine's prefix cache (a kept beam-fork request or an export
        may still be releasing its blocks, so wait for a clean pool first)."""
        for _ in range(20):
            await engine.wait_pool_clean()
            if await engine.llm.reset_prefix_cache():
                return
            await asyncio.sleep(0.25)
        raise RuntimeError(f"{engine.engine_id}: prefix cache not reset, blocks still held")

    async def reference(self, case: Case) -> _Reference:
        """Stage 1 on P and on D, the colocated two stages on P, vLLM's beam search."""
        if case.name in self._references:
            return self._references[case.name]
        prompt = history_prompt(self._prompt_len(case), case.name, self.tokenizer)
        base = Stage1Params(max_tokens=case.stage1_max_tokens, temperature=1.0,
                            stop_token_ids=(self.think_end_id,))
        seed = await self._find_seed(case, prompt, base)
        req = self.build_request(case, seed, prompt)
        colocated = await run_colocated(self.p, req)
        # The same stage 1 on another engine: seeded sampling gives the same tokens.
        on_d = await self.d.generate(prompt, stage1_sampling(req.stage1),
                                     f"verify-{case.name}-d1")
        prompt2, _ = stage2_prompt(req, colocated.stage1)
        theirs = await vllm_beam_search(self.p.llm, self.tokenizer, prompt2, req.beam,
                                        f"verify-{case.name}-vllm")
        ref = _Reference(seed, prompt, req, colocated, list(on_d.outputs[0].token_ids), theirs)
        self._references[case.name] = ref
        return ref

    async def run_case(self, case: Case, fault: str | None = None) -> CaseReport:
        ref = await self.reference(case)
        if case.d_state == "warm":
            # D ran this stage 1 itself (the reference): it holds the parent's full blocks.
            await self.d.generate(ref.prompt, stage1_sampling(ref.request.stage1),
                                  f"verify-{case.name}-warm")
        else:
            await self._reset_cache(self.d)
        got = await run_handoff(self.p, self.d, ref.request, fault=fault)
        if fault is not None and FAULTS[fault].side == "prefill":
            await self._reset_cache(self.p)  # P's cache holds the overwritten blocks
        return self.compare(case, ref, got, fault)

    def _roundtrip_tokens(self, parent: list[int], suffix: list[int]) -> int | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(parent + suffix, skip_special_tokens=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def compare(self, case: Case, ref: _Reference, got: TwoStageResult,
                fault: str | None = None) -> CaseReport:
        failures = []
        stage1_same = ref.colocated.stage1.token_ids == got.stage1.token_ids
        if not stage1_same:
            failures.append("stage-1 tokens differ")
        stage1_same_d = ref.d_stage1_token_ids == got.stage1.token_ids
        if not stage1_same_d:
            failures.append("stage-1 tokens differ between P and D")
        if case.ending == "length" and got.stage1.finish_reason != "length":
            failures.append(f"stage 1 ended by {got.stage1.finish_reason}, expected length")
        ids_same, max_diff = _compare_beams(got.stage2.beams, ref.colocated.stage2.beams)
        if not ids_same:
            failures.append("beams differ from the colocated reference (token ids or order)")
        if max_diff > LOGPROB_TOLERANCE:
            failures.append(f"cumulative logprobs differ by {max_diff:.2e} > "
                            f"{LOGPROB_TOLERANCE:.0e}")
        vllm_same, vllm_diff = _compare_beams(got.stage2.beams, ref.vllm_beams)
        vllm_ok = vllm_same and vllm_diff <= LOGPROB_TOLERANCE
        if not vllm_ok:
            failures.append(f"beams differ from vLLM's beam_search (ids "
                            f"{'same' if vllm_same else 'differ'}, logprobs by {vllm_diff:.2e})")
        s2 = got.stage2
        parent_len = len(got.parent_token_ids)
        found = parent_len - 1 - s2.num_imported_tokens if case.d_state == "warm" else 0
        expected_computed = len(got.suffix_token_ids) + 1
        computed_ok = s2.num_computed_tokens_first_step == expected_computed
        if not computed_ok:
            failures.append(f"D computed {s2.num_computed_tokens_first_step} tokens for the "
                            f"import step, expected len(suffix)+1 = {expected_computed}")
        if case.d_state == "warm":
            full = (parent_len - 1) // self.d.block_size * self.d.block_size
            if found != full:
                failures.append(f"D found {found} parent tokens in its prefix cache, "
                                f"expected its {full} full-block tokens")
        elif s2.num_imported_tokens != parent_len - 1:
            failures.append(f"D imported {s2.num_imported_tokens} tokens, expected {parent_len - 1}")
        if case.d_state == "fill":
            need = stage2_reservation(len(got.parent_token_ids) + len(got.suffix_token_ids),
                                      self.d.block_size, case.beam_width, case.beam_max_tokens,
                                      self.d.config.beam_fork, self.d.num_total_blocks)
            if need != self.d.num_total_blocks:
                failures.append(f"the stage 2 needs {need} of D's {self.d.num_total_blocks} "
                                "blocks, not all of them")

        return CaseReport(
            name=case.name,
            prompt_token_ids=ref.prompt,
            stage1_seed=ref.seed,
            stage1_token_ids=got.stage1.token_ids,
            stage1_finish_reason=got.stage1.finish_reason,
            suffix_token_ids=got.suffix_token_ids,
            beam=asdict(ref.request.beam),
            d_state=case.d_state,
            colocated_beams=_beam_dicts(ref.colocated.stage2.beams),
            handoff_beams=_beam_dicts(got.stage2.beams),
            vllm_beams=_beam_dicts(ref.vllm_beams),
            num_parent_tokens=parent_len,
            num_imported_tokens=s2.num_imported_tokens,
            num_found_on_d_tokens=found,
            num_computed_tokens_d_first_step=s2.num_computed_tokens_first_step,
            num_computed_tokens_d_total=s2.num_computed_tokens_total,
            num_bytes_moved=s2.num_imported_bytes,
            num_text_roundtrip_tokens=self._roundtrip_tokens(got.parent_token_ids, got.suffix_token_ids),
            stage1_identical=stage1_same,
            stage1_identical_on_d=stage1_same_d,
            beams_identical=ids_same,
            beams_match_vllm=vllm_ok,
            max_logprob_diff=max_diff,
            computed_as_expected=computed_ok,
            fault=fault,
            fault_applies=fault is None or applies(FAULTS[fault], parent_len, self.d.block_size),
            failures=failures,
        )

    async def run(self, cases: list[Case], *, model_dir: str, progress: Any = None,
                  fault: str | None = None) -> HarnessReport:
        t0 = time.perf_counter()
        reports = []
        for case in cases:
            reports.append(await self.run_case(case, fault))
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
            fault=fault,
        )


def _result(c: CaseReport) -> str:
    if c.ok:
        return "identical" if c.fault_applies else "identical (fault n/a for this parent)"
    return "FAIL: " + "; ".join(c.failures)


def format_table(report: HarnessReport) -> str:
    head = (f"{'case':<26}{'parent':>7}{'stage1':>8}{'suffix':>7}{'W':>4}{'D':>5}"
            f"{'imported':>9}{'on D':>6}{'D comp':>7}{'text rt':>8}{'KiB moved':>10}"
            f"{'dlogp':>9}  result")
    lines = [f"injected fault: {report.fault} ({FAULTS[report.fault].what})"] if report.fault else []
    lines += [head, "-" * len(head)]
    for c in report.cases:
        lines.append(
            f"{c.name:<26}{c.num_parent_tokens:>7}{len(c.stage1_token_ids):>4} "
            f"{c.stage1_finish_reason[:3]:>3}{len(c.suffix_token_ids):>7}{c.beam['beam_width']:>4}"
            f"{c.d_state:>5}{c.num_imported_tokens:>9}{c.num_found_on_d_tokens:>6}"
            f"{c.num_computed_tokens_d_first_step:>7}"
            f"{(c.num_text_roundtrip_tokens or 0):>8}{c.num_bytes_moved / 1024:>10.0f}"
            f"{c.max_logprob_diff:>9.1e}  {_result(c)}"
        )
    n_ok = sum(c.ok for c in report.cases)
    lines.append("-" * len(head))
    lines.append(
        f"{n_ok}/{len(report.cases)} cases identical (beams exact and equal to vLLM's "
        f"beam_search, logprobs within {report.logprob_tolerance:.0e}, stage 1 equal on P "
        f"and D); pools clean: {'yes' if report.pools_clean else 'NO'} "
        f"{report.pool_details if not report.pools_clean else ''}; {report.elapsed_s:.1f}s"
    )
    if report.fault:
        fault = FAULTS[report.fault]
        verdict = (f"caught in {len(report.caught)} case(s)" if report.caught
                   else "not caught")
        lines.append(f"fault {fault.name}: {verdict}; expected "
                     f"{'caught' if fault.expected_caught else 'invisible'}: {fault.caught_by}")
    return "\n".join(lines)


def write_json(report: HarnessReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")


async def verify(model: str | None, *, quick: bool, json_path: str | None,
                 lease_s: int = 30, inject: str | None = None) -> HarnessReport:
    """Start P and D on ``model``, run the harness (with ``inject``: every handoff
    carries that fault), shut both down."""
    from kvhandoff.model import kv_bytes_per_block, resolve_model
    from tools.local import local_pair

    d_pool = VERIFY_D_POOL_BLOCKS * kv_bytes_per_block(resolve_model(model), block_size=32)
    async with local_pair(model, lease_s=lease_s, fault_injection=inject is not None,
                          decode_overrides={"kv_cache_memory_bytes": d_pool}) as pair:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids)
        cases = default_cases(quick)

        def progress(c: CaseReport) -> None:
            print(f"  [{len(done) + 1}/{len(cases)}] {c.name}: {_result(c)}", flush=True)
            done.append(c)

        done: list[CaseReport] = []
        report = await harness.run(cases, model_dir=str(pair.model_dir), progress=progress,
                                   fault=inject)
    if json_path:
        write_json(report, json_path)
    return report


def main_verify(model: str | None, quick: bool, json_path: str | None,
                inject: str | None = None) -> int:
    if inject is not None and inject not in FAULTS:
        raise SystemExit(f"--inject {inject!r}: not a fault; choose from {', '.join(FAULTS)}")
    report = asyncio.run(verify(model, quick=quick, json_path=json_path, inject=inject))
    print(format_table(report))
    return 0 if report.ok else 1

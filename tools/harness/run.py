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
import contextlib
import logging
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from connector.faults import FAULTS, applies
from decode_engine.beam import vllm_beam_search
from kvhandoff.budget import stage2_reservation
from kvhandoff.model import kv_bytes_per_block, resolve_model
from kvhandoff.types import Beam, BeamParams, Stage1Params, Stage2Result
from prefill_engine.engine import stage1_sampling
from tools.harness.cases import Case, default_cases, history_prompt
from tools.harness.report import (
    LOGPROB_TOLERANCE,
    CaseReport,
    HarnessReport,
    format_table,
    result_text,
    write_json,
)
from tools.local import local_pair
from tools.pipeline import (
    MoveStep,
    TwoStageRequest,
    TwoStageResult,
    run_colocated,
    run_handoff,
    run_moved,
    run_moved_via_p,
    stage2_prompt,
)
from tools.ucx_report import read_transports_in

if TYPE_CHECKING:
    from decode_engine.engine import DecodeEngine
    from prefill_engine.engine import PrefillEngine

logger = logging.getLogger(__name__)

#: D's pool for ``kvhandoff verify``, in blocks: 128 usable plus vLLM's null block, so the
#: ``fill-d-pool`` case can fill it within a 4096-token context.
VERIFY_D_POOL_BLOCKS = 129

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
                 think_end_id: int, eos_id: int, suffix_ids: list[int],
                 p2: PrefillEngine | None = None):
        """``p2``: a second P, for the cases that move stage 1 to another P."""
        self.p, self.d, self.p2 = p, d, p2
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

    async def _find_seed(self, case: Case, prompt: list[int]) -> int:
        """A stage-1 seed for which stage 1 ends the way the case asks."""
        for seed in range(case.seed * 1000, case.seed * 1000 + 400):
            probe = self._stage1_params(case, seed)
            out = await self.p.run_stage1(prompt, probe, f"probe-{case.name}-{seed}", export=False)
            last = out.token_ids[-1]
            ended = ("length" if out.finish_reason == "length"
                     else "think_end" if last == self.think_end_id
                     else "eos" if last == self.eos_id else None)
            if ended == case.ending:
                return seed
        raise RuntimeError(f"{case.name}: no seed in 400 makes stage 1 end by {case.ending}")

    def _stage1_params(self, case: Case, seed: int) -> Stage1Params:
        if case.move_at is None:
            return Stage1Params(max_tokens=case.stage1_max_tokens, temperature=1.0,
                                seed=seed, stop_token_ids=(self.think_end_id,))
        # A move: positional sampling (the same tokens on any engine), a fixed length.
        return Stage1Params(max_tokens=case.stage1_max_tokens,
                            temperature=0.0 if case.greedy else 1.0, seed=seed,
                            stop_token_ids=(self.think_end_id,),
                            min_tokens=case.stage1_max_tokens,
                            positional=case.positional and not case.greedy)

    def build_request(self, case: Case, seed: int, prompt: list[int]) -> TwoStageRequest:
        rng = random.Random(f"{case.name}/suffix")
        extra = [rng.choice(self.normal_ids) for _ in range(case.extra_suffix_len)]
        return TwoStageRequest(
            request_id=f"verify-{case.name}",
            prompt_token_ids=prompt,
            suffix_token_ids=self.suffix_ids + extra,
            stage1=self._stage1_params(case, seed),
            beam=BeamParams(beam_width=case.beam_width, max_tokens=case.beam_max_tokens),
            think_end_id=self.think_end_id,
        )

    async def reference(self, case: Case) -> _Reference:
        """Stage 1 on P and on D, the colocated two stages on P, vLLM's beam search."""
        if case.name in self._references:
            return self._references[case.name]
        prompt = history_prompt(self._prompt_len(case), case.name, self.tokenizer)
        seed = await self._find_seed(case, prompt)
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
        if case.via_p:
            if self.p2 is None:
                raise RuntimeError(f"{case.name}: a move to another P needs a second P")
            await self.d.empty_prefix_cache()
            await self.p2.empty_prefix_cache()
            # An import fault goes into P''s import: its counts are what it corrupts.
            p_fault = fault if fault is not None and FAULTS[fault].side != "prefill" else None
            got, steps = await run_moved_via_p(self.p, self.p2, self.d, ref.request,
                                               case.move_at, case.then_at, p_fault)
            return self.compare(case, ref, got, fault, steps=steps)
        if case.move_at is not None:
            await self.d.empty_prefix_cache()
            got, move = await run_moved(self.p, self.d, ref.request, case.move_at)
            return self.compare(case, ref, got, fault, move=move)
        if case.d_state == "warm":
            # D ran this stage 1 itself (the reference): it holds the parent's full blocks.
            await self.d.generate(ref.prompt, stage1_sampling(ref.request.stage1),
                                  f"verify-{case.name}-warm")
        else:
            await self.d.empty_prefix_cache()
        got = await run_handoff(self.p, self.d, ref.request, fault=fault)
        if fault is not None and FAULTS[fault].side == "prefill":
            await self.p.empty_prefix_cache()  # P's cache holds the overwritten blocks
        return self.compare(case, ref, got, fault)

    def _import_failures(self, case: Case, got: TwoStageResult, found: int) -> list[str]:
        """What D read from P, against the parent and D's cache state."""
        s2, parent_len, b = got.stage2, len(got.parent_token_ids), self.d.block_size
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
                                      self.d.config.beam_fork, self.d.num_total_blocks)
            if need != self.d.num_total_blocks:
                return [f"the stage 2 needs {need} of D's {self.d.num_total_blocks} blocks, "
                        "not all of them"]
        return []

    def _roundtrip_tokens(self, parent: list[int], suffix: list[int]) -> int | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(parent + suffix, skip_special_tokens=False)
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _move_failures(self, case: Case, got: TwoStageResult, move: Stage2Result
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
        b = self.d.block_size
        cached = (len(got.parent_token_ids) - 1) // b * b
        stage2_computed = len(got.parent_token_ids) + len(got.suffix_token_ids) - cached
        if got.stage2.num_computed_tokens_first_step != stage2_computed:
            failures.append(f"stage 2 on D computed {got.stage2.num_computed_tokens_first_step} "
                            f"tokens, expected {stage2_computed} (the parent's full blocks "
                            "from D's prefix cache)")
        return failures

    def _p_move_failures(self, case: Case, got: TwoStageResult, steps: list[MoveStep]
                         ) -> list[str]:
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

    def compare(self, case: Case, ref: _Reference, got: TwoStageResult,
                fault: str | None = None, move: Stage2Result | None = None,
                steps: list[MoveStep] | None = None) -> CaseReport:
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
        if steps is not None:
            moved = self._p_move_failures(case, got, steps[:1])
            if case.then_at is not None:  # P' -> D: stage 2 on D's prefix cache
                moved += self._move_failures(replace(case, move_at=case.then_at), got,
                                             _as_stage2(steps[1]))
            else:  # P' exported the parent: D imported it as from any P
                moved += self._import_failures(case, got, 0)
                if s2.num_computed_tokens_first_step != len(got.suffix_token_ids) + 1:
                    moved.append(f"D computed {s2.num_computed_tokens_first_step} tokens for "
                                 "the import step, expected len(suffix)+1")
            computed_ok = not moved
            failures += moved
            s2 = _as_stage2(steps[0])  # the first move's import: report its figures
        elif move is not None:
            moved = self._move_failures(case, got, move)
            computed_ok = not moved
            failures += moved
            s2 = move  # the import step is the move's: report its figures
        else:
            expected_computed = len(got.suffix_token_ids) + 1
            computed_ok = s2.num_computed_tokens_first_step == expected_computed
            if not computed_ok:
                failures.append(f"D computed {s2.num_computed_tokens_first_step} tokens for "
                                f"the import step, expected len(suffix)+1 = {expected_computed}")
            failures += self._import_failures(case, got, found)

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
            num_text_roundtrip_tokens=self._roundtrip_tokens(got.parent_token_ids, got.suffix_token_ids),
            stage1_identical=stage1_same,
            stage1_identical_on_d=stage1_same_d,
            beams_identical=ids_same,
            beams_match_vllm=vllm_ok,
            max_logprob_diff=max_diff,
            computed_as_expected=computed_ok,
            move_at=case.move_at,
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
        pools = {"prefill": await self.p.wait_pool_clean(),
                 "decode": await self.d.wait_pool_clean()}
        if self.p2 is not None:
            pools["prefill2"] = await self.p2.wait_pool_clean()
        return HarnessReport(
            model_dir=model_dir,
            block_size=self.p.block_size,
            logprob_tolerance=LOGPROB_TOLERANCE,
            cases=reports,
            pools_clean=all(pool.is_clean for pool in pools.values()),
            pool_details={name: asdict(pool) for name, pool in pools.items()},
            elapsed_s=time.perf_counter() - t0,
            fault=fault,
        )


def _as_stage2(step: MoveStep) -> Stage2Result:
    """A move's import step in the figures a case reports."""
    return Stage2Result(beams=[], num_prompt_tokens=0,
                        num_imported_tokens=step.num_imported_tokens,
                        num_imported_bytes=step.num_imported_bytes,
                        num_computed_tokens_first_step=step.num_computed_tokens,
                        num_computed_tokens_total=step.num_computed_tokens,
                        first_step_s=0.0, elapsed_s=0.0)


async def verify(model: str | None, *, quick: bool, json_path: str | None,
                 lease_s: int = 30, inject: str | None = None,
                 on_hosts: dict[str, Any] | None = None,
                 ucx_log_dir: Path = Path("out/verify-logs")) -> HarnessReport:
    """Start P, D and a second P on ``model``, run the harness (with ``inject``: every
    handoff carries that fault, and no second P), shut them down. ``on_hosts`` (tools.netns
    hosts ``p`` and ``d``): the Ps' processes on one host, D's on the other; the report
    then names the transports UCX chose for the READs, which must be network ones."""

    d_pool = VERIFY_D_POOL_BLOCKS * kv_bytes_per_block(resolve_model(model), block_size=32)
    if on_hosts:
        for old in ucx_log_dir.glob("*.ucx.log"):
            old.unlink()
    async with local_pair(model, lease_s=lease_s, fault_injection=inject is not None,
                          decode_overrides={"kv_cache_memory_bytes": d_pool},
                          second_prefill=inject is None, on_hosts=on_hosts,
                          ucx_log_dir=ucx_log_dir if on_hosts else None) as pair:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids, p2=pair.p2)
        cases = default_cases(quick, via_p=pair.p2 is not None)

        def progress(c: CaseReport) -> None:
            print(f"  [{len(done) + 1}/{len(cases)}] {c.name}: {result_text(c)}", flush=True)
            done.append(c)

        done: list[CaseReport] = []
        report = await harness.run(cases, model_dir=str(pair.model_dir), progress=progress,
                                   fault=inject)
    if on_hosts:
        # D reads from P (a handoff, a move to D); the second P reads from P (a move).
        report.hosts = {"p": on_hosts["p"].address, "d": on_hosts["d"].address}
        report.read_transports = sorted(read_transports_in(sorted(
            ucx_log_dir.glob("*.ucx.log"))))
    if json_path:
        write_json(report, json_path)
    return report


def main_verify(model: str | None, quick: bool, json_path: str | None,
                inject: str | None = None, hosts: str | None = None) -> int:
    if inject is not None and inject not in FAULTS:
        raise SystemExit(f"--inject {inject!r}: not a fault; choose from {', '.join(FAULTS)}")
    where: contextlib.AbstractContextManager[Any] = contextlib.nullcontext(None)
    if hosts == "netns":
        from tools.netns import can_create
        from tools.netns import hosts as make_hosts

        why = can_create()
        if why:
            raise SystemExit(f"kvhandoff verify --hosts netns: cannot make the hosts here: "
                             f"{why}")
        where = make_hosts(("p", "d"))
    with where as on_hosts:
        report = asyncio.run(verify(model, quick=quick, json_path=json_path, inject=inject,
                                    on_hosts=on_hosts))
    print(format_table(report))
    return 0 if report.ok else 1

"""Handoff-correctness harness: every case through the colocated reference and through
the P -> D handoff (or its moves), compared token for token by ``tools.harness.checks``.

Per case, the references (computed once, reused by the fault runs): stage 1 on P and on
D, the colocated two stages on P, vLLM's own beam search on the same continuation
prompt, and two measures of the engine's own spread, which set the case's bound
(``tools.harness.checks``): the colocated stage 2 run again on P beside an unrelated
request (another batch composition), and vLLM's beam search on D from an empty prefix
cache (another engine, another shape of computation). D's prefix cache is emptied
before each handoff except where the case asks for a warm D. After all cases every pool
must be clean: P holds no exported block, D only prefix-cached (free) blocks.

Negative controls: ``run(..., fault=F)`` injects a fault of :mod:`connector.faults` into
the real connector on every handoff; a case the fault applies to must then FAIL and
name what differs (``tests/test_harness.py`` asserts it for every fault).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from connector.faults import FAULTS
from decode_engine.engine import run_beam_stage
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.budget import stage2_reservation
from kvhandoff.types import Beam, BeamParams, Stage1Params, StageError
from prefill_engine.engine import PINNED, stage1_sampling
from tools.harness.cases import Case, history_prompt
from tools.harness.checks import NOISE_CEILING, NOISE_FACTOR, Reference, compare, refused
from tools.harness.report import LOGPROB_TOLERANCE, CaseReport, HarnessReport
from tools.pipeline import (
    TwoStageRequest,
    run_colocated,
    run_handoff,
    run_moved,
    run_moved_via_p,
    stage2_prompt,
)

if TYPE_CHECKING:
    from decode_engine.engine import DecodeEngine
    from prefill_engine.engine import PrefillEngine

logger = logging.getLogger(__name__)

#: The unrelated request a reference's stage 2 is rerun beside: a prompt of this many
#: random tokens, decoding at most ``BESIDE_MAX_TOKENS`` (aborted when the rerun ends).
BESIDE_PROMPT_LEN = 32
BESIDE_MAX_TOKENS = 512
#: How long a case waits for the engines' count of a fault that applies to it.
FAULT_COUNT_WAIT_S = 5.0


class Harness:
    """Runs harness cases on P and D (and a second P), with the references they are
    compared against."""

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
        self._references: dict[str, Reference] = {}

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
            out = await self.p.run_stage1(prompt, probe, f"probe-{case.name}-{seed}",
                                          export=False, adapter=case.adapter)
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
            adapter=case.adapter,
        )

    async def reference(self, case: Case) -> Reference:
        """Stage 1 on P and on D, the colocated two stages on P, vLLM's beam search, and
        the case's noise: the colocated stage 2 again beside an unrelated request, and
        vLLM's beam search on D from an empty cache."""
        if case.name in self._references:
            return self._references[case.name]
        prompt = history_prompt(self._prompt_len(case), case.name, self.tokenizer)
        seed = await self._find_seed(case, prompt)
        req = self.build_request(case, seed, prompt)
        colocated = await run_colocated(self.p, req)
        adapter2 = case.stage2_adapter
        if case.adapters_differ:
            # Stage 2 under the other adapter, over the same parent, from token ids.
            stage2 = await run_beam_stage(self.p, stage2_prompt(req, colocated.stage1)[0],
                                          req.beam, f"verify-{case.name}-c2x",
                                          adapter=adapter2)
            colocated = replace(colocated, stage2=stage2)
        # The same stage 1 on another engine: seeded sampling gives the same tokens.
        # D computes it as P did: P's seed probes left the prompt's full blocks in P's
        # prefix cache, so P computed only the rest on top of them; D gets them the same
        # way first. From scratch, D would sum in another order, and in bf16 a sampled
        # token can flip on that alone (a 737-token prompt did).
        await self.d.generate(prompt, stage1_sampling(Stage1Params(max_tokens=1)),
                              f"verify-{case.name}-d1-cache", adapter=case.adapter)
        on_d = await self.d.generate(prompt, stage1_sampling(req.stage1),
                                     f"verify-{case.name}-d1", adapter=case.adapter)
        prompt2, _ = stage2_prompt(req, colocated.stage1)
        theirs = await vllm_beam_search(self.p.llm, self.tokenizer, prompt2, req.beam,
                                        f"verify-{case.name}-vllm",
                                        self.p.lora_request(adapter2))
        rerun = await self.rerun_beside(case, prompt2, req.beam)
        # The same on D, the whole prompt in D's own chunks; D's cache is left empty
        # again, as the cases expect it.
        await self.d.empty_prefix_cache()
        theirs_on_d = await vllm_beam_search(self.d.llm, self.tokenizer, prompt2, req.beam,
                                             f"verify-{case.name}-vllm-d",
                                             self.d.lora_request(adapter2))
        await self.d.empty_prefix_cache()
        ref = Reference(seed, prompt, req, colocated, list(on_d.outputs[0].token_ids), theirs,
                        rerun, theirs_on_d)
        self._references[case.name] = ref
        return ref

    async def rerun_beside(self, case: Case, prompt: list[int], beam: BeamParams
                            ) -> list[Beam]:
        """The colocated stage 2 on ``prompt`` run again on P while an unrelated request
        decodes there: every step's batch holds one sequence more, so the engine sums its
        floats in another order. The unrelated request is aborted when the rerun ends."""
        rng = random.Random(f"{case.name}/beside")
        other = [rng.choice(self.normal_ids) for _ in range(BESIDE_PROMPT_LEN)]
        params = Stage1Params(max_tokens=min(BESIDE_MAX_TOKENS,
                                             self.p.max_model_len - BESIDE_PROMPT_LEN - 1),
                              temperature=0.0, ignore_eos=True)
        decoding = asyncio.Event()

        async def beside() -> None:
            async for _ in self.p.stream_stage1(other, params, f"verify-{case.name}-beside",
                                                export=False):
                decoding.set()

        task = asyncio.create_task(beside())
        waiter = asyncio.create_task(decoding.wait())
        try:
            # The rerun starts once the other request decodes: it shares step 0 too.
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # it failed (or ended) before decoding: say why
            rerun = await run_beam_stage(self.p, prompt, beam, f"verify-{case.name}-rerun",
                                         adapter=case.stage2_adapter)
            if task.done():
                logger.warning("%s: the unrelated request ended before the reference's "
                               "rerun did; the rest of the rerun ran alone", case.name)
        finally:
            waiter.cancel()
            task.cancel()  # aborts the unrelated request in P
            (ended,) = await asyncio.gather(task, return_exceptions=True)
            if not isinstance(ended, (asyncio.CancelledError, type(None))):
                logger.warning("%s: the unrelated request failed: %r", case.name, ended)
        return rerun.beams

    async def run_case(self, case: Case, fault: str | None = None) -> CaseReport:
        """One case, against its references (computed on its first run), ``fault``
        injected into its handoff or moves. A fault that applies to the case must be
        counted by an engine as taking effect, or the case fails: a negative control
        that never ran proves nothing."""
        ref = await self.reference(case)
        before = self._faults_injected()
        report = await self._run_case(case, ref, fault)
        if fault is not None:
            report.faults_injected = await self._faults_injected_since(
                before, wait_s=FAULT_COUNT_WAIT_S if report.fault_applies else 0.0)
            if report.fault_applies and not report.refused and not report.faults_injected:
                report.failures.append(f"fault {fault!r} applies to this parent but no "
                                       "engine counted it as injected")
        return report

    def _faults_injected(self) -> int:
        return sum(e.counters.faults_injected for e in (self.p, self.p2, self.d)
                   if e is not None)

    async def _faults_injected_since(self, before: int, wait_s: float) -> int:
        """Faults counted since ``before``; waits up to ``wait_s`` for a first one (an
        engine's stats arrive with its next output)."""
        deadline = time.monotonic() + wait_s
        while self._faults_injected() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self._faults_injected() - before

    async def _run_case(self, case: Case, ref: Any, fault: str | None) -> CaseReport:
        if case.via_p:
            if self.p2 is None:
                raise RuntimeError(f"{case.name}: a move to another P needs a second P")
            await self.d.empty_prefix_cache()
            await self.p2.empty_prefix_cache()
            # An import fault goes into P''s import: its counts are what it corrupts.
            p_fault = fault if fault is not None and FAULTS[fault].side != "prefill" else None
            got, steps = await run_moved_via_p(self.p, self.p2, self.d, ref.request,
                                               case.move_at, case.then_at, p_fault)
            return compare(case, ref, got, d=self.d, tokenizer=self.tokenizer, fault=fault,
                           steps=steps)
        if case.move_at is not None:
            await self.d.empty_prefix_cache()
            got, move = await run_moved(self.p, self.d, ref.request, case.move_at)
            return compare(case, ref, got, d=self.d, tokenizer=self.tokenizer, fault=fault,
                           move=move)
        if case.d_state == "warm":
            # D ran this stage 1 itself (the reference): it holds the parent's full blocks.
            await self.d.generate(ref.prompt, stage1_sampling(ref.request.stage1),
                                  f"verify-{case.name}-warm")
        else:
            await self.d.empty_prefix_cache()
        pinned = await self._pin_chunk(case, ref, fault) if case.chunk_tokens else None
        try:
            got = await run_handoff(self.p, self.d, ref.request,
                                    fault=None if pinned and fault == "stale" else fault,
                                    d_adapter=case.import_adapter)
        except StageError as e:
            if not (case.adapters_differ and e.reason == "adapter"):
                raise
            return refused(case, ref, str(e), fault)
        finally:
            if pinned is not None:
                await self.p.release([pinned])
        if fault is not None and FAULTS[fault].side == "prefill":
            await self.p.empty_prefix_cache()  # P's cache holds the overwritten blocks
        report = compare(case, ref, got, d=self.d, tokenizer=self.tokenizer, fault=fault)
        if pinned is not None:
            report.num_computed_tokens_p = got.stage1.num_computed_tokens
            b = self.p.block_size
            expected = len(ref.prompt) - case.chunk_tokens // b * b
            if got.stage1.num_computed_tokens != expected:
                report.failures.append(
                    f"P computed {got.stage1.num_computed_tokens} prompt tokens, not the "
                    f"{expected} after the pinned chunk's full blocks")
        return report

    async def _pin_chunk(self, case: Case, ref: Any, fault: str | None) -> str:
        """The prompt's first ``chunk_tokens`` pinned on P as a named chunk, computed
        apart (P's cache emptied of the references' blocks first); the ``stale`` fault
        overwrites its blocks before stage 1 reads them. Returns its name."""
        await self.p.empty_prefix_cache()
        name = f"chunk-verify-0-{case.name}"
        await self.p.run_stage1(ref.prompt[:case.chunk_tokens], Stage1Params(max_tokens=1),
                                name, export=False, hold=PINNED,
                                fault="stale" if fault == "stale" else None,
                                adapter=case.adapter)
        if fault == "stale":
            await self.p.run_one_step()  # P's worker overwrites it before stage 1 reads
        return name

    async def run(self, cases: list[Case], *, model_dir: str, progress: Any = None,
                  fault: str | None = None) -> HarnessReport:
        """Every case in turn (``progress(case_report)`` after each), then the pools,
        which must be clean."""
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
            noise_factor=NOISE_FACTOR,
            noise_ceiling=NOISE_CEILING,
            cases=reports,
            pools_clean=all(pool.is_clean for pool in pools.values()),
            pool_details={name: asdict(pool) for name, pool in pools.items()},
            elapsed_s=time.perf_counter() - t0,
            fault=fault,
        )

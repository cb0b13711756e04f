"""One two-stage request in each of the benchmark's modes, on one P+D pair, with its
cache state stated and a cold handoff checked.

Workload (generative recommendation): a ~500-token prompt, stage 1 sampling ~200 tokens
(until ``</think>`` or max_tokens), suffix ``</think>\\n<|sid_begin|>``, stage 2 beam search
(width 32, 3 tokens). Modes, each running its own stage 1 on P:

- ``text_roundtrip`` (A): stage 2 is a brand-new text request on D: prompt text + thinking
  text + suffix re-tokenised, D's prefix cache emptied first (nothing reused).
- ``colocated`` (B): stage 2 on P from token ids, stage 1's KV reused by the prefix cache.
- ``handoff`` (C): this project: P exports, D imports over NIXL, D computes the tail.
- ``vllm_beam_search`` (D): vLLM's own beam search on P over the same continuation prompt.

Engines run in this process (no gRPC) so the figures are the engines' own. Stage-2 times:
the first beam step (for C it includes the NIXL READ) and the whole beam search.

A request run ``alone`` empties both engines' prefix caches first, so no mode runs on
another's blocks. A ``cold`` handoff (D's cache empty) must read the whole parent,
checked against the parent's blocks x bytes per block (else :class:`BenchError`); a
``warm`` one runs with D holding the prompt's blocks (tokens read vs found on D).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from typing import Any

from connector.handoff import ImportRequest
from decode_engine.engine import run_beam_stage
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.builtin.generate import _WORDS
from kvhandoff.builtin.tokens import DEFAULT_SUFFIX_TEXT
from kvhandoff.types import BeamParams, Stage1Params
from tools.bench.types import BenchConfig, BenchError, Sample
from tools.pipeline import TwoStageRequest, stage2_prompt


def make_prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens of random words, the same for a seed."""
    rng = random.Random(seed)
    words = list(_WORDS)
    out = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(" ".join(rng.choice(words) for _ in range(64)),
                                    add_special_tokens=False)
        out.append(ids[:length])
    return out


def rotated(modes: tuple[str, ...], i: int) -> tuple[str, ...]:
    """The modes in the order prompt ``i`` runs them (each mode first once per len(modes))."""
    k = i % len(modes)
    return modes[k:] + modes[:k]


class Bench:
    """The modes on ``pair`` (a ``tools.local.local_pair``) with ``cfg``'s stage 1 and
    beam search. Request ids are unique per Bench (``new_id``)."""

    def __init__(self, pair: Any, cfg: BenchConfig):
        self.pair, self.cfg = pair, cfg
        self.p, self.d = pair.p, pair.d
        self.tok = pair.tokenizer
        self.suffix_text = DEFAULT_SUFFIX_TEXT
        self.suffix_ids = pair.default_suffix_ids
        self.beam = BeamParams(beam_width=cfg.beam_width, max_tokens=cfg.beam_tokens)
        self._n = 0

    def new_id(self, tag: str) -> str:
        """A request id no other request of this Bench has."""
        self._n += 1
        return f"bench-{tag}-{self._n}"

    def _stage1_params(self, seed: int, max_tokens: int | None = None) -> Stage1Params:
        return Stage1Params(max_tokens=max_tokens or self.cfg.stage1_tokens, temperature=1.0,
                            seed=seed, stop_token_ids=tuple(
                                t for t in (self.pair.think_end_id,) if t is not None))

    def request(self, prompt: list[int], seed: int, max_tokens: int | None = None,
                beam: BeamParams | None = None) -> TwoStageRequest:
        """The two-stage request every mode runs: seeded stage 1 (``max_tokens``, default
        the config's) until ``</think>``, the default suffix, ``beam`` (default the
        config's)."""
        return TwoStageRequest(request_id=self.new_id("req"), prompt_token_ids=prompt,
                               suffix_token_ids=self.suffix_ids,
                               stage1=self._stage1_params(seed, max_tokens),
                               beam=beam or self.beam, think_end_id=self.pair.think_end_id)

    async def empty_caches(self) -> None:
        await self.p.empty_prefix_cache()
        await self.d.empty_prefix_cache()

    async def one(self, mode: str, prompt: list[int], seed: int,
                  stage1_tokens: int | None = None, *, d_cache: str = "cold",
                  beam: BeamParams | None = None, alone: bool = True) -> Sample:
        """One request of ``mode``. ``alone``: nothing else runs (the counters' deltas are
        this request's; a cold handoff is checked): both engines' prefix caches are
        emptied first (for ``d_cache="cold"``), and D's again before a text round trip's
        stage 2. Not alone, the caller empties them before the batch."""
        beam = beam or self.beam
        req = self.request(prompt, seed, stage1_tokens, beam)
        if alone and d_cache == "cold":
            await self.empty_caches()
        before = {"p": dataclasses.replace(self.p.counters),
                  "d": dataclasses.replace(self.d.counters)}
        t0 = time.perf_counter()
        stage1 = await self.p.run_stage1(prompt, req.stage1, self.new_id("s1"),
                                         export=mode == "handoff",
                                         target=self.pair.d.handoff_target)
        parent = prompt + stage1.token_ids
        prompt2, _ = stage2_prompt(req, stage1)
        # Tokens the stage-2 engine computed, from its own iteration stats (exact when
        # requests run one at a time).
        engine2 = self.d if mode in ("handoff", "text_roundtrip") else self.p
        computed0 = engine2.counters.prompt_tokens_computed
        extra: dict[str, Any] = {}
        if mode == "handoff":
            s2 = await self.d.run_stage2(
                prompt2, beam, self.new_id("c2"),
                handoff=ImportRequest.for_beams(stage1.handoff_params, beam))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
            extra = dict(d_cache=d_cache, tokens_read=s2.num_imported_tokens,
                         block_size=self.d.block_size,
                         tokens_found=(len(prompt2) - s2.num_imported_tokens
                                       - s2.num_computed_tokens_first_step),
                         kv_bytes_per_block=(s2.num_imported_bytes // s2.num_imported_blocks
                                             if s2.num_imported_blocks else 0))
        elif mode == "colocated":
            s2 = await run_beam_stage(self.p, prompt2, beam, self.new_id("b2"))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        elif mode == "text_roundtrip":
            text = self.tok.decode(parent, skip_special_tokens=False) + self.suffix_text
            ids = self.tok.encode(text, add_special_tokens=False)
            if alone:
                await self.d.empty_prefix_cache()
            s2 = await run_beam_stage(self.d, ids, beam, self.new_id("a2"))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        else:
            assert mode == "vllm_beam_search"
            # vLLM's beam search reports nothing until the end: its first step is timed
            # as a 1-token search on the same prompt (same cache state as B's first step);
            # the full search then runs with that step's blocks cached (in its favour).
            t1 = time.perf_counter()
            await vllm_beam_search(self.p.llm, self.tok, prompt2,
                                   BeamParams(beam_width=beam.beam_width, max_tokens=1),
                                   self.new_id("d1"))
            first_ms = (time.perf_counter() - t1) * 1e3
            t2 = time.perf_counter()
            full = await vllm_beam_search(self.p.llm, self.tok, prompt2, beam, self.new_id("d2"))
            total_ms = (time.perf_counter() - t2) * 1e3
            beams = [type(b)(token_ids=b.token_ids[len(prompt2):]
                             if len(b.token_ids) > len(prompt2) else b.token_ids,
                             cum_logprob=b.cum_logprob, finish_reason=b.finish_reason)
                     for b in full]
        end_ms = (time.perf_counter() - t0) * 1e3
        computed = engine2.counters.prompt_tokens_computed - computed0
        first_computed = None if mode == "vllm_beam_search" else s2.num_computed_tokens_first_step
        sample = Sample(mode, len(stage1.token_ids), len(parent), first_ms, total_ms, end_ms,
                        computed, beams=[list(b.token_ids) for b in beams],
                        computed_first_step=first_computed,
                        suffix_tokens=len(prompt2) - len(parent),
                        logprobs=[b.cum_logprob for b in beams], stage2_prompt=prompt2, **extra)
        if alone:
            # The engines' stats follow a request's outputs by a step: wait for the READ's.
            deadline = time.perf_counter() + 2.0
            while (mode == "handoff" and sample.tokens_read and time.perf_counter() < deadline
                   and self.d.counters.transfers == before["d"].transfers):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            after = {"p": self.p.counters, "d": self.d.counters}
            sample.prefix_cache = {
                k: (after[k].prefix_cache_hits - before[k].prefix_cache_hits,
                    after[k].prefix_cache_queries - before[k].prefix_cache_queries)
                for k in after}
            c0, c1 = before["d"], after["d"]
            if mode == "handoff" and c1.transfers > c0.transfers:
                sample.kv_bytes = c1.transfer_bytes - c0.transfer_bytes
                sample.transfer_ms = (c1.transfer_s - c0.transfer_s) * 1e3
                sample.descriptors = c1.transfer_descriptors - c0.transfer_descriptors
            if mode == "handoff" and d_cache == "cold":
                self._check_cold(sample)
        return sample

    def _check_cold(self, s: Sample) -> None:
        """A cold import reads the whole parent, all its computed tokens (the last sampled
        token has no KV yet) in whole blocks, finds nothing on D, and NIXL moved exactly
        those blocks: otherwise the sample is not what it is reported as."""
        num_blocks = -(-(s.parent_tokens - 1) // self.d.block_size)
        expected = num_blocks * s.kv_bytes_per_block
        if (s.tokens_found or s.tokens_read != s.parent_tokens - 1 or not expected
                or s.kv_bytes != expected):
            raise BenchError(
                f"cold handoff of a {s.parent_tokens}-token parent: read {s.tokens_read} "
                f"tokens, found {s.tokens_found} on D, NIXL moved {s.kv_bytes} bytes; "
                f"expected {s.parent_tokens - 1} tokens read, none found, {num_blocks} "
                f"blocks x {s.kv_bytes_per_block} bytes = {expected}")

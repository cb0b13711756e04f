"""``kvhandoff bench``: what the handoff buys, against what a user would do instead, in one
run on one machine.

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

Cache state, stated per sample: one request at a time, both engines' prefix caches are
emptied before every sample and the order of the modes is rotated per prompt, so no mode
runs on another's blocks. The headline handoff is ``cold`` (D's cache empty: the import
reads the whole parent, checked against the parent's blocks x bytes per block); a
``warm`` handoff follows on the same prompt, with D holding the prompt's blocks (tokens
read vs found on D, bytes saved). Also measured: the stage-2 floor (the import step plus
T-1 engine steps decoding W sequences of the parent's length, from vLLM's iteration
stats) for W x T, the import step's pieces per parent length, throughput at concurrency
(handoff vs colocated, caches emptied before each batch, distinct prompts), and the
CPU the engines use while P holds an export nobody reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from connector.handoff import BEAM_KEY, ImportRequest
from decode_engine.beam import vllm_beam_search
from decode_engine.engine import run_beam_stage
from kvhandoff.model import _WORDS, DEFAULT_SUFFIX_TEXT
from kvhandoff.types import BeamParams, Stage1Params
from tools.bench.report import (
    MODES,
    agreement,
    concurrency_row,
    floor_row,
    format_report,
    plot,
    summarize,
    summarize_warm,
)
from tools.local import local_pair
from tools.bench.nixl_probe import measure_descriptor_rate, measure_transfer
from tools.pipeline import TwoStageRequest, stage2_prompt
from tools.bench.router_overhead import measure_router_overhead, measure_router_overhead_on_cluster


@dataclass
class BenchConfig:
    model: str | None = "bench"
    prompt_tokens: int = 500
    stage1_tokens: int = 200
    beam_width: int = 32
    beam_tokens: int = 3
    requests: int = 8
    concurrency: tuple[int, ...] = (1, 4, 16)
    #: Modes run at concurrency above 1 (the slow references are measured at 1).
    concurrent_modes: tuple[str, ...] = ("colocated", "handoff")
    sweep: tuple[int, ...] = (256, 1024, 2048, 4096)
    sweep_repeats: int = 3
    #: Stage-2 floor grid: beam widths x beam tokens, ``floor_repeats`` samples each.
    floor_widths: tuple[int, ...] = (4, 16, 32)
    floor_tokens: tuple[int, ...] = (3, 8)
    floor_repeats: int = 2
    #: Seconds over which the engines' CPU is measured idle and holding an export.
    idle_s: float = 10.0
    seed: int = 0
    nixl_sizes_mib: tuple[int, ...] = (32, 128, 512)
    #: Requests per concurrency level = level x rounds.
    rounds: int = 2
    #: Requests sent both through the router and as direct engine calls (0: skip).
    router_requests: int = 8

    @classmethod
    def quick(cls, **kw: Any) -> BenchConfig:
        base = dict(requests=2, stage1_tokens=64, concurrency=(1, 4), sweep=(256, 1024),
                    floor_repeats=1, nixl_sizes_mib=(32,), rounds=1, router_requests=3)
        return cls(**{**base, **kw})


@dataclass
class Sample:
    """One two-stage request in one mode."""

    mode: str
    stage1_tokens: int
    parent_tokens: int
    stage2_first_beam_ms: float
    stage2_total_ms: float
    end_to_end_ms: float
    computed_tokens_d: int
    #: Bytes NIXL read for this request (its telemetry), and in how many descriptors.
    kv_bytes: int = 0
    transfer_ms: float | None = None
    descriptors: int = 0
    beams: list[list[int]] = field(default_factory=list)
    #: Tokens computed for the first beam step (output-reported; None for vLLM's search).
    computed_first_step: int | None = None
    suffix_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    #: Handoff only: D's prefix cache before the import ("cold": emptied; "warm": it
    #: holds the prompt), and the import's prompt tokens read from P vs found on D.
    d_cache: str | None = None
    tokens_read: int = 0
    tokens_found: int = 0
    kv_bytes_per_block: int = 0
    block_size: int = 1
    #: Prefix-cache (hits, queried tokens) during the sample, per engine ("p", "d").
    prefix_cache: dict[str, tuple[int, int]] = field(default_factory=dict)
    stage2_prompt: list[int] = field(default_factory=list, repr=False)


class BenchError(RuntimeError):
    """A measurement that does not describe what it claims (raised, never reported)."""


def _prompts(tokenizer: Any, n: int, length: int, seed: int) -> list[list[int]]:
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


def _engine_processes(engine: Any) -> list[Any]:
    """An engine's engine-core process(es) and their children (its worker)."""
    import psutil

    manager = engine.llm.engine_core.resources.engine_manager
    cores = [psutil.Process(p.pid) for p in manager.processes]
    return cores + [c for core in cores for c in core.children(recursive=True)]


def _cpu_s(processes: list[Any]) -> float:
    total = 0.0
    for proc in processes:
        with contextlib.suppress(Exception):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


class Bench:
    def __init__(self, pair: Any, cfg: BenchConfig):
        self.pair, self.cfg = pair, cfg
        self.p, self.d = pair.p, pair.d
        self.tok = pair.tokenizer
        self.suffix_text = DEFAULT_SUFFIX_TEXT
        self.suffix_ids = pair.default_suffix_ids
        self.beam = BeamParams(beam_width=cfg.beam_width, max_tokens=cfg.beam_tokens)
        self._n = 0

    def _rid(self, mode: str) -> str:
        self._n += 1
        return f"bench-{mode}-{self._n}"

    def _stage1_params(self, seed: int, max_tokens: int | None = None) -> Stage1Params:
        return Stage1Params(max_tokens=max_tokens or self.cfg.stage1_tokens, temperature=1.0,
                            seed=seed, stop_token_ids=tuple(
                                t for t in (self.pair.think_end_id,) if t is not None))

    def _request(self, prompt: list[int], seed: int, max_tokens: int | None = None,
                 beam: BeamParams | None = None):
        return TwoStageRequest(request_id=self._rid("req"), prompt_token_ids=prompt,
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
        req = self._request(prompt, seed, stage1_tokens, beam)
        if alone and d_cache == "cold":
            await self.empty_caches()
        before = {"p": dataclasses.replace(self.p.counters),
                  "d": dataclasses.replace(self.d.counters)}
        t0 = time.perf_counter()
        stage1 = await self.p.run_stage1(prompt, req.stage1, self._rid("s1"),
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
                prompt2, beam, self._rid("c2"),
                handoff=ImportRequest.for_beams(stage1.handoff_params, beam))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
            extra = dict(d_cache=d_cache, tokens_read=s2.num_imported_tokens,
                         block_size=self.d.block_size,
                         tokens_found=(len(prompt2) - s2.num_imported_tokens
                                       - s2.num_computed_tokens_first_step),
                         kv_bytes_per_block=(s2.num_imported_bytes // s2.num_imported_blocks
                                             if s2.num_imported_blocks else 0))
        elif mode == "colocated":
            s2 = await run_beam_stage(self.p, prompt2, beam, self._rid("b2"))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        elif mode == "text_roundtrip":
            text = self.tok.decode(parent, skip_special_tokens=False) + self.suffix_text
            ids = self.tok.encode(text, add_special_tokens=False)
            if alone:
                await self.d.empty_prefix_cache()
            s2 = await run_beam_stage(self.d, ids, beam, self._rid("a2"))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        else:
            assert mode == "vllm_beam_search"
            # vLLM's beam search reports nothing until the end: its first step is timed
            # as a 1-token search on the same prompt (same cache state as B's first step);
            # the full search then runs with that step's blocks cached (in its favour).
            t1 = time.perf_counter()
            await vllm_beam_search(self.p.llm, self.tok, prompt2,
                                   BeamParams(beam_width=beam.beam_width, max_tokens=1),
                                   self._rid("d1"))
            first_ms = (time.perf_counter() - t1) * 1e3
            t2 = time.perf_counter()
            full = await vllm_beam_search(self.p.llm, self.tok, prompt2, beam, self._rid("d2"))
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

    async def sweep_point(self, parent_tokens: int, seed: int) -> dict[str, Any]:
        """A cold handoff of a ``parent_tokens`` parent: its READ, its import step and the
        step's pieces, against the prefill it replaces on D."""
        from vllm import SamplingParams

        prompt = _prompts(self.tok, 1, parent_tokens - 1, seed)[0]
        # Cold handoffs of this parent (a different stage-1 token each); the median one
        # by READ time is reported, with the median import step.
        runs = [await self.one("handoff", prompt, seed + k, stage1_tokens=1,
                               beam=BeamParams(beam_width=self.cfg.beam_width, max_tokens=2))
                for k in range(self.cfg.sweep_repeats)]
        s = sorted(runs, key=lambda r: r.transfer_ms or 0.0)[len(runs) // 2]
        import_step_ms = statistics.median(r.stage2_first_beam_ms for r in runs)
        # The tail's forward pass at this context: D now holds the parent's full blocks,
        # so the same stage-2 prompt computes only what follows them.
        computed0 = self.d.counters.prompt_tokens_computed
        t0 = time.perf_counter()
        await self.d.generate(s.stage2_prompt, SamplingParams(max_tokens=1, temperature=0.0),
                              self._rid("tail"))
        tail_ms = (time.perf_counter() - t0) * 1e3
        await asyncio.sleep(0.05)
        tail_tokens = self.d.counters.prompt_tokens_computed - computed0
        await self.d.empty_prefix_cache()
        t0 = time.perf_counter()
        await self.d.generate(prompt + [0], SamplingParams(max_tokens=1, temperature=0.0),
                              self._rid("prefill"))
        prefill_ms = (time.perf_counter() - t0) * 1e3
        read_ms = s.transfer_ms or 0.0
        return {"parent_tokens": s.parent_tokens, "kv_bytes": s.kv_bytes,
                "descriptors": s.descriptors,
                "computed_tokens_d_import_step": s.computed_first_step,
                "suffix_tokens": s.suffix_tokens,
                "transfer_ms": None if s.transfer_ms is None else round(s.transfer_ms, 3),
                "read_gbps": round(s.kv_bytes / read_ms / 1e6, 3) if read_ms else None,
                "repeats": len(runs), "import_step_ms": round(import_step_ms, 3),
                "tail_forward_ms": round(tail_ms, 3), "tail_forward_tokens": tail_tokens,
                "import_step_budget_ms": round(read_ms + tail_ms + 10.0, 3),
                "import_step_within_budget": import_step_ms <= read_ms + tail_ms + 10.0,
                "prefill_ms": round(prefill_ms, 3)}

    async def decode_step_ms(self, prompt: list[int], width: int, steps: int,
                             logprobs: int | None = None) -> float:
        """Median duration of an engine step decoding ``width`` sequences of ``prompt``'s
        length on D, from vLLM's iteration stats (steps in which all of them decoded)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                                logprobs=logprobs, detokenize=False)
        first = self.d.counters.iterations
        await asyncio.gather(*(self.d.generate(prompt, params, self._rid(f"floor{i}"))
                               for i in range(width)))
        await asyncio.sleep(0.1)
        step_s = [statistics.median(it.inter_token_s)
                  for it in self.d.counters.recent_iterations
                  if it.index > first and len(it.inter_token_s) == width]
        if not step_s:
            raise BenchError(f"no engine step decoded all {width} sequences together")
        return statistics.median(step_s) * 1e3

    async def new_requests_step_ms(self, prompt: list[int], width: int) -> float:
        """Wall time of a beam step without its block copies: ``width`` new one-token
        requests scheduled together (as a beam step's are), each the block-aligned part of
        ``prompt`` (cached on D) plus one different token, so each computes one token,
        returning the beam search's ``2 x width`` logprobs."""
        from vllm import SamplingParams

        aligned = prompt[:(len(prompt) - 1) // self.d.block_size * self.d.block_size]
        gang = {"kv_transfer_params": {BEAM_KEY: {"step_group": self._rid("gang"),
                                                  "step_size": width}}}
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width,
                                detokenize=False, extra_args=gang)
        t0 = time.perf_counter()
        await asyncio.gather(*(self.d.generate(aligned + [10 + i], params, self._rid("new"))
                               for i in range(width)))
        return (time.perf_counter() - t0) * 1e3

    async def stage2_floor(self, prompt: list[int], width: int, tokens: int,
                           seed: int) -> dict[str, Any]:
        """Our stage 2 (cold handoff, ``width`` beams, ``tokens`` tokens) against its
        floor: the import step plus ``tokens - 1`` steps decoding ``width`` sequences.
        The gap's parts: the same decode steps returning the beam search's logprobs, and
        a round of ``width`` new one-token requests (what a beam step submits)."""
        s = await self.one("handoff", prompt, seed,
                           beam=BeamParams(beam_width=width, max_tokens=tokens))
        step_ms = await self.decode_step_ms(s.stage2_prompt, width, max(tokens, 3))
        with_logprobs_ms = await self.decode_step_ms(s.stage2_prompt, width, max(tokens, 3),
                                                     logprobs=2 * width)
        new_ms = statistics.median([await self.new_requests_step_ms(s.stage2_prompt, width)
                                    for _ in range(3)])
        floor_ms = s.stage2_first_beam_ms + (tokens - 1) * step_ms
        return {"beam_width": width, "beam_tokens": tokens, "parent_tokens": s.parent_tokens,
                "stage2_total_ms": round(s.stage2_total_ms, 3),
                "import_step_ms": round(s.stage2_first_beam_ms, 3),
                "decode_step_ms": round(step_ms, 3),
                "decode_step_logprobs_ms": round(with_logprobs_ms, 3),
                "new_requests_step_ms": round(new_ms, 3),
                "beam_step_ms": round((s.stage2_total_ms - s.stage2_first_beam_ms)
                                      / max(1, tokens - 1), 3),
                "floor_ms": round(floor_ms, 3),
                "ratio": round(s.stage2_total_ms / floor_ms, 3)}

    async def idle_cpu(self, seconds: float) -> dict[str, Any]:
        """CPU (percent of one core) of P's processes (engine core and worker) and of both
        engines' over ``seconds`` idle, then over ``seconds`` while P holds an export D
        has not read (then D reads it)."""

        p_procs = _engine_processes(self.p)
        all_procs = p_procs + _engine_processes(self.d)

        async def measure() -> tuple[float, float]:
            await asyncio.sleep(1.0)  # past the last request's steps
            p0, a0, t0 = _cpu_s(p_procs), _cpu_s(all_procs), time.perf_counter()
            await asyncio.sleep(seconds)
            elapsed = time.perf_counter() - t0
            return (round(100 * (_cpu_s(p_procs) - p0) / elapsed, 1),
                    round(100 * (_cpu_s(all_procs) - a0) / elapsed, 1))

        idle = await measure()
        prompt = _prompts(self.tok, 1, 64, 5)[0]
        req = self._request(prompt, 1, 4)
        stage1 = await self.p.run_stage1(prompt, req.stage1, self._rid("hold"), export=True,
                                         target=self.d.handoff_target)
        holding = await measure()
        prompt2, _ = stage2_prompt(req, stage1)
        await self.d.run_stage2(prompt2, self.beam, self._rid("hold2"),
                                handoff=ImportRequest.for_beams(stage1.handoff_params, self.beam))
        return {"seconds": seconds, "p_cpu_pct_idle": idle[0],
                "p_cpu_pct_holding_export": holding[0], "engines_cpu_pct_idle": idle[1],
                "engines_cpu_pct_holding_export": holding[1]}


async def _at_concurrency(bench: Bench, cfg: BenchConfig, mode: str, c: int) -> dict[str, Any]:
    """``c x rounds`` requests of one mode, ``c`` at a time, on emptied caches and
    distinct prompts (no request finds another's blocks)."""
    prompts = _prompts(bench.tok, c * cfg.rounds, cfg.prompt_tokens, cfg.seed + 1000 * c)
    sem = asyncio.Semaphore(c)
    await bench.empty_caches()

    async def go(i: int, prompt: list[int]) -> Sample:
        async with sem:
            return await bench.one(mode, prompt, cfg.seed + i, alone=False)

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(go(i, p) for i, p in enumerate(prompts)))
    return concurrency_row(mode, c, samples, wall_s=time.perf_counter() - t0)


async def run_bench(cfg: BenchConfig, progress: Any = None, pair: Any = None,
                    checkpoint: Any = None) -> dict[str, Any]:
    """Run every measurement; on ``pair`` if given (tests), else on a new P+D pair.
    ``checkpoint(result)`` is called after each phase with what is measured so far."""

    def tick(label: str) -> None:
        if progress is not None:
            progress(label)

    def save() -> None:
        if checkpoint is not None:
            checkpoint(result)

    max_parent = max([*cfg.sweep, cfg.prompt_tokens + cfg.stage1_tokens])
    max_len = max_parent + 64
    max_len += -max_len % 32
    pool = 2 << 30
    common = dict(max_model_len=max_len, kv_cache_memory_bytes=pool, lease_s=60,
                  max_num_seqs=max(64, cfg.beam_width * max(cfg.concurrency),
                                   max(cfg.floor_widths, default=1)),
                  max_logprobs=max(64, 2 * cfg.beam_width, *(2 * w for w in cfg.floor_widths)))
    result: dict[str, Any] = {"config": {**asdict(cfg)}, "modes": {}, "concurrency": [],
                              "sweep": [], "floor": [], "transfer": {}}
    t_start = time.perf_counter()
    started = contextlib.nullcontext(pair) if pair is not None else local_pair(cfg.model, **common)
    async with started as pair:
        bench = Bench(pair, cfg)
        prompts = _prompts(bench.tok, cfg.requests, cfg.prompt_tokens, cfg.seed)
        # Warm every path once (first NIXL handshake, compile of logprobs gathers).
        for mode in MODES:
            await bench.one(mode, prompts[0][:64], 1, stage1_tokens=4)
        tick("warm-up")
        by_mode: dict[str, list[Sample]] = {m: [] for m in MODES}
        warm: list[Sample] = []
        for i, prompt in enumerate(prompts):
            for mode in rotated(MODES, i):
                by_mode[mode].append(await bench.one(mode, prompt, cfg.seed + i))
                if mode == "handoff":
                    # D now holds the prompt's blocks: the same prompt, another stage 1.
                    warm.append(await bench.one(mode, prompt, cfg.seed + i + 500,
                                                d_cache="warm"))
                tick(f"{mode} {i + 1}/{len(prompts)}")
        result["modes"] = {mode: {**summarize(by_mode[mode]), **agreement(by_mode, mode)}
                           for mode in MODES}
        result["handoff_warm"] = summarize_warm(warm)
        save()
        if 1 in cfg.concurrency:
            result["concurrency"] += [concurrency_row(m, 1, by_mode[m]) for m in MODES]
        for c in (c for c in cfg.concurrency if c > 1):
            for mode in cfg.concurrent_modes:
                result["concurrency"].append(await _at_concurrency(bench, cfg, mode, c))
                tick(f"concurrency {c} {mode}")
                save()
        floor_prompt = _prompts(bench.tok, 1, cfg.prompt_tokens, cfg.seed + 77)[0]
        for w in cfg.floor_widths:
            for t in cfg.floor_tokens:
                rows = [await bench.stage2_floor(floor_prompt, w, t, cfg.seed + 80 + k)
                        for k in range(cfg.floor_repeats)]
                result["floor"].append(floor_row(rows))
                tick(f"floor W={w} T={t}")
                save()
        for i, n in enumerate(cfg.sweep):
            result["sweep"].append(await bench.sweep_point(n, cfg.seed + 7 + i))
            tick(f"sweep {n}")
            save()
        if cfg.idle_s:
            result["idle_cpu"] = await bench.idle_cpu(cfg.idle_s)
            tick("idle CPU")
            save()
        if cfg.router_requests:
            result["router"] = await measure_router_overhead(
                pair, _prompts(bench.tok, cfg.router_requests, cfg.prompt_tokens, cfg.seed + 99),
                stage1_tokens=cfg.stage1_tokens, beam=bench.beam, progress=tick)
            save()
    # Raw NIXL for the bytes each sweep point read, and the configured sizes.
    sizes = sorted({*(row["kv_bytes"] for row in result["sweep"] if row["kv_bytes"]),
                    *(m << 20 for m in cfg.nixl_sizes_mib)})
    result["transfer"] = measure_transfer(sizes)
    raw = {row["bytes"]: row["nixl_gbps"] for row in result["transfer"]["sizes"]}
    for row in result["sweep"]:
        if row["read_gbps"] and row["kv_bytes"] in raw:
            row["raw_nixl_gbps"] = raw[row["kv_bytes"]]
            row["read_vs_raw"] = round(row["read_gbps"] / raw[row["kv_bytes"]], 3)
            # The same bytes in as many unmergeable descriptors as the engine posted.
            row["raw_same_descriptors_gbps"] = measure_descriptor_rate(
                row["kv_bytes"], max(1, row["descriptors"]))
    tick("raw transfer")
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return result


def main_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.http_two_calls:
        from tools.bench.http_two_calls import format_two_calls, measure_two_calls_over_http

        kw = {"requests": args.requests or 8}
        if args.concurrency:
            kw["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
        for name in ("prompt_tokens", "stage1_tokens", "beam_width", "seed"):
            if getattr(args, name) is not None:
                kw[name] = getattr(args, name)
        result = measure_two_calls_over_http(args.model, **kw)
        print(format_two_calls(result))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    if args.hosts_link:
        from tools.bench import hosts as bench_hosts

        result = bench_hosts.measure_link()
        print(bench_hosts.format_link(result))
        first = bench_hosts.measure_first_handoff(args.model, Path("out") / "bench-hosts")
        print(bench_hosts.format_first_handoff(first))
        result["first_handoff"] = first
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    if args.moves:
        from tools.bench.moves import format_moves, measure_moves

        kw = {"drain_requests": args.requests or 8}
        if args.seed is not None:
            kw["seed"] = args.seed
        result = measure_moves(args.model, **kw)
        print(format_moves(result))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    if args.router_only:
        result = {"router_cluster": measure_router_overhead_on_cluster(
            args.model, args.requests or 12)}
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0

    kw: dict[str, Any] = {"model": args.model or "bench"}
    for name in ("prompt_tokens", "stage1_tokens", "beam_width", "beam_tokens", "requests",
                 "seed"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.concurrency:
        kw["concurrency"] = tuple(int(x) for x in args.concurrency.split(","))
    if args.sweep:
        kw["sweep"] = tuple(int(x) for x in args.sweep.split(","))
    cfg = BenchConfig.quick(**kw) if args.quick else BenchConfig(**kw)
    levels = sum(1 for c in cfg.concurrency if c > 1)
    steps = (1 + cfg.requests * len(MODES) + levels * len(cfg.concurrent_modes)
             + len(cfg.floor_widths) * len(cfg.floor_tokens) + len(cfg.sweep)
             + bool(cfg.idle_s) + cfg.router_requests + 1)
    with tqdm(total=steps, desc="bench", unit="step") as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        def checkpoint(partial: dict[str, Any]) -> None:
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({**partial, "partial": True}, indent=1))

        result = asyncio.run(run_bench(cfg, progress, checkpoint=checkpoint))
    print(format_report(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    return 0

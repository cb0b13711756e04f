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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from connector.handoff import ImportRequest
from decode_engine.beam import vllm_beam_search
from decode_engine.engine import run_beam_stage
from kvhandoff.model import _WORDS, DEFAULT_SUFFIX_TEXT
from kvhandoff.types import BeamParams, Stage1Params
from tools.bench_report import (
    MODES,
    agreement,
    concurrency_row,
    format_report,
    plot,
    summarize,
)
from tools.local import local_pair
from tools.nixl_probe import measure_transfer
from tools.pipeline import TwoStageRequest, stage2_prompt
from tools.router_overhead import measure_router_overhead, measure_router_overhead_on_cluster


@dataclass
class BenchConfig:
    model: str | None = "bench"
    prompt_tokens: int = 500
    stage1_tokens: int = 200
    beam_width: int = 32
    beam_tokens: int = 3
    requests: int = 8
    concurrency: tuple[int, ...] = (1, 4, 16)
    sweep: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    seed: int = 0
    nixl_sizes_mib: tuple[int, ...] = (32, 128, 512)
    #: Requests per concurrency level = level x rounds.
    rounds: int = 2
    #: Requests sent both through the router and as direct engine calls (0: skip).
    router_requests: int = 8

    @classmethod
    def quick(cls, **kw: Any) -> BenchConfig:
        base = dict(requests=2, stage1_tokens=64, concurrency=(1, 4), sweep=(256, 2048),
                    nixl_sizes_mib=(32, 128), rounds=1, router_requests=3)
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
    kv_bytes: int = 0
    transfer_ms: float | None = None
    beams: list[list[int]] = field(default_factory=list)
    #: Tokens computed for the first beam step (output-reported; None for vLLM's search).
    computed_first_step: int | None = None
    suffix_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)


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

    def _request(self, prompt: list[int], seed: int, max_tokens: int | None = None):
        return TwoStageRequest(request_id=self._rid("req"), prompt_token_ids=prompt,
                               suffix_token_ids=self.suffix_ids,
                               stage1=self._stage1_params(seed, max_tokens), beam=self.beam,
                               think_end_id=self.pair.think_end_id)

    async def one(self, mode: str, prompt: list[int], seed: int,
                  stage1_tokens: int | None = None) -> Sample:
        req = self._request(prompt, seed, stage1_tokens)
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
        kv_bytes, transfer_ms = 0, None
        if mode == "handoff":
            c = self.d.counters
            before = c.transfer_s, c.transfers
            s2 = await self.d.run_stage2(
                prompt2, self.beam, self._rid("c2"),
                handoff=ImportRequest.for_beams(stage1.handoff_params, self.beam))
            if c.transfers > before[1]:
                transfer_ms = (c.transfer_s - before[0]) * 1e3
            kv_bytes = s2.num_imported_bytes
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        elif mode == "colocated":
            s2 = await run_beam_stage(self.p, prompt2, self.beam, self._rid("b2"))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        elif mode == "text_roundtrip":
            text = self.tok.decode(parent, skip_special_tokens=False) + self.suffix_text
            ids = self.tok.encode(text, add_special_tokens=False)
            await self.d.llm.reset_prefix_cache()
            s2 = await run_beam_stage(self.d, ids, self.beam, self._rid("a2"))
            first_ms, total_ms, beams = s2.first_step_s * 1e3, s2.elapsed_s * 1e3, s2.beams
        else:
            assert mode == "vllm_beam_search"
            # vLLM's beam search reports nothing until the end: its first step is timed
            # as a 1-token search on the same prompt (same cache state as B's first step);
            # the full search then runs with that step's blocks cached (in its favour).
            t1 = time.perf_counter()
            await vllm_beam_search(self.p.llm, self.tok, prompt2,
                                   BeamParams(beam_width=self.beam.beam_width, max_tokens=1),
                                   self._rid("d1"))
            first_ms = (time.perf_counter() - t1) * 1e3
            t2 = time.perf_counter()
            full = await vllm_beam_search(self.p.llm, self.tok, prompt2, self.beam,
                                          self._rid("d2"))
            total_ms = (time.perf_counter() - t2) * 1e3
            beams = [type(b)(token_ids=b.token_ids[len(prompt2):]
                             if len(b.token_ids) > len(prompt2) else b.token_ids,
                             cum_logprob=b.cum_logprob, finish_reason=b.finish_reason)
                     for b in full]
        computed = engine2.counters.prompt_tokens_computed - computed0
        first_computed = None if mode == "vllm_beam_search" else s2.num_computed_tokens_first_step
        return Sample(mode, len(stage1.token_ids), len(parent), first_ms, total_ms,
                      (time.perf_counter() - t0) * 1e3, computed, kv_bytes, transfer_ms,
                      [list(b.token_ids) for b in beams], first_computed,
                      len(prompt2) - len(parent), [b.cum_logprob for b in beams])

    async def sweep_point(self, parent_tokens: int, seed: int) -> dict[str, Any]:
        """Transfer time of a ``parent_tokens`` parent vs the prefill it replaces on D."""
        from vllm import SamplingParams

        prompt = _prompts(self.tok, 1, parent_tokens - 1, seed)[0]
        s = await self.one("handoff", prompt, seed, stage1_tokens=1)
        await self.d.llm.reset_prefix_cache()
        t0 = time.perf_counter()
        await self.d.generate(prompt + [0], SamplingParams(max_tokens=1, temperature=0.0),
                              self._rid("prefill"))
        prefill_ms = (time.perf_counter() - t0) * 1e3
        return {"parent_tokens": s.parent_tokens, "kv_bytes": s.kv_bytes,
                "computed_tokens_d_import_step": s.computed_first_step,
                "transfer_ms": None if s.transfer_ms is None else round(s.transfer_ms, 3),
                "import_step_ms": round(s.stage2_first_beam_ms, 3),
                "prefill_ms": round(prefill_ms, 3)}


async def _at_concurrency(bench: Bench, cfg: BenchConfig, mode: str, c: int) -> dict[str, Any]:
    """``c x rounds`` requests of one mode, ``c`` at a time."""
    prompts = _prompts(bench.tok, c * cfg.rounds, cfg.prompt_tokens, cfg.seed + 1000 * c)
    sem = asyncio.Semaphore(c)

    async def go(i: int, prompt: list[int]) -> Sample:
        async with sem:
            return await bench.one(mode, prompt, cfg.seed + i)

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
                  max_num_seqs=max(64, cfg.beam_width * max(cfg.concurrency)),
                  max_logprobs=max(64, 2 * cfg.beam_width))
    result: dict[str, Any] = {"config": {**asdict(cfg)}, "modes": {}, "concurrency": [],
                              "sweep": [], "transfer": {}}
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
        for i, prompt in enumerate(prompts):
            for mode in MODES:
                by_mode[mode].append(await bench.one(mode, prompt, cfg.seed + i))
                tick(f"{mode} {i + 1}/{len(prompts)}")
        result["modes"] = {mode: {**summarize(by_mode[mode]), **agreement(by_mode, mode)}
                           for mode in MODES}
        save()
        if 1 in cfg.concurrency:
            result["concurrency"] += [concurrency_row(m, 1, by_mode[m]) for m in MODES]
        for c in (c for c in cfg.concurrency if c > 1):
            for mode in MODES:
                result["concurrency"].append(await _at_concurrency(bench, cfg, mode, c))
                tick(f"concurrency {c} {mode}")
                save()
        for i, n in enumerate(cfg.sweep):
            result["sweep"].append(await bench.sweep_point(n, cfg.seed + 7 + i))
            tick(f"sweep {n}")
            save()
        if cfg.router_requests:
            result["router"] = await measure_router_overhead(
                pair, _prompts(bench.tok, cfg.router_requests, cfg.prompt_tokens, cfg.seed + 99),
                stage1_tokens=cfg.stage1_tokens, beam=bench.beam, progress=tick)
            save()
    result["transfer"] = measure_transfer([m << 20 for m in cfg.nixl_sizes_mib])
    tick("raw transfer")
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    return result


def main_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

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
    steps = (1 + cfg.requests * len(MODES) + levels * len(MODES) + len(cfg.sweep)
             + cfg.router_requests + 1)
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

"""``kvhandoff bench --e2e --concurrency 1,4,8,32``: two-stage requests per second
through the router, against the colocated path and against vLLM alone.

- **handoff**: the router's default path: stage 1 on P, the parent's KV read by D over
  NIXL, stage 2 (our beam search) on D.
- **colocated**: the router's colocated path: both stages on P, no handoff.
- **vLLM alone**: what a deployment without kvhandoff runs on one engine: stage 1 with
  the router's sampling (positional: the same thinking), then stage 2 sent as a new
  request to vLLM's own ``beam_search`` (``decode_engine.vllm_peer.vllm_beam_search``) over
  prompt + thinking + suffix. Its prefix cache still holds the prompt from stage 1 (in
  vLLM's favour).

Order and cache state: P, D and the router run as processes (``tools.launch.
local_cluster``); ``WARM_UP`` requests of each router path first; then for each C,
increasing, the handoff run and the colocated run, each ``rounds x C`` requests (at least
``MIN_REQUESTS``) on fresh prompts (distinct per C and path: no request finds another's
blocks), C in flight at a time (a thread each, ``GenerateStream``). The cluster is then
stopped and one engine of the same model started in this process for vLLM alone, which
runs each C's handoff prompts and seeds, C at a time (``asyncio.gather`` under a
semaphore), after a warm-up of its own.

Per (path, C): QPS = requests / wall time; the first beam's latency, p50 / p99, from a
request's start to its answer (every path answers its W beams at once, so the first beam
is the answer); stage 1's first token p50 (router paths); answers that were recomputed
or did not run on the path asked (there must be none).

**Identity**: every handoff answer equals vLLM alone's on the same prompt and seed
(stage-1 tokens and the beams' ids in order exactly, cumulative logprobs within
``LOGPROB_BOUND``), and ``TWINS`` colocated answers per C are run by vLLM alone too
(untimed) and compared; any difference is listed and fails the bench
(``E2EResult.identical``); the largest logprob gap per path is reported.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.types import BeamParams, Stage1Params
from kvhandoff.v1 import common_pb2, router_pb2_grpc
from tools.bench.report import nearest_rank
from tools.client import make_request

CONCURRENCY = (1, 4, 8, 32)
#: Router-path requests per level at least (C=1 would otherwise be one request).
MIN_REQUESTS = 4
#: Requests of each router path before the first level (each engine's first steps).
WARM_UP = 2
#: Colocated answers per level that vLLM alone runs too, untimed, for the identity.
TWINS = 2
#: D's and P's KV pools (MiB) and D's sequences a step for the CLI's cluster: W=32 at
#: C=32 beside nothing else is about 2,400 blocks of the bench model's 768 KiB, 1,024
#: sequences.
POOL_MIB = 3072
MAX_NUM_SEQS = 1024
#: Answers' cumulative logprobs may differ by this much: the harness's bound for a case
#: whose measured noise is 1e-5 (``tools.harness.checks``: max(LOGPROB_TOLERANCE,
#: NOISE_FACTOR x noise)), ten times its floor. Under concurrency a request's steps
#: share their batch with others (a colocated stage 2 with other requests' stage 1 on
#: P), which rounds otherwise than vLLM alone's run: 1.0-1.2e-5 seen at C=4-32 on the
#: bench model, above the floor of 1e-5 that one request at a time keeps. The injected
#: faults shift them by 0.1 or more; token ids are compared exactly.
LOGPROB_BOUND = 1e-4


@dataclass(frozen=True)
class E2EConfig:
    concurrency: tuple[int, ...] = CONCURRENCY
    prompt_tokens: int = 500
    stage1_tokens: int = 64
    beam_width: int = 32
    beam_tokens: int = 3
    #: Requests per level and path: rounds x C (at least ``min_requests``).
    rounds: int = 2
    min_requests: int = MIN_REQUESTS
    seed: int = 0
    #: Negative controls only: a fault of connector.faults injected into every handoff
    #: request (the engines must run with --fault-injection); "": none.
    fault: str = ""

    def requests(self, c: int) -> int:
        return max(self.rounds * c, self.min_requests)

    @property
    def beam(self) -> BeamParams:
        return BeamParams(beam_width=self.beam_width, max_tokens=self.beam_tokens)


@dataclass
class Answer:
    """One two-stage request's answer and timings (seconds from its start)."""

    prompt: list[int]
    seed: int
    thinking: list[int]
    beams: list[tuple[list[int], float]]
    answer_s: float
    first_token_s: float | None = None
    #: Router paths: the path the stats name, and the recompute's reason ("" = none).
    path: str = ""
    recomputed: str = ""


@dataclass
class E2EResult:
    settings: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    #: The largest cumulative-logprob gap to vLLM alone's answers, by router path.
    logprob_gaps: dict[str, float] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not self.differences

    def as_dict(self) -> dict[str, Any]:
        return {**self.settings, "rows": self.rows, "differences": self.differences,
                "logprob_gaps": self.logprob_gaps, "logprob_bound": LOGPROB_BOUND,
                "identical": self.identical}


def prompts_for(cfg: E2EConfig, vocab: int, c: int, path: str) -> list[tuple[list[int], int]]:
    """A level's (prompt, seed) pairs: random ids from ``vocab`` (no special tokens),
    distinct for every (C, path) and the same for a config."""
    rng = random.Random(f"{cfg.seed}-{c}-{path}")
    return [([rng.randrange(10, vocab) for _ in range(cfg.prompt_tokens)],
             rng.randrange(1 << 30)) for _ in range(cfg.requests(c))]


def level_row(path: str, c: int, answers: list[Answer], wall_s: float,
              expect_path: str | None = None) -> dict[str, Any]:
    """A (path, C) row of the report from its answers."""
    ms = [a.answer_s * 1e3 for a in answers]
    first = [a.first_token_s * 1e3 for a in answers if a.first_token_s is not None]
    return {
        "path": path, "concurrency": c, "requests": len(answers),
        "wall_s": round(wall_s, 3), "qps": round(len(answers) / wall_s, 3),
        "first_beam_ms_p50": round(nearest_rank(ms, 0.5), 1),
        "first_beam_ms_p99": round(nearest_rank(ms, 0.99), 1),
        "stage1_first_token_ms_p50": round(statistics.median(first), 1) if first else None,
        "recomputed": sum(1 for a in answers if a.recomputed),
        "off_path": (sum(1 for a in answers if a.path != expect_path)
                     if expect_path is not None else 0),
    }


def logprob_gap(got: Answer, ref: Answer) -> float:
    """The largest difference of the two answers' beams' cumulative logprobs."""
    return max((abs(a - b) for (_, a), (_, b) in zip(got.beams, ref.beams)), default=0.0)


def differences(label: str, got: Answer, ref: Answer) -> list[str]:
    """What differs between two answers to one request (empty: identical): stage-1 and
    beam token ids exactly, cumulative logprobs within ``LOGPROB_BOUND``."""
    if got.thinking != ref.thinking:
        return [f"{label}: stage-1 tokens differ"]
    if [ids for ids, _ in got.beams] != [ids for ids, _ in ref.beams]:
        return [f"{label}: beams differ"]
    if (gap := logprob_gap(got, ref)) > LOGPROB_BOUND:
        return [f"{label}: cumulative logprobs differ by {gap:.2e}"]
    return []


# ---- the router paths -------------------------------------------------------------------
def _router_call(stub: Any, cfg: E2EConfig, prompt: list[int], seed: int, path: str,
                 request_id: str) -> Answer:
    req = make_request(prompt=prompt, max_tokens=cfg.stage1_tokens, seed=seed,
                       beam_width=cfg.beam_width, beam_tokens=cfg.beam_tokens, path=path,
                       request_id=request_id)
    if path == "handoff":
        req.fault = cfg.fault
    t0, first, result = time.perf_counter(), None, None
    for event in stub.GenerateStream(req, timeout=900):
        if event.HasField("stage1_tokens") and first is None:
            first = time.perf_counter() - t0
        elif event.HasField("result"):
            result = event.result
    if result is None:
        raise RuntimeError(f"{request_id}: the stream ended without a result")
    return Answer(prompt, seed, list(result.thinking_token_ids),
                  [(list(b.token_ids), b.cum_logprob) for b in result.beams],
                  time.perf_counter() - t0, first,
                  common_pb2.Path.Name(result.stats.path),
                  (result.stats.handoff_failure or "recomputed") if result.stats.recomputed
                  else "")


def run_router_level(stub: Any, cfg: E2EConfig, c: int, path: str,
                     work: list[tuple[list[int], int]]) -> tuple[dict[str, Any], list[Answer]]:
    """``work`` through the router on ``path``, ``c`` at a time: its row and answers."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        answers = list(pool.map(lambda i: _router_call(
            stub, cfg, work[i][0], work[i][1], path, f"e2e-{path}-c{c}-{i}"), range(len(work))))
    expect = {"handoff": "PATH_HANDOFF", "colocated": "PATH_COLOCATED"}[path]
    return level_row(path, c, answers, time.perf_counter() - t0, expect), answers


def run_router(address: str, cfg: E2EConfig, vocab: int
               ) -> tuple[list[dict[str, Any]], dict[int, dict[str, list[Answer]]]]:
    """The router paths at every C (module docstring's order) through the router at
    ``address`` (plaintext, no API key: a local cluster's): rows, and the answers by C
    and path."""
    rows: list[dict[str, Any]] = []
    answers: dict[int, dict[str, list[Answer]]] = {}
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for path in ("handoff", "colocated"):
            warm = prompts_for(cfg, vocab, 0, f"warm-{path}")[:WARM_UP]
            run_router_level(stub, cfg, 1, path, warm)
        for c in cfg.concurrency:
            answers[c] = {}
            for path in ("handoff", "colocated"):
                row, answers[c][path] = run_router_level(
                    stub, cfg, c, path, prompts_for(cfg, vocab, c, path))
                rows.append(row)
    return rows, answers


# ---- vLLM alone -------------------------------------------------------------------------
async def _vllm_call(engine: Any, tokenizer: Any, tokens: Any, cfg: E2EConfig,
                     prompt: list[int], seed: int, request_id: str) -> Answer:
    """Stage 1 on ``engine`` (a PrefillEngine), sampled as the router's P samples it by
    default (positionally, ``engine.sampling``: the same thinking on any engine), then
    vLLM's ``beam_search`` over the re-sent stage-2 prompt."""
    from decode_engine.vllm_peer import vllm_beam_search
    from kvhandoff.types import continuation_prompt

    t0 = time.perf_counter()
    stage1 = await engine.run_stage1(prompt, Stage1Params(
        max_tokens=cfg.stage1_tokens, temperature=1.0, seed=seed, positional=True,
        stop_token_ids=tuple(t for t in (tokens.think_end_id,) if t is not None)),
        f"{request_id}-1",
        export=False)
    prompt2 = continuation_prompt(prompt + stage1.token_ids, list(tokens.default_suffix_ids),
                                  tokens.think_end_id)
    beams = await vllm_beam_search(engine.llm, tokenizer, prompt2, cfg.beam, f"{request_id}-2")
    n = len(prompt2)
    return Answer(prompt, seed, list(stage1.token_ids),
                  [(list(b.token_ids[n:]) if len(b.token_ids) > n else list(b.token_ids),
                    b.cum_logprob) for b in beams], time.perf_counter() - t0)


async def run_vllm_level(engine: Any, tokenizer: Any, tokens: Any, cfg: E2EConfig, c: int,
                         work: list[tuple[list[int], int]], tag: str = "vllm"
                         ) -> tuple[dict[str, Any], list[Answer]]:
    sem = asyncio.Semaphore(c)

    async def one(i: int) -> Answer:
        async with sem:
            return await _vllm_call(engine, tokenizer, tokens, cfg, *work[i],
                                    f"e2e-{tag}-c{c}-{i}")

    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(i) for i in range(len(work))))
    return level_row("vllm_alone", c, list(answers), time.perf_counter() - t0), list(answers)


async def run_vllm(engine: Any, tokenizer: Any, tokens: Any, cfg: E2EConfig,
                   answers: dict[int, dict[str, list[Answer]]]
                   ) -> tuple[list[dict], list[str], dict[str, float]]:
    """vLLM alone at every C over the handoff runs' prompts, then the colocated twins:
    its rows, every difference from the router's answers, and the largest logprob gap
    by router path."""
    warm = [(a.prompt, a.seed) for a in answers[cfg.concurrency[0]]["colocated"][:1]]
    await run_vllm_level(engine, tokenizer, tokens, cfg, 1, warm, "warm")
    rows, diffs = [], []
    gaps = {"handoff": 0.0, "colocated": 0.0}
    for c in cfg.concurrency:
        ours = answers[c]["handoff"]
        row, theirs = await run_vllm_level(engine, tokenizer, tokens, cfg, c,
                                           [(a.prompt, a.seed) for a in ours])
        rows.append(row)
        for i, (got, ref) in enumerate(zip(ours, theirs)):
            diffs += differences(f"handoff C={c} #{i}", got, ref)
            gaps["handoff"] = max(gaps["handoff"], logprob_gap(got, ref))
        twins = answers[c]["colocated"][:TWINS]
        _, theirs = await run_vllm_level(engine, tokenizer, tokens, cfg, 1,
                                         [(a.prompt, a.seed) for a in twins], f"twin{c}")
        for i, (got, ref) in enumerate(zip(twins, theirs)):
            diffs += differences(f"colocated C={c} #{i}", got, ref)
            gaps["colocated"] = max(gaps["colocated"], logprob_gap(got, ref))
    return rows, diffs, gaps


def check_paths(rows: list[dict[str, Any]]) -> list[str]:
    """Router rows whose answers were recomputed or ran off their path."""
    return [f"{r['path']} C={r['concurrency']}: {r['recomputed']} recomputed, "
            f"{r['off_path']} on another path" for r in rows
            if r["recomputed"] or r["off_path"]]


def measure_e2e(model: str | None, cfg: E2EConfig) -> E2EResult:
    """The whole bench on a cluster and an engine started here (module docstring)."""
    from transformers import AutoTokenizer

    from engine import EngineConfig
    from kvhandoff.model import ModelTokens, resolve_model
    from prefill_engine.engine import PrefillEngine
    from tools.launch import local_cluster

    model_dir = resolve_model(model)
    tokens = ModelTokens.load(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = min(tokenizer.vocab_size, 1000)
    engine_flags = ("--max-num-seqs", str(MAX_NUM_SEQS))
    with local_cluster(str(model_dir), Path("out") / "bench-e2e-logs", prefill_mib=POOL_MIB,
                       decode_mib=POOL_MIB, engine_flags=engine_flags) as cluster:
        rows, answers = run_router(cluster["router"], cfg, vocab)

    async def alone() -> tuple[list[dict], list[str], dict[str, float]]:
        engine = PrefillEngine.start(EngineConfig(
            model=str(model_dir), role="prefill", kv_cache_memory_bytes=POOL_MIB << 20,
            max_num_seqs=MAX_NUM_SEQS))
        try:
            await engine.warmup()
            return await run_vllm(engine, tokenizer, tokens, cfg, answers)
        finally:
            engine.shutdown()
            await asyncio.sleep(0.1)

    vllm_rows, diffs, gaps = asyncio.run(alone())
    settings = {"config": {**cfg.__dict__, "concurrency": list(cfg.concurrency)},
                "model": str(model_dir), "pool_mib": POOL_MIB, "max_num_seqs": MAX_NUM_SEQS}
    return E2EResult(settings, rows + vllm_rows, check_paths(rows) + diffs, gaps)


def format_e2e(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [f"two-stage requests through the router: {cfg['prompt_tokens']}-token prompts, "
             f"stage 1 up to {cfg['stage1_tokens']} tokens, W={cfg['beam_width']}, "
             f"T={cfg['beam_tokens']}",
             f"{'C':>3} {'path':>10} {'n':>4} {'QPS':>7} {'first beam p50':>15} "
             f"{'p99':>8} {'stage-1 TTFT p50':>17} {'x vLLM alone':>13}"]
    by = {(r["path"], r["concurrency"]): r for r in result["rows"]}
    for c in cfg["concurrency"]:
        base = by.get(("vllm_alone", c))
        for path in ("handoff", "colocated", "vllm_alone"):
            r = by.get((path, c))
            if r is None:
                continue
            ratio = f"{r['qps'] / base['qps']:.2f}x" if base else "-"
            ttft = r["stage1_first_token_ms_p50"]
            lines.append(f"{c:>3} {path:>10} {r['requests']:>4} {r['qps']:>7.2f} "
                         f"{r['first_beam_ms_p50']:>15.0f} {r['first_beam_ms_p99']:>8.0f} "
                         f"{'-' if ttft is None else f'{ttft:.0f}':>17} {ratio:>13}")
    gaps = ", ".join(f"{k} {v:.1e}" for k, v in result.get("logprob_gaps", {}).items())
    lines.append(f"identical to vLLM alone: yes (logprob gaps: {gaps or '-'}; bound "
                 f"{result['logprob_bound']:.0e})" if result["identical"] else
                 "DIFFERENCES:\n  " + "\n  ".join(result["differences"]))
    return "\n".join(lines)

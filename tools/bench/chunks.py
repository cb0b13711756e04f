"""``kvhandoff bench --chunks``: two-stage requests whose prompt starts with a named KV
chunk (``router.chunks``) against the same prompt sent whole, at 1k, 4k and 8k tokens of
context (7936: the bench model has 8192 positions).

P, D and a router run as processes (``local_cluster``; default model: the ~100M
``bench`` one, its engines at ``max_model_len`` 8192). Per context length: one
chunk of that many tokens is registered (its prefill timed), then ``reps`` pairs run in
turn, whole first: the whole prompt is a fresh random context each time (nothing
cached: a cold prefill), the composed one the chunk and a fresh 32-token query (the
chunk's full blocks held on P). Each request samples 4 stage-1 tokens and searches 4
beams of 2 tokens on D. Measured at the client: the first stage-1 token (time to first
token) and the result (with the router's stage-2 first step: time to first beam). The
medians and their ratios are reported. "identical": one composed request against the
whole prompt with the same tokens and seed, sent after the chunk was deleted (so it
reuses the chunk's blocks still in P's and D's prefix caches): the composition's
plumbing (prompt, placement, handoff), beams' token ids exactly and cumulative logprobs
within the harness's floor. The chunk's own KV against a cold prefill, and its negative
control, are ``tests/test_chunks.py``'s.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.v1 import router_pb2, router_pb2_grpc
from tools.harness.report import LOGPROB_TOLERANCE
from tools.launch import local_cluster

#: Tokens of context; the longest leaves the query and both stages room in the bench
#: model's 8192 positions.
CONTEXTS = (1024, 4096, 7936)
QUERY_TOKENS = 32


def _request(prompt: list[int], seed: int, chunk_ids: list[str] | None = None
             ) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(chunk_ids=chunk_ids or [])
    req.prompt_token_ids.ids.extend(prompt)
    req.stage1.max_tokens, req.stage1.seed = 4, seed
    req.beam.beam_width, req.beam.max_tokens = 4, 2
    return req


def timed(stub, req: router_pb2.GenerateRequest) -> dict[str, Any]:
    """``req`` streamed: the client's time to its first stage-1 token and to its result,
    the router's to its first beam, and the result's stats, beams and thinking."""
    t0 = time.perf_counter()
    first, result = None, None
    for event in stub.GenerateStream(req, timeout=600):
        if event.HasField("stage1_tokens") and first is None:
            first = time.perf_counter() - t0
        elif event.HasField("result"):
            result = event.result
    total = time.perf_counter() - t0
    assert result is not None
    return {"first_token_ms": (first or total) * 1e3, "total_ms": total * 1e3,
            "first_beam_ms": result.timings.stage1_ms + result.timings.stage2_first_step_ms,
            "cached_prompt_tokens": result.stats.num_cached_prompt_tokens,
            "stats": result.stats,
            "beams": [(list(b.token_ids), b.cum_logprob) for b in result.beams],
            "thinking": list(result.thinking_token_ids)}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    """The median of ``key`` over ``timed`` runs."""
    return statistics.median(r[key] for r in runs)


def speedup(whole: list[dict[str, Any]], composed: list[dict[str, Any]], key: str) -> float:
    """How many times faster the composed runs' median ``key`` is than the whole ones'."""
    return median_of(whole, key) / median_of(composed, key)


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["thinking"] == b["thinking"]
            and [t for t, _ in a["beams"]] == [t for t, _ in b["beams"]]
            and all(abs(x - y) <= LOGPROB_TOLERANCE
                    for (_, x), (_, y) in zip(a["beams"], b["beams"])))


def run_chunks(model: str | None, reps: int = 3, contexts: tuple[int, ...] = CONTEXTS,
               seed: int = 0, log_dir: Path = Path("out/bench-chunks"),
               progress: Any = print) -> dict[str, Any]:
    rng = random.Random(seed)
    longest = max(contexts)
    flags = ("--max-model-len", str(longest + 256))
    rows = []
    # The bench model's KV is 24 MiB per 1k tokens (fp32): P holds the chunk, a cold
    # whole prompt and a composed one at once; D one request.
    k = -(-longest // 1024)
    with local_cluster(model or "bench", log_dir, prefill_mib=96 * k,
                       decode_mib=36 * (k + 1), engine_flags=flags,
                       router_flags=("--chunk-pool-share", "0.5")) as c:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(c["router"]))
        vocab = 1000  # within every built-in and bench model's vocabulary

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, vocab) for _ in range(n)]

        for n in contexts:
            progress(f"context {n}: registering the chunk")
            context = tokens(n)
            reg = router_pb2.ChunkRequest(chunk_id=f"ctx-{n}")
            reg.token_ids.ids.extend(context)
            chunk = stub.RegisterChunk(reg, timeout=600)
            whole, composed = [], []
            for i in range(reps):
                progress(f"context {n}: pair {i + 1} of {reps}")
                whole.append(timed(stub, _request(tokens(n + QUERY_TOKENS), seed + i)))
                composed.append(timed(stub, _request(tokens(QUERY_TOKENS), seed + i,
                                                      [chunk.chunk_id])))
            query = tokens(QUERY_TOKENS)
            check = timed(stub, _request(query, seed + 99, [chunk.chunk_id]))
            stub.DeleteChunk(router_pb2.DeleteChunkRequest(chunk_id=chunk.chunk_id),
                             timeout=60)
            reference = timed(stub, _request(context + query, seed + 99))

            rows.append({
                "context_tokens": n,
                "chunk_prefill_ms": chunk.prefill_ms,
                "whole_first_token_ms": median_of(whole, "first_token_ms"),
                "composed_first_token_ms": median_of(composed, "first_token_ms"),
                "whole_first_beam_ms": median_of(whole, "first_beam_ms"),
                "composed_first_beam_ms": median_of(composed, "first_beam_ms"),
                "first_token_speedup": speedup(whole, composed, "first_token_ms"),
                "first_beam_speedup": speedup(whole, composed, "first_beam_ms"),
                "composed_cached_tokens": median_of(composed, "cached_prompt_tokens"),
                "whole_cached_tokens": median_of(whole, "cached_prompt_tokens"),
                "identical": _same(check, reference),
            })
    return {"model": model or "bench", "reps": reps, "query_tokens": QUERY_TOKENS,
            "rows": rows}


def format_chunks(result: dict[str, Any]) -> str:
    lines = [f"model {result['model']}, {result['reps']} pairs per context (whole first), "
             f"{result['query_tokens']}-token queries; medians in ms",
             f"{'context':>8}{'chunk prefill':>15}{'TTFT whole':>12}{'composed':>10}"
             f"{'x':>7}{'first beam whole':>18}{'composed':>10}{'x':>7}{'cached':>8}"
             f"{'identical':>11}"]
    for r in result["rows"]:
        lines.append(
            f"{r['context_tokens']:>8}{r['chunk_prefill_ms']:>15.0f}"
            f"{r['whole_first_token_ms']:>12.0f}{r['composed_first_token_ms']:>10.0f}"
            f"{r['first_token_speedup']:>7.1f}{r['whole_first_beam_ms']:>18.0f}"
            f"{r['composed_first_beam_ms']:>10.0f}{r['first_beam_speedup']:>7.1f}"
            f"{r['composed_cached_tokens']:>8.0f}{'yes' if r['identical'] else 'NO':>11}")
    return "\n".join(lines)

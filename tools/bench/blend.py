"""``kvhandoff bench --chunks approximate``: approximate compositions
(``router.composition``) of chunks prefilled apart, for speed and for quality, by
recomputed share.

Speed (default model: the ~100M ``bench`` one, engines at ``max_model_len`` 8192): per
context length (1k, 4k, 7.9k tokens), ``reps`` rounds in turn, whole first: the whole
prompt (a fresh random context: a cold prefill), then at each share two fresh chunks of
half the context each, registered apart (each prefilled at position 0, not timed),
composed in order with a fresh 32-token query, and deleted (fresh, so no composition
finds an earlier one's blocks under its cache salt). Medians of the client's time to
first token and to first beam, and their ratios.

Quality (the built-in model, which reads its context: its semantic id is a rule of the
history, ``kvhandoff.builtin.corpus.semantic_id``): ``prompts`` corpus-like prompts
(``history: items`` then ``\\n<think>``), the history split into two chunks registered
apart: the first (``history:`` and the first half of the items) stays where it was
prefilled, the second is moved behind it. Each composition runs greedy stage 1 and a
4-beam stage 2 of three tokens; so does the prompt sent whole. Per share: how often the
top beam equals full prefill's and the rule's, and the mean absolute gap of the beams'
cumulative logprobs to full prefill's over the beam ranks whose tokens equal full
prefill's (how many: ``gap_ranks``; few where the beams differ). The control:
share 0 under the ``unrotated`` fault (keys copied, not moved; the engines run with
``--fault-injection``).
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.v1 import router_pb2, router_pb2_grpc
from tools.bench.chunks import median_of, speedup, timed
from tools.launch import local_cluster

CONTEXTS = (1024, 4096, 7936)
SPEED_SHARES = (0.0, 0.15)
QUALITY_SHARES = (0.0, 0.05, 0.15, 0.30)
QUERY_TOKENS = 32
#: The ``unrotated`` control runs at this share.
CONTROL = "unrotated"


def _request(prompt: list[int], seed: int, chunk_ids: list[str] | None = None,
             share: float | None = None, fault: str = "", stage1_tokens: int = 4,
             beam_tokens: int = 2, greedy: bool = False) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(chunk_ids=chunk_ids or [], fault=fault)
    req.prompt_token_ids.ids.extend(prompt)
    req.stage1.max_tokens, req.stage1.seed = stage1_tokens, seed
    if greedy:
        req.stage1.temperature = 0.0
    req.beam.beam_width, req.beam.max_tokens = 4, beam_tokens
    if share is not None:
        req.recompute_share = share
    return req


def _timed(stub, req: router_pb2.GenerateRequest) -> dict[str, Any]:
    run = timed(stub, req)
    stats = run["stats"]
    return {**run, "approximate": stats.approximate, "blended": stats.num_blended_tokens,
            "recomputed_share": stats.recomputed_share}


def _register(stub, name: str, tokens: list[int]) -> None:
    reg = router_pb2.ChunkRequest(chunk_id=name)
    reg.token_ids.ids.extend(tokens)
    stub.RegisterChunk(reg, timeout=600)


def _delete(stub, *names: str) -> None:
    for name in names:
        stub.DeleteChunk(router_pb2.DeleteChunkRequest(chunk_id=name), timeout=60)


def run_blend_speed(model: str | None, reps: int = 3, contexts: tuple[int, ...] = CONTEXTS,
                    seed: int = 0, log_dir: Path = Path("out/bench-blend"),
                    progress: Any = print) -> dict[str, Any]:
    rng = random.Random(seed)
    longest = max(contexts)
    k = -(-longest // 1024)
    rows = []
    with local_cluster(model or "bench", log_dir / "speed", prefill_mib=96 * k,
                       decode_mib=36 * (k + 1),
                       engine_flags=("--max-model-len", str(longest + 256)),
                       router_flags=("--chunk-pool-share", "0.5")) as c:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(c["router"]))

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, 1000) for _ in range(n)]

        for n in contexts:
            whole: list[dict[str, Any]] = []
            composed: dict[float, list[dict[str, Any]]] = {s: [] for s in SPEED_SHARES}
            for i in range(reps):
                progress(f"context {n}: round {i + 1} of {reps}")
                whole.append(_timed(stub, _request(tokens(n + QUERY_TOKENS), seed + i)))
                for share in SPEED_SHARES:
                    # Fresh chunks each time: an identical composition would find the
                    # last one's blocks under its salt (cached, not composed).
                    a, b = f"a-{n}-{i}-{share:g}", f"b-{n}-{i}-{share:g}"
                    _register(stub, a, tokens(n // 2))
                    _register(stub, b, tokens(n - n // 2))
                    composed[share].append(_timed(stub, _request(
                        tokens(QUERY_TOKENS), seed + i, [a, b], share)))
                    _delete(stub, a, b)

            row: dict[str, Any] = {"context_tokens": n,
                                   "whole_first_token_ms": median_of(whole, "first_token_ms"),
                                   "whole_first_beam_ms": median_of(whole, "first_beam_ms")}
            for share, runs in composed.items():
                assert all(r["approximate"] for r in runs), runs
                row[f"share_{share:g}"] = {
                    "first_token_ms": median_of(runs, "first_token_ms"),
                    "first_beam_ms": median_of(runs, "first_beam_ms"),
                    "first_token_speedup": speedup(whole, runs, "first_token_ms"),
                    "first_beam_speedup": speedup(whole, runs, "first_beam_ms"),
                    "blended_tokens": median_of(runs, "blended")}
            rows.append(row)
    return {"model": model or "bench", "reps": reps, "rows": rows}


def run_blend_quality(prompts: int = 32, seed: int = 0,
                      log_dir: Path = Path("out/bench-blend"),
                      progress: Any = print) -> dict[str, Any]:
    from kvhandoff.builtin.corpus import HISTORY_PREFIX, ITEMS, semantic_id
    from kvhandoff.model import ModelTokens, resolve_model

    tokens = ModelTokens.load(resolve_model(None))
    tok = tokens.tokenizer
    head = tok.encode(HISTORY_PREFIX, add_special_tokens=False)
    tail = tok.encode("\n<think>", add_special_tokens=False)
    item_ids = {item: tok.encode(" " + item, add_special_tokens=False)[0] for item in ITEMS}
    rng = random.Random(seed)
    cases: dict[str, list[dict[str, Any]]] = {"full": []}
    rules: list[list[int]] = []
    with local_cluster(None, log_dir / "quality",
                       engine_flags=("--fault-injection",)) as c:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(c["router"]))
        for i in range(prompts):
            progress(f"prompt {i + 1} of {prompts}")
            history = [rng.choice(ITEMS) for _ in range(rng.randrange(16, 41))]
            half = len(history) // 2
            first = head + [item_ids[t] for t in history[:half]]
            second = [item_ids[t] for t in history[half:]]
            rules.append(tok.convert_tokens_to_ids(semantic_id(history)))
            _register(stub, f"q{i}-a", first)
            _register(stub, f"q{i}-b", second)
            ask = dict(seed=seed, stage1_tokens=32, beam_tokens=3, greedy=True)
            cases["full"].append(_timed(stub, _request(first + second + tail, **ask)))
            for share in QUALITY_SHARES:
                cases.setdefault(f"{share:g}", []).append(_timed(stub, _request(
                    tail, chunk_ids=[f"q{i}-a", f"q{i}-b"], share=share, **ask)))
            cases.setdefault(CONTROL, []).append(_timed(stub, _request(
                tail, chunk_ids=[f"q{i}-a", f"q{i}-b"], share=0.0, fault=CONTROL, **ask)))
            _delete(stub, f"q{i}-a", f"q{i}-b")
    full = cases["full"]
    rows = []
    for name, runs in cases.items():
        tops = [r["beams"][0] for r in runs]
        agree = [t == f["beams"][0][0] for (t, _), f in zip(tops, full, strict=True)]
        # Every beam rank whose tokens equal full prefill's at that rank.
        gaps = [abs(lp - flp) for r, f in zip(runs, full, strict=True)
                for (t, lp), (ft, flp) in zip(r["beams"], f["beams"]) if t == ft]
        rows.append({
            "case": name,
            "recomputed_share": statistics.mean(r["recomputed_share"] for r in runs)
            if name != "full" else 1.0,
            "agrees_with_full": sum(agree) / len(runs),
            "agrees_with_rule": sum(t == rule for (t, _), rule in zip(tops, rules, strict=True))
            / len(runs),
            "mean_logprob_gap": statistics.mean(gaps) if gaps else float("nan"),
            "gap_ranks": len(gaps),
        })
    return {"model": "built-in", "prompts": prompts, "rows": rows}


def format_blend(speed: dict[str, Any] | None, quality: dict[str, Any] | None) -> str:
    lines = []
    if speed is not None:
        lines.append(f"speed: model {speed['model']}, {speed['reps']} rounds per context "
                     f"(whole first), {QUERY_TOKENS}-token queries; medians in ms")
        head = f"{'context':>8}{'TTFT whole':>12}{'first beam whole':>18}"
        for share in SPEED_SHARES:
            head += f"{f'TTFT s={share:g}':>14}{'x':>6}{'beam':>8}{'x':>6}"
        lines.append(head)
        for r in speed["rows"]:
            line = (f"{r['context_tokens']:>8}{r['whole_first_token_ms']:>12.0f}"
                    f"{r['whole_first_beam_ms']:>18.0f}")
            for share in SPEED_SHARES:
                s = r[f"share_{share:g}"]
                line += (f"{s['first_token_ms']:>14.0f}{s['first_token_speedup']:>6.1f}"
                         f"{s['first_beam_ms']:>8.0f}{s['first_beam_speedup']:>6.1f}")
            lines.append(line)
    if quality is not None:
        lines.append(f"quality: {quality['model']} model, {quality['prompts']} prompts, "
                     "two chunks each (the second moved); top beam of 4")
        lines.append(f"{'case':>10}{'recomputed':>12}{'= full':>9}{'= rule':>9}"
                     f"{'logprob gap':>13}{'over ranks':>12}")
        for r in quality["rows"]:
            lines.append(f"{r['case']:>10}{r['recomputed_share']:>12.2f}"
                         f"{r['agrees_with_full']:>9.0%}{r['agrees_with_rule']:>9.0%}"
                         f"{r['mean_logprob_gap']:>13.6f}{r['gap_ranks']:>12}")
    return "\n".join(lines)

"""What vLLM itself charges for the first step of W new sequences, with no code of ours.

Issue 31's floor for stage 2 is the import step plus T-1 engine steps *decoding* W
sequences. Any beam search that runs its beams as vLLM requests (ours runs them as slots)
starts W requests after step 0: its first beam step is vLLM's step over W *new* requests,
not a decode step. This probe measures both on plain vLLM (``vllm.LLM``, the engine core
in this process, stepped by hand: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the built-in
model and the bench's D settings, no connector, no logits processor: W requests of
``prefix + [token i]`` over a cached block-aligned prefix, each computing one token at its
first step (the prefix's blocks are prefix-cache hits, as our slots' are), then decoding.

From them, the ratio to the floor that no request-per-beam design can beat on this
engine: ``(import + first + (T-2) x decode) / (import + (T-1) x decode)``, with ``import``
given (``--import-ms``, the bench's measured import step; a larger one only lowers the
bound). It leaves out what making the W requests costs (done before the timed steps).

    python -m tools.bench.request_floor --widths 32,128,512 --tokens 3,8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

PREFIX_TOKENS = 512  # 16 blocks of 32: every prefix block is full, so cached
REPEATS = 3


def _steps(llm: Any, prompts: list[list[int]], tokens: int, tag: str) -> list[float]:
    """Add every prompt, then step the engine by hand until they finish: each step's
    milliseconds (the first: all of them new)."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                            detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0) * 1e3)
    return steps


def measure(widths: list[int], tokens: list[int], import_ms: float,
            model: str | None = None) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from kvhandoff.model import resolve_model

    path = str(resolve_model(model))
    llm = LLM(model=path, tokenizer=path, block_size=32, kv_cache_memory_bytes=2 << 30,
              max_model_len=1024, max_num_seqs=max(64, *widths),
              max_num_batched_tokens=4096, enforce_eager=True, enable_prefix_caching=True,
              seed=0)
    prefix = [6 + (7 * i) % 900 for i in range(PREFIX_TOKENS)]
    llm.generate([{"prompt_token_ids": prefix + [5]}],
                 SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    rows = []
    for width in widths:
        for t in tokens:
            firsts, decodes = [], []
            for rep in range(REPEATS):
                # Tokens no earlier run used after the prefix: only the prefix is cached.
                base = 10 + (rep * len(widths) * len(tokens) + len(rows)) * width
                prompts = [prefix + [6 + (base + i) % 1000] for i in range(width)]
                steps = _steps(llm, prompts, t, f"w{width}t{t}r{rep}")
                assert len(steps) == t, f"W={width}: {len(steps)} steps for {t} tokens"
                firsts.append(steps[0])
                decodes.extend(steps[1:])
            first, decode = statistics.median(firsts), statistics.median(decodes)
            bound = (import_ms + first + (t - 2) * decode) / (import_ms + (t - 1) * decode)
            rows.append({"beam_width": width, "beam_tokens": t,
                         "first_step_ms": round(first, 1), "decode_step_ms": round(decode, 1),
                         "first_over_decode": round(first / decode, 2),
                         "import_ms": import_ms, "ratio_bound": round(bound, 3)})
            print(rows[-1], flush=True)
    return {"model": path, "prefix_tokens": PREFIX_TOKENS, "repeats": REPEATS, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="32,128,512")
    ap.add_argument("--tokens", default="3,8")
    ap.add_argument("--import-ms", type=float, default=10.0,
                    help="the import step the floor counts (the bench's measured one)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    result = measure([int(w) for w in args.widths.split(",")],
                     [int(t) for t in args.tokens.split(",")], args.import_ms, args.model)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

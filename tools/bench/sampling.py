"""What positional sampling costs: stage 1 on one P, positional vs vLLM's own seeded
sampling, the same prompts and parameters, alternating rounds (vllm, positional, vllm,
...) after one warm-up round of each; the prefix cache is emptied before each round.

    python -m tools.bench.sampling [--model DIR] [--rounds 3] [--requests 8] [--tokens 128]
    python -m tools.bench.sampling --row-cost 151936

Prints one JSON line per round and a summary (median tokens per second of each, their
ratio). ``--row-cost V`` instead times the processor's work for one row of a V-token
vocabulary on this machine's CPU (no engine), plain and with top-k/top-p."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from kvhandoff.types import Stage1Params


async def _round(p, prompts: list[list[int]], tokens: int, positional: bool, tag: str) -> float:
    await p.empty_prefix_cache()
    params = [Stage1Params(max_tokens=tokens, temperature=1.0, top_k=50, top_p=0.95,
                           seed=i, ignore_eos=True, positional=positional)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        p.run_stage1(prompt, params[i], f"{tag}-{i}", export=False)
        for i, prompt in enumerate(prompts)))
    elapsed = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in results) / elapsed


async def _main(args: argparse.Namespace) -> None:
    from tools.local import local_pair

    rng = random.Random(0)
    async with local_pair(args.model) as pair:
        prompts = [[rng.randrange(10, pair.p.vocab_size) for _ in range(args.prompt_len)]
                   for _ in range(args.requests)]
        rates: dict[str, list[float]] = {"vllm": [], "positional": []}
        for r in range(args.rounds + 1):
            for mode in ("vllm", "positional"):
                rate = await _round(pair.p, prompts, args.tokens, mode == "positional",
                                    f"{mode}-{r}")
                if r == 0:
                    continue  # warm-up
                rates[mode].append(rate)
                print(json.dumps({"round": r, "mode": mode, "tokens_per_s": round(rate, 1)}),
                      flush=True)
        med = {m: statistics.median(v) for m, v in rates.items()}
        print(json.dumps({"requests": args.requests, "tokens": args.tokens,
                          "prompt_len": args.prompt_len, "vocab_size": pair.p.vocab_size,
                          "median_tokens_per_s": {m: round(v, 1) for m, v in med.items()},
                          "positional_over_vllm": round(med["positional"] / med["vllm"], 3)}))


def row_cost(vocab_size: int, repeats: int = 50) -> None:
    import torch

    from engine.sampling import perturbed, spec_of

    logits = torch.randn(vocab_size, generator=torch.Generator().manual_seed(0))
    for spec in (spec_of(seed=1, temperature=1.0),
                 spec_of(seed=1, temperature=1.0, top_k=50, top_p=0.95)):
        perturbed(logits, spec, 0)
        t0 = time.perf_counter()
        for pos in range(repeats):
            perturbed(logits, spec, pos)
        print(json.dumps({"vocab_size": vocab_size, "top_k": spec["top_k"],
                          "top_p": spec["top_p"],
                          "ms_per_row": round((time.perf_counter() - t0) / repeats * 1e3, 2)}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--row-cost", type=int, default=0, metavar="VOCAB_SIZE")
    args = ap.parse_args(argv)
    if args.row_cost:
        row_cost(args.row_cost)
    else:
        asyncio.run(_main(args))


if __name__ == "__main__":
    main()

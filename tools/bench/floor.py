"""What the handoff's stage 2 costs against its floor, on a :class:`~tools.bench.modes.Bench`:

- ``stage2_floor``: stage 2 (a cold handoff, W beams x T tokens) against the import step
  plus T-1 engine steps decoding W sequences of the parent's length (from vLLM's
  iteration stats);
- ``sweep_point``: a cold handoff of a parent of a given length: its READ, its import
  step and the step's pieces, against the prefill it replaces on D.

Each runs with the engines to itself (one request or one batch at a time).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from kvhandoff.types import BeamParams
from tools.bench.modes import Bench, make_prompts
from tools.bench.types import BenchError


async def sweep_point(bench: Bench, parent_tokens: int, seed: int) -> dict[str, Any]:
    """A cold handoff of a ``parent_tokens`` parent: its READ, its import step and the
    step's pieces, against the prefill it replaces on D."""
    from vllm import SamplingParams

    prompt = make_prompts(bench.tok, 1, parent_tokens - 1, seed)[0]
    # Cold handoffs of this parent (a different stage-1 token each); the median one
    # by READ time is reported, with the median import step.
    runs = [await bench.one("handoff", prompt, seed + k, stage1_tokens=1,
                            beam=BeamParams(beam_width=bench.cfg.beam_width, max_tokens=2))
            for k in range(bench.cfg.sweep_repeats)]
    s = sorted(runs, key=lambda r: r.transfer_ms or 0.0)[len(runs) // 2]
    import_step_ms = statistics.median(r.stage2_first_beam_ms for r in runs)
    # The tail's forward pass at this context: D now holds the parent's full blocks,
    # so the same stage-2 prompt computes only what follows them.
    computed0 = bench.d.counters.prompt_tokens_computed
    t0 = time.perf_counter()
    await bench.d.generate(s.stage2_prompt, SamplingParams(max_tokens=1, temperature=0.0),
                           bench.new_id("tail"))
    tail_ms = (time.perf_counter() - t0) * 1e3
    await asyncio.sleep(0.05)
    tail_tokens = bench.d.counters.prompt_tokens_computed - computed0
    await bench.d.empty_prefix_cache()
    t0 = time.perf_counter()
    await bench.d.generate(prompt + [0], SamplingParams(max_tokens=1, temperature=0.0),
                           bench.new_id("prefill"))
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


async def decode_step_ms(bench: Bench, prompt: list[int], width: int, steps: int,
                         logprobs: int | None = None) -> float:
    """Median duration of an engine step decoding ``width`` sequences of ``prompt``'s
    length on D, from vLLM's iteration stats (steps in which all of them decoded)."""
    return await decode_step_ms_many(bench, [prompt], width, steps, logprobs)


async def decode_step_ms_many(bench: Bench, prompts: list[list[int]], width: int, steps: int,
                              logprobs: int | None = None) -> float:
    """Median duration of an engine step decoding ``width`` sequences of each of
    ``prompts`` (``len(prompts) x width`` in all) on D, plain vLLM requests, from vLLM's
    iteration stats (steps in which all of them decoded). ``steps`` must outlast their
    admission: each sequence's first step computes its prompt's uncached tail, and those
    share the step's token budget."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True,
                            logprobs=logprobs, detokenize=False)
    first = bench.d.counters.iterations
    total = len(prompts) * width
    await asyncio.gather(*(bench.d.generate(prompt, params, bench.new_id(f"floor{j}-{i}"))
                           for j, prompt in enumerate(prompts) for i in range(width)))
    await asyncio.sleep(0.1)
    step_s = [statistics.median(it.inter_token_s)
              for it in bench.d.counters.recent_iterations
              if it.index > first and len(it.inter_token_s) == total]
    if not step_s:
        raise BenchError(f"no engine step decoded all {total} sequences together")
    return statistics.median(step_s) * 1e3


async def stage2_floor(bench: Bench, prompt: list[int], width: int, tokens: int,
                       seed: int) -> dict[str, Any]:
    """Our stage 2 (cold handoff, ``width`` beams, ``tokens`` tokens) against its
    floor: the import step plus ``tokens - 1`` steps decoding ``width`` sequences.
    Beside it: the same decode steps returning ``2 x width`` logprobs each (what vLLM's
    own beam search asks for; ours returns none after step 0). The slots' steps in
    detail: ``tools.bench.beams``."""
    s = await bench.one("handoff", prompt, seed,
                        beam=BeamParams(beam_width=width, max_tokens=tokens))
    step_ms = await decode_step_ms(bench, s.stage2_prompt, width, max(tokens, 3))
    with_logprobs_ms = await decode_step_ms(bench, s.stage2_prompt, width, max(tokens, 3),
                                            logprobs=2 * width)
    floor_ms = s.stage2_first_beam_ms + (tokens - 1) * step_ms
    return {"beam_width": width, "beam_tokens": tokens, "parent_tokens": s.parent_tokens,
            "stage2_total_ms": round(s.stage2_total_ms, 3),
            "import_step_ms": round(s.stage2_first_beam_ms, 3),
            "decode_step_ms": round(step_ms, 3),
            "decode_step_logprobs_ms": round(with_logprobs_ms, 3),
            "beam_step_ms": round((s.stage2_total_ms - s.stage2_first_beam_ms)
                                  / max(1, tokens - 1), 3),
            "floor_ms": round(floor_ms, 3),
            "ratio": round(s.stage2_total_ms / floor_ms, 3)}

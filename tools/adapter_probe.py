"""What vLLM 0.32 does with LoRA adapters under this project's handoff (CPU), beneath
our own adapter check: ``python -m tools.adapter_probe``; and what LoRA on costs a stage
2: ``python -m tools.adapter_probe --cost``.

P and D serve two random adapters a and b of the built-in model (``EngineConfig.
adapters``, built-in seeds 1 and 2). It prints whether the adapter changes stage 1 and
the beams (colocated on P), then a handoff exported under a and imported by D under a,
under b and under none: equal to the colocated run under a or not, and how many tokens D
computed for the import step. The imports under another adapter name the fault
``accept-any-adapter`` (D's admission skips its check, ``connector.adapters``): what
vLLM itself does then is what the check exists for (docs/decisions.md, "Adapters: what
vLLM 0.32 offers").
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import replace
from typing import Any

from connector.faults import ANY_ADAPTER_FAULT
from connector.handoff import ImportRequest
from decode_engine.beam import beam_search
from decode_engine.engine import DecodeEngine
from engine import EngineConfig, shutdown_all
from kvhandoff.model import ModelTokens, resolve_model
from kvhandoff.types import BeamParams, Stage1Params
from prefill_engine.engine import PrefillEngine, stage1_sampling


async def probe() -> dict[str, Any]:
    from kvhandoff.builtin.adapters import builtin_adapter

    model_dir = resolve_model(None)
    tokens = ModelTokens.load(model_dir)
    adapters = tuple((name, str(builtin_adapter(model_dir, seed)))
                     for name, seed in (("a", 1), ("b", 2)))
    config = {"model": str(model_dir), "adapters": adapters, "fault_injection": True}
    p = PrefillEngine.start(EngineConfig(role="prefill", **config))
    d = DecodeEngine.start(EngineConfig(role="decode", **config))
    prompt = list(range(100, 400))
    stage1 = Stage1Params(max_tokens=8, temperature=0.0, stop_token_ids=())
    beam = BeamParams(beam_width=4, max_tokens=3)
    result: dict[str, Any] = {}

    def beams(outcome: Any) -> list[tuple[list[int], float]]:
        return [(x.token_ids, x.cum_logprob) for x in outcome.beams]

    try:
        await asyncio.gather(p.warmup(), d.warmup())
        colocated = {}
        for adapter in ("", "a"):
            gen = functools.partial(p.generate, adapter=adapter)
            s1 = await gen(prompt, stage1_sampling(stage1), f"col1-{adapter}")
            ids = list(s1.outputs[0].token_ids)
            s2 = await beam_search(gen, prompt + ids + tokens.default_suffix_ids, beam,
                                   eos_token_id=p.eos_token_id, request_id=f"col2-{adapter}")
            colocated[adapter] = (ids, beams(s2))
        result["adapter_changes_stage1"] = colocated[""][0] != colocated["a"][0]
        result["adapter_changes_beams"] = colocated[""][1] != colocated["a"][1]
        for label, d_adapter in (("a->a", "a"), ("a->b", "b"), ("a->none", "")):
            await p.empty_prefix_cache()
            await d.empty_prefix_cache()
            export = p._sampling(prompt, stage1, True, d.handoff_target, request_id=f"h1-{label}")
            s1 = await p.generate(prompt, export, f"h1-{label}", adapter="a")
            ids = list(s1.outputs[0].token_ids)
            fault = None if d_adapter == "a" else ANY_ADAPTER_FAULT
            params = replace(ImportRequest.for_beams(s1.kv_transfer_params, beam, fault),
                             reserved_blocks=d.num_reserved_blocks).to_params()
            s2 = await beam_search(functools.partial(d.generate, adapter=d_adapter),
                                   prompt + ids + tokens.default_suffix_ids, beam,
                                   eos_token_id=d.eos_token_id, request_id=f"h2-{label}",
                                   first_step_extra_args={"kv_transfer_params": params},
                                   fork=d.config.beam_fork)
            got, want = beams(s2), colocated["a"][1]
            first = s2.first_output
            result[label] = {
                "stage1_equal": ids == colocated["a"][0],
                "beams_equal_colocated_a": [t for t, _ in got] == [t for t, _ in want],
                "max_logprob_diff": max(abs(x[1] - y[1]) for x, y in zip(got, want)),
                "tokens_d_computed_first_step": len(first.prompt_token_ids)
                - (first.num_cached_tokens or 0),
            }
    finally:
        shutdown_all([d, p])
    return result


async def cost(repeats: int = 7) -> dict[str, Any]:
    """What LoRA on costs a request: one engine without adapters, then one serving the
    built-in adapter a (fresh each, one after the other), the same stage 2 (W=4, 8 beam
    tokens over a 502-token prompt, from token ids, prefix cache emptied before each)
    ``repeats`` times; medians in ms. On the LoRA engine: under no adapter and under a."""
    import statistics
    import time

    from decode_engine.engine import run_beam_stage
    from kvhandoff.builtin.adapters import builtin_adapter

    model_dir = resolve_model(None)
    prompt, beam = list(range(100, 602)), BeamParams(beam_width=4, max_tokens=8)
    result: dict[str, Any] = {}
    for label, adapters in (("lora off", ()),
                            ("lora on", (("a", str(builtin_adapter(model_dir, 1))),))):
        d = DecodeEngine.start(EngineConfig(model=str(model_dir), role="decode",
                                            adapters=adapters))
        try:
            await d.warmup()
            for adapter in ("", "a") if adapters else ("",):
                times = []
                for i in range(repeats):
                    await d.empty_prefix_cache()
                    t0 = time.perf_counter()
                    await run_beam_stage(d, prompt, beam, f"cost-{adapter}-{i}",
                                         adapter=adapter)
                    times.append((time.perf_counter() - t0) * 1e3)
                result[f"{label}, under {adapter or 'none'}"] = round(
                    statistics.median(times[1:]), 1)
        finally:
            shutdown_all([d])
    return result


def main() -> None:
    import sys

    if sys.argv[1:] == ["--cost"]:
        print(json.dumps(asyncio.run(cost()), indent=1))
        return
    print(json.dumps(asyncio.run(probe()), indent=1))


if __name__ == "__main__":
    main()

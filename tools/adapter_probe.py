"""What vLLM 0.32 does with LoRA adapters on this project's engines (CPU), before the
project carries adapters itself: ``python -m tools.adapter_probe``; and what LoRA on
costs a stage 2: ``python -m tools.adapter_probe --cost``.

P and D start with LoRA on (``enable_lora``, rank 8) and two random adapters A and B for
the built-in model (q/v projections, written in PEFT's format: ``write_adapter``). Every
request goes to vLLM's ``AsyncLLM.generate`` with its ``lora_request``, through our beam
search's own generate function. It prints whether the adapter changes stage 1 and the
beams (colocated on P), then a handoff exported under A and imported by D under A, under
B and under none: equal to the colocated run under A or not, and how many tokens D
imported (docs/decisions.md, "Adapters: what vLLM 0.32 offers").
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from connector.handoff import ImportRequest
from decode_engine.beam import beam_search
from decode_engine.engine import DecodeEngine
from engine import EngineConfig, shutdown_all
from kvhandoff.builtin_adapters import RANK, write_adapter
from kvhandoff.model import ModelTokens, resolve_model
from kvhandoff.types import BeamParams, Stage1Params
from prefill_engine.engine import PrefillEngine, stage1_sampling


@dataclass(frozen=True)
class LoraEngineConfig(EngineConfig):
    """An engine with vLLM's LoRA on (the probe's only difference)."""

    def engine_args(self, engine_id: str, events: Any = None) -> Any:
        args = super().engine_args(engine_id, events)
        args.enable_lora, args.max_lora_rank, args.max_loras, args.max_cpu_loras = (
            True, RANK, 2, 2)
        return args


def generate_with(engine: Any, lora: Any):
    """``engine``'s requests, each under ``lora`` (None: the base model)."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    async def generate(prompt: list[int], params: Any, request_id: str) -> Any:
        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                             request_id, lora_request=lora):
            final = out
        return final

    return generate


async def probe(out_dir: Path) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    model_dir = resolve_model(None)
    tokens = ModelTokens.load(model_dir)
    a = LoRARequest("a", 1, str(write_adapter(model_dir, out_dir / "a", 1)))
    b = LoRARequest("b", 2, str(write_adapter(model_dir, out_dir / "b", 2)))
    p = PrefillEngine.start(LoraEngineConfig(model=str(model_dir), role="prefill"))
    d = DecodeEngine.start(LoraEngineConfig(model=str(model_dir), role="decode"))
    prompt = list(range(100, 400))
    stage1 = Stage1Params(max_tokens=8, temperature=0.0, stop_token_ids=())
    beam = BeamParams(beam_width=4, max_tokens=3)
    result: dict[str, Any] = {}

    def beams(outcome: Any) -> list[tuple[list[int], float]]:
        return [(x.token_ids, x.cum_logprob) for x in outcome.beams]

    try:
        await asyncio.gather(p.warmup(), d.warmup())
        colocated = {}
        for name, lora in (("base", None), ("a", a)):
            gen = generate_with(p, lora)
            s1 = await gen(prompt, stage1_sampling(stage1), f"col1-{name}")
            ids = list(s1.outputs[0].token_ids)
            s2 = await beam_search(gen, prompt + ids + tokens.default_suffix_ids, beam,
                                   eos_token_id=p.eos_token_id, request_id=f"col2-{name}")
            colocated[name] = (ids, beams(s2))
        result["adapter_changes_stage1"] = colocated["base"][0] != colocated["a"][0]
        result["adapter_changes_beams"] = colocated["base"][1] != colocated["a"][1]
        for label, d_lora in (("A->A", a), ("A->B", b), ("A->none", None)):
            await p.empty_prefix_cache()
            await d.empty_prefix_cache()
            export = p._sampling(prompt, stage1, True, d.handoff_target, request_id=f"h1-{label}")
            s1 = await generate_with(p, a)(prompt, export, f"h1-{label}")
            ids = list(s1.outputs[0].token_ids)
            params = replace(ImportRequest.for_beams(s1.kv_transfer_params, beam),
                             reserved_blocks=d.num_reserved_blocks).to_params()
            s2 = await beam_search(generate_with(d, d_lora),
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
    from kvhandoff.builtin_adapters import builtin_adapter

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
    print(json.dumps(asyncio.run(probe(Path("out/adapter-probe"))), indent=1))


if __name__ == "__main__":
    main()

"""How much an engine's own results move with the shape of the computation, beside what
a handoff moves them: ``python -m tools.harness.shape_noise --model llama-mqa-bf16``.

For each parent (stage 1 of 4 tokens on prompts of about 4k tokens, and one short), W=1
stage 2 of 3 tokens is run six ways and each cumulative logprob printed against the
colocated run on P:
- ``col_again``: the colocated run again (P, same cache state);
- ``col_scratch``: the colocated run with P's prefix cache emptied first;
- ``d_scratch``: the same stage 2 on D with no handoff, D's prefix cache emptied (D
  prefills the whole prompt itself, in its own chunks);
- ``d_cached``: the same on D again, on the blocks that run left in D's prefix cache;
- ``handoff``: P's stage 1 exported, D imports it and runs stage 2.
``d_scratch`` and ``d_cached`` use no code of ours on the KV path: they are the engine's
own spread for one input, against which the handoff's difference is read
(docs/decisions.md, "bf16: the shape of the computation").
"""

from __future__ import annotations

import argparse
import asyncio
import json

from decode_engine.engine import run_beam_stage
from kvhandoff.model import resolve_model
from tools.harness.cases import Case, history_prompt
from tools.harness.main import pair_settings
from tools.harness.run import Harness
from tools.local import local_pair
from tools.pipeline import run_colocated, run_handoff, stage2_prompt


async def measure(model: str) -> list[dict]:
    rows = []
    async with local_pair(model, lease_s=30, **pair_settings(resolve_model(model))) as pair:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids)
        fill = harness._prompt_len(Case("fill", 0, "length", 1, stage1_max_tokens=4,
                                        d_state="fill"))
        # Parent = prompt + 4; its KV = parent - 1 tokens: 126 full blocks of 32 exactly,
        # or 13 tokens into a partial block; and the harness's fill case's length.
        for name, n in (("fill", fill), ("full-126", 126 * 32 - 3),
                        ("partial-13", 126 * 32 + 10), ("short", 81)):
            case = Case(f"shape-{name}", n, "length", 1, stage1_max_tokens=4)
            prompt = history_prompt(n, case.name, harness.tokenizer)
            req = harness.build_request(case, await harness._find_seed(case, prompt), prompt)
            col = await run_colocated(pair.p, req)
            again = await run_colocated(pair.p, req)
            stage2, _ = stage2_prompt(req, col.stage1)
            await pair.d.empty_prefix_cache()
            d_scratch = await run_beam_stage(pair.d, stage2, req.beam, f"{case.name}-ds")
            d_cached = await run_beam_stage(pair.d, stage2, req.beam, f"{case.name}-dc")
            await pair.d.empty_prefix_cache()
            handoff = await run_handoff(pair.p, pair.d, req)
            await pair.p.empty_prefix_cache()
            scratch = await run_colocated(pair.p, req)
            ref = col.stage2.beams[0]
            runs = {"col_again": again.stage2, "col_scratch": scratch.stage2,
                    "d_scratch": d_scratch, "d_cached": d_cached, "handoff": handoff.stage2}
            row = {"case": name, "parent": len(col.parent_token_ids),
                   "tokens_equal": all(r.beams[0].token_ids == ref.token_ids
                                       for r in runs.values()),
                   **{k: r.beams[0].cum_logprob - ref.cum_logprob for k, r in runs.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-mqa-bf16")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = asyncio.run(measure(args.model))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

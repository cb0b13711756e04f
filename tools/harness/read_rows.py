"""Whether rows computed over KV rows read (not computed in the same pass) move the
results, with no beam search of ours in the way: ``python -m tools.harness.read_rows``.

The harness's cases at one beam token (T=1, W=256: stage 2 is step 0 alone, its 256
candidates; no slot, no block copy of ours) on parents of about 1k, 2k and 4k tokens,
engines as ``kvhandoff verify --beam-width 256`` starts them. On D the handoff computes
the suffix starting inside the parent's partial block, whose earlier rows vLLM's NIXL
connector read from P; the colocated run on P computes that block from its start. The
table's "d coloc" column is that difference; "d vllm" the same against vLLM's
``beam_search`` on P (docs/decisions.md, "The W=256 fill case: rows read, not computed").
"""

from __future__ import annotations

import argparse
import asyncio

from kvhandoff.model import resolve_model
from tools.harness.cases import Case
from tools.harness.main import pair_settings
from tools.harness.report import format_table
from tools.harness.run import Harness
from tools.local import local_pair

WIDTH = 256


async def measure(model: str | None, prompt_lens: list[int]) -> str:
    model_dir = resolve_model(model)
    async with local_pair(model, lease_s=30, second_prefill=False,
                          **pair_settings(model_dir, WIDTH)) as pair:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids)
        cases = [Case(f"p{n}-len-w{WIDTH}-t1", n, "length", WIDTH, stage1_max_tokens=4,
                      beam_max_tokens=1) for n in prompt_lens]
        report = await harness.run(cases, model_dir=str(pair.model_dir))
    return format_table(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="as kvhandoff verify's (builtin)")
    parser.add_argument("--prompt-lens", default="1000,2000,4000",
                        help="stage-1 prompt lengths (the parent is 4 tokens longer)")
    args = parser.parse_args()
    print(asyncio.run(measure(args.model, [int(n) for n in args.prompt_lens.split(",")])))


if __name__ == "__main__":
    main()

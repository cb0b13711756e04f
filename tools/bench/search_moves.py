"""``kvhandoff bench --search-moves``: what moving a running beam search from one D to
another costs, by beam width and parent length (issue 59), on P, D and a second D in
this process (the harness's pair, ``tools.harness.search_moves``).

For each (W, L): stage 1 on P (a prompt of about L tokens, exported), stage 2 by
handoff on D, T = 8, stopped after k = 4 beam steps; resumed on the second D; then the
same search unmoved on D, importing the same parent (held on P for both) into an empty
prefix cache, as the moved one did. Reported: the KV the second D READ (tokens, blocks,
bytes) and its import step's seconds, the tokens the slots recomputed (each live beam's
own), the resumed search's seconds, what the move added to the search (the moved run's
seconds on D and on the second D, minus the unmoved one's), what was left of the search
at the move (the unmoved search's seconds minus the moved run's before the stop), and
whether the beams are the unmoved search's.
"""

from __future__ import annotations

from typing import Any

from tools.harness.search_moves import SearchMoveCase, run_case

#: Parent lengths (tokens of the history prompt; stage 2's prompt adds ~50).
LENGTHS = (256, 1024, 3072)
WIDTHS = (4, 32, 512)
#: Beam steps, and the step the search moves at.
STEPS, MOVE_AT = 8, 4


async def run_search_moves(model: str | None, widths: tuple[int, ...] = WIDTHS,
                           lengths: tuple[int, ...] = LENGTHS) -> dict[str, Any]:
    from kvhandoff.budget import blocks_needed
    from kvhandoff.model import DTYPE_BYTES, kv_bytes_per_block, resolve_model
    from tools.harness.main import pair_settings
    from tools.local import local_pair

    model_dir = resolve_model(model)
    settings = pair_settings(model_dir)
    per_block = kv_bytes_per_block(model_dir, block_size=32,
                                   dtype_bytes=DTYPE_BYTES[settings["dtype"]])
    blocks = 1 + 2 * blocks_needed(max(lengths) + 100, 32, max(widths), STEPS, beam_fork=True)
    settings["decode_overrides"] = {"kv_cache_memory_bytes": blocks * per_block}
    rows = []
    async with local_pair(model, lease_s=30, second_decode=True, **settings) as pair:
        for width in widths:
            for length in lengths:
                row = await run_case(pair, SearchMoveCase(width, STEPS, MOVE_AT), length,
                                     reference=False)
                row.update(width=width, parent_len=length)
                print(f"W={width} L={length}: {row}", flush=True)
                rows.append(row)
    return {"model": str(model_dir), "steps": STEPS, "move_at": MOVE_AT, "rows": rows,
            "identical": all(r["ok"] for r in rows)}


def format_search_moves(result: dict[str, Any]) -> str:
    lines = [f"Beam searches moved D -> D' after {result['move_at']} of {result['steps']} "
             "beam steps (seconds)",
             f"{'W':>4} {'prompt':>6} {'READ tok':>8} {'blocks':>6} {'MiB':>6} "
             f"{'import':>7} {'recomp':>6} {'resumed':>8} {'rest':>7} {'added':>7} "
             f"{'identical':>9}"]
    for r in result["rows"]:
        if "imported_tokens" not in r:
            lines.append(f"{r['width']:>4} {r['prompt_tokens']:>6}  {r['why']}")
            continue
        lines.append(
            f"{r['width']:>4} {r['prompt_tokens']:>6} {r['imported_tokens']:>8} "
            f"{r['imported_blocks']:>6} {r['imported_bytes'] / 2**20:>6.1f} "
            f"{r['import_s']:>7.3f} {r['tail_tokens']:>6} {r['resumed_s']:>8.3f} "
            f"{r['rest_s']:>7.3f} {r['move_cost_s']:>7.3f} {'yes' if r['ok'] else 'NO':>9}")
    return "\n".join(lines)

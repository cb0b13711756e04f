"""``kvhandoff verify --search-moves``: running beam searches moved from one D to another
(issue 59), on P, D and a second D started in this process.

Each case: stage 1 on P (exported), stage 2 by handoff on D stopped once ``k`` beam steps
ran (``stop_at``: the same stop the router's Move sends, at a chosen step), resumed on
the second D (``decode_engine.beam.resume_search``: the prompt's KV READ from D over
NIXL, each live beam's own tokens recomputed); its final beams against the unmoved
search on D (importing the same parent, held on P for both) and, unconstrained, vLLM's
own ``beam_search`` (ids exact, cumulative
logprobs within ``LOGPROB_TOLERANCE``). The negative controls hand over a wrong state or
lose a moved block, and must differ. Every pool must be clean at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from connector.handoff import ImportRequest
from connector.params import KEY
from decode_engine.beam import StoppedSearch
from decode_engine.vllm_peer import vllm_beam_search
from kvhandoff.types import Beam, BeamParams, Stage1Params
from tools.harness.cases import history_prompt
from tools.harness.report import LOGPROB_TOLERANCE

#: The cases' parents: a 400-token prompt, up to 48 thinking tokens, the suffix.
MAX_PROMPT_TOKENS = 480

#: What a control does to the move (each must make the beams differ).
CONTROLS = ("swap-tails", "step-off-by-one", "zero-block")


@dataclass(frozen=True)
class SearchMoveCase:
    width: int
    steps: int  # T: beam steps, step 0 included
    k: int  # beam steps run on D before the move
    catalog: str | None = None
    control: str | None = None

    @property
    def name(self) -> str:
        cat = f"-{self.catalog}" if self.catalog else ""
        ctl = f"-{self.control}" if self.control else ""
        return f"W{self.width}-T{self.steps}-k{self.k}{cat}{ctl}"


#: The built-in catalog's items are 3 tokens: a constrained search has no live beam left
#: after step 3 (each beam is a whole item, ended by EOS), so nothing is left to move.
CATALOG_LAST_MOVE = 3


def search_move_cases(quick: bool = False) -> list[SearchMoveCase]:
    """W in {4, 32, 512} (quick: 4, 32), T in {3, 8}, moved at k = 1 and T-1 (with the
    catalog ``shop``: at most :data:`CATALOG_LAST_MOVE`), with and without the catalog;
    then the controls at W=4, T=8, k=4."""
    widths = (4, 32) if quick else (4, 32, 512)
    cases = [SearchMoveCase(w, t, k, catalog)
             for w in widths for t in (3, 8) for catalog in (None, "shop")
             for k in sorted({1, t - 1 if catalog is None else min(t - 1, CATALOG_LAST_MOVE)})]
    return cases + [SearchMoveCase(4, 8, 4, control=c) for c in CONTROLS]


def _same(got: list[Beam], ref: list[Beam]) -> str:
    """"" when ``got`` equals ``ref`` (ids exact, logprobs within the bound), else how
    they differ."""
    if [b.token_ids for b in got] != [b.token_ids for b in ref]:
        return "token ids differ"
    worst = max((abs(a.cum_logprob - b.cum_logprob) for a, b in zip(got, ref)), default=0.0)
    return "" if worst <= LOGPROB_TOLERANCE else f"logprobs differ by {worst:.2e}"


def _tampered(stopped: StoppedSearch, control: str | None) -> StoppedSearch:
    if control == "swap-tails":
        live = list(stopped.live)
        (a, ca), (b, cb) = live[0], live[1]
        live[0], live[1] = (b, ca), (a, cb)
        return dataclasses.replace(stopped, live=live)
    if control == "step-off-by-one":
        return dataclasses.replace(stopped, steps_done=stopped.steps_done + 1)
    return stopped


async def run_case(pair: Any, case: SearchMoveCase, prompt_len: int = 400,
                   reference: bool = True) -> dict[str, Any]:
    """One case (module docstring): its row (``reference`` False: without vLLM's
    ``beam_search``, the bench's way)."""
    rid = f"verify-move-{case.name}"
    beam = BeamParams(beam_width=case.width, max_tokens=case.steps, catalog=case.catalog,
                      ignore_eos=case.control is not None)
    prompt = history_prompt(prompt_len, rid, pair.tokenizer)
    # Held for its lease: the unmoved search imports it too (released at the end).
    s1 = await pair.p.run_stage1(prompt, Stage1Params(
        max_tokens=48, temperature=1.0, seed=3, stop_token_ids=(pair.think_end_id,)),
        f"{rid}-p", export=True, hold=True)
    stage2 = prompt + s1.token_ids + pair.default_suffix_ids
    try:
        return await _moved_and_unmoved(pair, case, rid, beam, s1, stage2, reference)
    finally:
        await pair.p.release([str(s1.handoff_params[KEY]["request_id"])])


async def _moved_and_unmoved(pair: Any, case: SearchMoveCase, rid: str, beam: BeamParams,
                             s1: Any, stage2: list[int], reference: bool) -> dict[str, Any]:
    """The search moved at step k, then unmoved, each importing the parent from P into
    a D whose prefix cache was emptied."""
    for d in (pair.d, pair.d2):
        await d.empty_prefix_cache()
    t0 = time.perf_counter()
    out = await pair.d.run_stage2(stage2, beam, rid, stop_at=case.k,
                                  handoff=ImportRequest.for_beams(s1.handoff_params, beam))
    stopped_s = time.perf_counter() - t0
    row: dict[str, Any] = {"case": case.name, "prompt_tokens": len(stage2)}
    if out.stopped is None:
        return {**row, "ok": False, "why": "the search was not stopped"}
    stopped = _tampered(out.stopped, case.control)
    fault = "zero-block" if case.control == "zero-block" else None
    t1 = time.perf_counter()
    moved = await pair.d2.run_stage2(stopped.prompt, beam, f"{rid}-r", moved=stopped,
                                     handoff=ImportRequest.for_beams(stopped.export, beam,
                                                                     fault=fault))
    resumed_s = time.perf_counter() - t1
    await pair.d.empty_prefix_cache()
    unmoved = await pair.d.run_stage2(stage2, beam, f"{rid}-u",
                                      handoff=ImportRequest.for_beams(s1.handoff_params, beam))
    why = _same(moved.beams, unmoved.beams)
    theirs_why = ""
    if reference and case.catalog is None and case.control is None:
        theirs = await vllm_beam_search(pair.d.llm, pair.tokenizer, stage2, beam, f"{rid}-v")
        theirs_why = _same(moved.beams, theirs)
    if case.control is not None:
        await pair.d2.empty_prefix_cache()  # a zeroed block must serve no one later
        ok, why = bool(why), why or f"control {case.control}: the beams are the same"
    else:
        ok, why = not why and not theirs_why, why or theirs_why
    return {**row, "ok": ok, "why": why, "beams": len(moved.beams),
            "live_moved": len(stopped.live), "imported_tokens": moved.num_imported_tokens,
            "imported_bytes": moved.num_imported_bytes,
            "imported_blocks": moved.num_imported_blocks,
            "tail_tokens": moved.step_computed_tokens[1] if len(moved.step_computed_tokens) > 1
            else 0,
            "before_move_s": round(stopped_s, 3), "import_s": round(moved.first_step_s, 3),
            "resumed_s": round(resumed_s, 3), "unmoved_s": round(unmoved.elapsed_s, 3),
            # What the move added to the search's time, and what was left of it.
            "move_cost_s": round(stopped_s + resumed_s - unmoved.elapsed_s, 3),
            "rest_s": round(unmoved.elapsed_s - stopped_s, 3)}


async def verify_search_moves(model: str | None, *, quick: bool, json_path: str | None,
                              lease_s: int = 30) -> bool:
    """Start P, D and a second D (D pools sized for W=512), run every case, print a row
    each; True when every case passed and every pool is clean."""
    from kvhandoff.budget import blocks_needed
    from kvhandoff.builtin.generate import builtin_catalog
    from kvhandoff.model import DTYPE_BYTES, kv_bytes_per_block, resolve_model
    from tools.harness.main import pair_settings
    from tools.local import local_pair

    model_dir = resolve_model(model)
    settings = pair_settings(model_dir)
    # D holds the stopped search's export while the second D reads it, then runs the
    # unmoved search: room for two W=512 searches over the longest prompt.
    dtype = settings["dtype"]
    settings["decode_overrides"] = {"kv_cache_memory_bytes": (1 + 2 * blocks_needed(
        MAX_PROMPT_TOKENS, 32, 512, 8, beam_fork=True)) * kv_bytes_per_block(
        model_dir, block_size=32, dtype_bytes=DTYPE_BYTES[dtype])}
    rows = []
    async with local_pair(model, lease_s=lease_s, fault_injection=True, second_decode=True,
                          catalogs=(("shop", str(builtin_catalog(model_dir))),),
                          **settings) as pair:
        cases = search_move_cases(quick)
        for i, case in enumerate(cases, 1):
            row = await run_case(pair, case)
            rows.append(row)
            figures = {k: v for k, v in row.items() if k not in ("case", "ok", "why")}
            print(f"  [{i}/{len(cases)}] {case.name}: {'PASS' if row['ok'] else 'FAIL'} "
                  f"{row.get('why') or ''} {json.dumps(figures)}", flush=True)
        await asyncio.sleep(0.5)
        pools = {name: await engine.wait_pool_clean(lease_s + 5.0)
                 for name, engine in (("prefill", pair.p), ("decode", pair.d),
                                      ("decode2", pair.d2))}
    clean = all(p.is_clean for p in pools.values())
    ok = clean and all(r["ok"] for r in rows)
    print(f"search moves: {sum(r['ok'] for r in rows)}/{len(rows)} cases pass; pools "
          f"{'clean' if clean else 'NOT clean: ' + str(pools)}; {'PASS' if ok else 'FAIL'}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"cases": rows, "pools_clean": clean, "ok": ok}, f, indent=1)
    return ok

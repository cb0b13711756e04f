"""The harness's cases: which parents, endings, beam widths and D cache states it runs,
and the corpus-style prompts it builds for them."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvhandoff.builtin.corpus import HISTORY_PREFIX, ITEMS

Ending = Literal["think_end", "eos", "length"]
#: ``cold``: D's prefix cache is reset before the handoff (the import reads the whole
#: parent); ``warm``: D ran the same stage 1 first, so it holds the parent's full blocks
#: and the import reads only the rest; ``fill``: the prompt is sized so the stage 2
#: needs D's whole pool, to the last block.
DState = Literal["cold", "warm", "fill"]


@dataclass(frozen=True)
class Case:
    """One harness case. The stage-1 seed is searched so stage 1 ends by ``ending``;
    with ``length`` and a ``stage1_max_tokens`` below the shortest thinking span the
    parent length is exact: N = prompt_len + stage1_max_tokens."""

    name: str
    prompt_len: int
    ending: Ending
    beam_width: int
    stage1_max_tokens: int = 48
    beam_max_tokens: int = 3
    extra_suffix_len: int = 0
    seed: int = 0
    d_state: DState = "cold"
    #: Move stage 1 from P to D after this many tokens (``run_moved``): positional
    #: sampling, exactly ``stage1_max_tokens`` stage-1 tokens (min_tokens = max_tokens).
    move_at: int | None = None
    #: Greedy stage 1 (temperature 0) instead of seeded sampling.
    greedy: bool = False
    #: False: a move case samples with vLLM's own seeded sampling (a negative control:
    #: its tokens change when moved, and the case must fail).
    positional: bool = True
    #: The move at ``move_at`` goes to another P (``run_moved_via_p``), which finishes
    #: stage 1 and exports to D, or with ``then_at`` is moved again there, to D.
    via_p: bool = False
    then_at: int | None = None
    #: The LoRA adapter both stages (and every reference) run under ("": none); the
    #: engines must serve it (``adapter_cases``).
    adapter: str = ""
    #: Stage 2 on D under this other adapter than the parent's: D must refuse the
    #: import (``connector.adapters``). Its references are that stage 2 as it would be
    #: computed under it, from token ids: what a D that accepted the import (the
    #: ``accept-any-adapter`` fault) must differ from.
    import_adapter: str | None = None
    #: The prompt's first this many tokens are a named KV chunk (``router.chunks``)
    #: pinned on P before the handoff, computed apart: stage 1 reads the chunk's full
    #: blocks from the pin and computes the rest. The ``stale`` fault then overwrites
    #: the pinned blocks instead of the export.
    chunk_tokens: int = 0

    @property
    def stage2_adapter(self) -> str:
        return self.adapter if self.import_adapter is None else self.import_adapter

    @property
    def adapters_differ(self) -> bool:
        return self.stage2_adapter != self.adapter


def default_cases(quick: bool = False, via_p: bool = False,
                  beam_width: int | None = None) -> list[Case]:
    """The harness's cases; ``via_p``: also the moves to another P (the harness then
    needs a second P); ``beam_width``: every case at that width (named ``...-wW``)."""
    # B = 32. Parent edges: N - 1 = kB - 1, kB, kB + 1 for k = 2 and k = 8.
    cases = [
        Case("n64-edge-w4", 60, "length", 4, stage1_max_tokens=4),
        Case("n65-edge-w1", 61, "length", 1, stage1_max_tokens=4),
        Case("n66-edge-w32", 62, "length", 32, stage1_max_tokens=4),
        Case("n256-edge-w32", 252, "length", 32, stage1_max_tokens=4),
        Case("n257-edge-w4", 253, "length", 4, stage1_max_tokens=4),
        Case("n258-edge-w1", 254, "length", 1, stage1_max_tokens=4),
        Case("p40-think-w4", 40, "think_end", 4),
        Case("p33-eos-w4", 33, "eos", 4),
        Case("p50-think-w4-t5", 50, "think_end", 4, beam_max_tokens=5),
        Case("p64-think-longsuffix-w4", 64, "think_end", 4, extra_suffix_len=37),
        Case("p100-think-w32-s1", 100, "think_end", 32, seed=1),
        Case("p690-think-w32", 690, "think_end", 32, seed=2),
        Case("warm-d-p200-w4", 200, "think_end", 4, d_state="warm"),
        Case("fill-d-pool-w1", 0, "length", 1, stage1_max_tokens=4, d_state="fill"),
        # A prompt that starts with a pinned chunk of 4 full blocks and 22 tokens.
        Case("chunk-p200-w4", 200, "think_end", 4, chunk_tokens=150),
        # Moves P -> D at t = 1, B - 1, B, B + 1 and a random t (B = 32), seeded and greedy.
        *(Case(f"move-at-{t}-w4", 40, "length", 4, stage1_max_tokens=48, move_at=t)
          for t in (1, 31, 32, 33, random.Random("move-at").randrange(2, 47))),
        Case("move-at-33-greedy-w4", 40, "length", 4, stage1_max_tokens=48, move_at=33,
             greedy=True),
    ]
    if via_p:
        rnd = random.Random("move-p-at").randrange(2, 40)
        cases += [
            # P -> P' at t = 1, B - 1, B, B + 1 and a random t; P' exports the parent to D.
            *(Case(f"move-p-at-{t}-w4", 40, "length", 4, stage1_max_tokens=48, move_at=t,
                   via_p=True) for t in (1, 31, 32, 33, rnd)),
            # Twice in a row: P -> P' at t, P' -> D at t2.
            *(Case(f"move-twice-{t}-{t2}-w4", 40, "length", 4, stage1_max_tokens=48,
                   move_at=t, via_p=True, then_at=t2)
              for t, t2 in ((1, 32), (31, 33), (rnd, rnd + 7))),
            Case("move-twice-32-33-greedy-w4", 40, "length", 4, stage1_max_tokens=48,
                 move_at=32, via_p=True, then_at=33, greedy=True),
        ]
    if quick:
        keep = {"n65-edge-w1", "n66-edge-w32", "p33-eos-w4", "p50-think-w4-t5",
                "p64-think-longsuffix-w4", "p690-think-w32", "warm-d-p200-w4",
                "move-at-32-w4", "move-at-33-greedy-w4", "move-p-at-33-w4",
                "move-twice-31-33-w4"}
        cases = [c for c in cases if c.name in keep]
    if beam_width is not None:
        cases = [replace(c, beam_width=beam_width,
                         name=re.sub(r"-w\d+", f"-w{beam_width}", c.name, count=1))
                 for c in cases]
    return cases


def adapter_cases() -> list[Case]:
    """Cases for engines that serve the built-in adapters a and b (``kvhandoff verify
    --adapters``): under a, under b and under none, identical to one engine under the
    same; a parent under a imported into a stage 2 under b, and under none, refused."""
    return [
        Case("lora-a-p100-w4", 100, "think_end", 4, adapter="a"),
        Case("lora-b-n66-w32", 62, "length", 32, stage1_max_tokens=4, adapter="b"),
        Case("lora-none-p64-w4", 64, "think_end", 4),
        Case("lora-a-into-b-n66-w4", 62, "length", 4, stage1_max_tokens=4, adapter="a",
             import_adapter="b"),
        Case("lora-a-into-none-p100-w4", 100, "think_end", 4, seed=1, adapter="a",
             import_adapter=""),
    ]


def fault_cases() -> list[Case]:
    """Cases every fault is run on: a parent with two full blocks and a partial one,
    one that ends exactly at a block boundary, and a long one."""
    keep = {"n66-edge-w32", "n257-edge-w4", "p100-think-w32-s1"}
    return [c for c in default_cases() if c.name in keep]


def history_prompt(length: int, key: str, tokenizer: Any) -> list[int]:
    """A corpus-like prompt of exactly ``length`` tokens (``history: items\n<think>``),
    its items drawn from ``key``: distinct per case, so no case finds another's parent
    in D's prefix cache."""
    head = tokenizer.encode(HISTORY_PREFIX, add_special_tokens=False)
    tail = tokenizer.encode("\n<think>", add_special_tokens=False)
    items = [tokenizer.encode(" " + item, add_special_tokens=False) for item in ITEMS]
    assert all(len(i) == 1 for i in items), "corpus items must be single tokens"
    rng = random.Random(key)
    num_items = length - len(head) - len(tail)
    if num_items < 2:
        raise ValueError(f"a history prompt needs at least {len(head) + len(tail) + 2} tokens")
    return head + [rng.choice(items)[0] for _ in range(num_items)] + tail

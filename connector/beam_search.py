"""One beam group's search, step by step, with vLLM's beam-search semantics.

Beam search inside the engine (``connector.beam_slots``): after stage 2's first step,
W requests ("slots") decode the group's beams side by side, one engine step per beam
step. At each step the logits processor hands this module the group's W rows of logits
(slot order = beam order, best first) and gets back, for each slot, the beam it now
continues (its parent slot) and the token to force. It is a pure function of the logits:
no vLLM state, no blocks (the scheduler copies each parent's KV into its children's
slots before the next forward).

The semantics are those of vLLM 0.32's online beam search
(``entrypoints/generate/beam_search/online.py``), which asks for ``2W`` logprobs per
beam: each row's candidates are the sampled (greedy) token and then the top ``2W`` in
``torch.topk`` order, a token listed once (the dict vLLM builds); a candidate's score is
the beam's cumulative logprob plus the token's (float32 logprob, float64 sum);
EOS-ending candidates go to ``completed``, and the W best of the others are picked by
:func:`top_candidates`, the same numpy calls, so that exact ties resolve as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def top_candidates(cum_logprobs: np.ndarray, width: int) -> np.ndarray:
    """Indices of the ``width`` candidates of highest cumulative logprob, best first,
    picked by the numpy calls vLLM's online beam search makes (vllm 0.32,
    ``entrypoints/generate/beam_search/online.py``). Neither call is stable: among
    exactly equal scores (frequent in bf16) the pick is numpy's, deterministic for a given
    array, so the same candidates in the same order give vLLM's beams, ties included."""
    if len(cum_logprobs) <= width:
        return np.argsort(-cum_logprobs)
    top = np.argpartition(-cum_logprobs, width - 1)[:width]
    return top[np.argsort(-cum_logprobs[top])]


#: A slot's parameters, every one required (``slot_spec``).
SPEC_FIELDS = ("group", "slot", "width", "steps", "cum", "eos", "ignore_eos")


def slot_spec(*, group: str, slot: int, width: int, steps: int, cum_logprob: float,
              eos_token_id: int | None, ignore_eos: bool) -> dict[str, Any]:
    """A slot's parameters (``extra_args[SLOT_KEY]``): its group, its index, the group's
    width, the beam steps it runs, the cumulative logprob of the beam it starts with, and
    the EOS rule of the search."""
    return {"group": group, "slot": slot, "width": width, "steps": steps,
            "cum": float(cum_logprob), "eos": eos_token_id, "ignore_eos": bool(ignore_eos)}


@dataclass(slots=True)
class Candidates:
    """A step's candidates in vLLM's order, flat: row by row, each row's in the order of
    its logprobs dict (``rows``, ``tokens``: int arrays; ``logprobs``: float32)."""

    rows: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray


def row_candidates(sampled: np.ndarray, sampled_logprobs: np.ndarray, top_tokens: np.ndarray,
                   top_logprobs: np.ndarray) -> Candidates:
    """The candidates vLLM's beam search reads from each row's logprobs dict: the sampled
    token first, then the top-k in order, each token once (``sampled``: [R];
    ``top_*``: [R, k])."""
    num_rows = len(sampled)
    tokens = np.concatenate((sampled[:, None], top_tokens), axis=1)
    logprobs = np.concatenate((sampled_logprobs[:, None], top_logprobs), axis=1)
    keep = np.concatenate((np.ones((num_rows, 1), dtype=bool),
                           top_tokens != sampled[:, None]), axis=1)
    rows = np.broadcast_to(np.arange(num_rows)[:, None], keep.shape)
    return Candidates(rows[keep], tokens[keep], logprobs[keep])


@dataclass(slots=True)
class Finished:
    """A beam the search returns: the slot it started in, the tokens the slots
    generated for it (after the slot's first token, which the caller knows), its
    cumulative logprob."""

    origin: int
    tokens: list[int]
    cum_logprob: float

    def to_wire(self) -> list[Any]:
        return [self.origin, self.tokens, self.cum_logprob]


@dataclass(slots=True)
class GroupSearch:
    """The state of one group's search: the live beams (one per slot, best first) and
    the completed ones, in the order vLLM appends them."""

    width: int
    steps: int  # beam steps the slots run (stage 2's max_tokens - 1)
    eos_token_id: int | None
    ignore_eos: bool
    cum_logprobs: np.ndarray  # float64 [live]
    origins: np.ndarray = field(init=False)  # int [live]
    tokens: list[list[int]] = field(init=False)
    completed: list[Finished] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        live = len(self.cum_logprobs)
        self.cum_logprobs = np.asarray(self.cum_logprobs, dtype=np.float64)
        self.origins = np.arange(live)
        self.tokens = [[] for _ in range(live)]

    @property
    def num_live(self) -> int:
        return len(self.cum_logprobs)

    @property
    def done(self) -> bool:
        return self.step >= self.steps or self.num_live == 0

    def select(self, candidates: Candidates) -> tuple[np.ndarray, np.ndarray]:
        """One beam step over the live rows' candidates: returns (parents, tokens) for
        the new live beams in slot order (``parents[j]``: the slot whose beam slot ``j``
        continues; ``tokens[j]``: the token it appends)."""
        rows, tokens = candidates.rows, candidates.tokens
        assert len(rows) == 0 or rows.max() < self.num_live, "a row past the live beams"
        cums = self.cum_logprobs[rows] + candidates.logprobs.astype(np.float64)
        eos = None if self.ignore_eos else self.eos_token_id
        if eos is not None:
            is_eos = tokens == eos
            for i in np.flatnonzero(is_eos):
                r = int(rows[i])
                self.completed.append(Finished(int(self.origins[r]), self.tokens[r] + [int(eos)],
                                               float(cums[i])))
            rows, tokens, cums = rows[~is_eos], tokens[~is_eos], cums[~is_eos]
        picked = top_candidates(cums, self.width)
        parents, new_tokens = rows[picked], tokens[picked]
        self.tokens = [self.tokens[p] + [int(t)] for p, t in zip(parents, new_tokens)]
        self.origins = self.origins[parents]
        self.cum_logprobs = cums[picked]
        self.step += 1
        return parents, new_tokens

    def result(self) -> dict[str, Any]:
        """What the search returns once done: the completed beams then the live ones, in
        vLLM's order (its final sort is stable)."""
        live = [Finished(int(o), t, float(c))
                for o, t, c in zip(self.origins, self.tokens, self.cum_logprobs)]
        return {"completed": [f.to_wire() for f in self.completed],
                "live": [f.to_wire() for f in live]}

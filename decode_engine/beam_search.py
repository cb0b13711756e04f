"""One beam group's search, step by step, with vLLM's beam-search semantics.

Beam search inside the engine (``decode_engine.beam_slots``): after stage 2's first step,
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

A search constrained to a catalog (``engine.catalog``) keeps vLLM's scores (the
model's full-vocabulary logprobs) and rules, with each beam's candidates limited to the
tokens that keep it inside the catalog (EOS only where it completes an item): each
row's ``2W`` best allowed tokens by logprob, ties by token id (:func:`catalog_candidates`),
and the W best candidates by a stable sort (ties: the earlier row, then the row's
order). vLLM has no constrained search to agree with, so its tie rules are this
module's; ``tools/harness/constrained.py`` is the reference written apart from it. A
beam that is a whole item with no token after it in the catalog and no EOS to take (EOS
ignored, or none) is complete as it is, listed before the step's EOS beams; the live
beams returned at the end are whole items only (the others are counted, dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from decode_engine.slot_spec import GroupResult, WireBeam

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.catalog import Catalog


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


def catalog_candidates(catalog: Catalog, nodes: np.ndarray,
                       logprob_of: Callable[[np.ndarray, np.ndarray], np.ndarray],
                       width: int, eos_token_id: int | None, ignore_eos: bool) -> Candidates:
    """The candidates of beams at trie ``nodes`` (row ``r`` at ``nodes[r]``): the tokens
    the catalog allows next, plus EOS where a beam completes an item (unless EOS is
    ignored); each row's ``2 * width`` of highest logprob (``logprob_of(rows, tokens)``,
    float32), ordered by logprob then token id."""
    rows, tokens = catalog.allowed(nodes)
    if eos_token_id is not None and not ignore_eos:
        ends = np.flatnonzero((nodes >= 0) & catalog.is_item[np.maximum(nodes, 0)])
        rows = np.concatenate((rows, ends))
        tokens = np.concatenate((tokens, np.full(len(ends), eos_token_id, dtype=np.int64)))
    logprobs = np.asarray(logprob_of(rows, tokens), dtype=np.float32)
    order = np.lexsort((tokens, -logprobs, rows))  # by row, best first, then token id
    rows, tokens, logprobs = rows[order], tokens[order], logprobs[order]
    starts = np.searchsorted(rows, rows)  # each row's first candidate
    keep = np.arange(len(rows)) - starts < 2 * width
    return Candidates(rows[keep], tokens[keep], logprobs[keep])


@dataclass(slots=True)
class Finished:
    """A beam the search returns: the slot it started in, the tokens the slots
    generated for it (after the slot's first token, which the caller knows), its
    cumulative logprob."""

    origin: int
    tokens: list[int]
    cum_logprob: float

    def to_wire(self) -> WireBeam:
        return (self.origin, self.tokens, self.cum_logprob)


@dataclass(slots=True)
class GroupSearch:
    """The state of one group's search: the live beams (one per slot, best first) and
    the completed ones, in the order vLLM appends them."""

    width: int
    steps: int  # beam steps the slots run (stage 2's max_tokens - 1)
    eos_token_id: int | None
    ignore_eos: bool
    cum_logprobs: np.ndarray  # float64 [live]
    #: Beams stay in this catalog (None: unconstrained).
    catalog: Catalog | None = None
    origins: np.ndarray = field(init=False)  # int [live]
    tokens: list[list[int]] = field(init=False)
    #: Constrained: each live beam's trie node.
    nodes: np.ndarray = field(init=False)
    completed: list[Finished] = field(default_factory=list)
    step: int = 0

    def __post_init__(self) -> None:
        live = len(self.cum_logprobs)
        self.cum_logprobs = np.asarray(self.cum_logprobs, dtype=np.float64)
        self.origins = np.arange(live)
        self.tokens = [[] for _ in range(live)]
        self.nodes = np.zeros(live, dtype=np.int64)

    @property
    def num_live(self) -> int:
        return len(self.cum_logprobs)

    @property
    def done(self) -> bool:
        """Every step ran, or a step left no live beam (all ended by EOS, as whole
        items, or with no candidate): nothing is left to search, and the slots end
        with this step (``decode_engine.beam_slots`` caps their ``max_tokens``)."""
        return self.step >= self.steps or (self.step > 0 and self.num_live == 0)

    def select(self, candidates: Candidates) -> tuple[np.ndarray, np.ndarray]:
        """One beam step over the live rows' candidates: returns (parents, tokens) for
        the new live beams in slot order (``parents[j]``: the slot whose beam slot ``j``
        continues; ``tokens[j]``: the token it appends)."""
        rows, tokens = candidates.rows, candidates.tokens
        assert len(rows) == 0 or rows.max() < self.num_live, "a row past the live beams"
        cums = self.cum_logprobs[rows] + candidates.logprobs.astype(np.float64)
        eos = None if self.ignore_eos else self.eos_token_id
        if self.catalog is not None and eos is None:
            # A whole item with nothing after it, and no EOS to end it by: complete.
            for r in np.flatnonzero(self.catalog.ends_here(self.nodes)):
                self.completed.append(Finished(int(self.origins[r]), list(self.tokens[r]),
                                               float(self.cum_logprobs[r])))
        if eos is not None:
            is_eos = tokens == eos
            for i in np.flatnonzero(is_eos):
                r = int(rows[i])
                self.completed.append(Finished(int(self.origins[r]), self.tokens[r] + [int(eos)],
                                               float(cums[i])))
            rows, tokens, cums = rows[~is_eos], tokens[~is_eos], cums[~is_eos]
        if self.catalog is None:
            picked = top_candidates(cums, self.width)
        else:
            picked = np.argsort(-cums, kind="stable")[:self.width]
        parents, new_tokens = rows[picked], tokens[picked]
        self.tokens = [self.tokens[p] + [int(t)] for p, t in zip(parents, new_tokens)]
        self.origins = self.origins[parents]
        self.cum_logprobs = cums[picked]
        if self.catalog is not None:
            self.nodes = self.catalog.step(self.nodes[parents], new_tokens)
        self.step += 1
        return parents, new_tokens

    def result(self, goes_on: bool = False) -> dict[str, Any]:
        """What the search returns once done: the completed beams then the live ones, in
        vLLM's order (its final sort is stable); constrained, the live beams that are
        whole items (``dropped``: how many were not), unless the search ``goes_on`` in
        other slots (every live beam)."""
        live = [Finished(int(o), t, float(c))
                for o, t, c in zip(self.origins, self.tokens, self.cum_logprobs)]
        dropped = 0
        if self.catalog is not None and not goes_on:
            whole = self.catalog.is_item[np.maximum(self.nodes, 0)] & (self.nodes >= 0)
            dropped = int((~whole).sum())
            live = [f for f, ok in zip(live, whole) if ok]
        return GroupResult(completed=[f.to_wire() for f in self.completed],
                           live=[f.to_wire() for f in live], dropped=dropped).to_wire()

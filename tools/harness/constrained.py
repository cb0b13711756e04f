"""The reference for beam search constrained to a catalog, written apart from the engine's
fast path (``engine.catalog``, ``decode_engine.beam_search``, ``decode_engine.beam_processor``).

It shares no code with it: items are a dict-of-dicts trie built here; every step asks
for each live beam's logprobs over the whole vocabulary (``next_logprobs``: one engine
request per beam per step, ``logprobs`` = the vocabulary); candidates, ranks and
selection are plain Python sorts. The rules it implements (the ones
``decode_engine.beam_search`` states):

- a beam's candidates are the tokens that keep it a prefix of an item, plus EOS where it
  is a whole item (unless EOS is ignored); each scored by its full-vocabulary logprob;
  the ``2W`` best by logprob, ties by token id;
- candidates are listed beam by beam (beams in order), each beam's best first; EOS
  candidates complete their beam; the W best of the rest by cumulative logprob, a stable
  sort (ties: listed first);
- a beam that is a whole item no item continues, with no EOS to take (ignored, or
  none), is complete as it is (listed before the step's EOS beams);
- after T steps, the live beams that are whole items join the completed ones, which are
  ranked by vLLM's score (cumulative logprob / length ** length_penalty, a stable sort)
  and the best W returned; the others are counted (``Reference.dropped``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.types import Beam, BeamParams

NextLogprobs = Callable[[list[int]], Awaitable[Sequence[float]]]


def trie_of(items: list[list[int]]) -> dict[int, Any]:
    """Nested dicts; the key ``-1`` marks the end of an item."""
    root: dict[int, Any] = {}
    for item in items:
        node = root
        for token in item:
            node = node.setdefault(token, {})
        node[-1] = {}
    return root


def read_items(path: str) -> list[list[int]]:
    return [[int(w) for w in line.split()] for line in open(path).read().splitlines()
            if line.strip() and not line.strip().startswith("#")]


@dataclass
class Reference:
    beams: list[Beam]
    #: Live beams at the last step that were not whole items (left out).
    dropped: int


async def constrained_beam_search(next_logprobs: NextLogprobs, prompt: list[int],
                                  items: list[list[int]], params: BeamParams,
                                  eos_token_id: int | None) -> Reference:
    """Beam search over ``prompt`` whose beams stay in ``items`` (module docstring)."""
    width = params.beam_width
    use_eos = eos_token_id is not None and not params.ignore_eos
    root = trie_of(items)
    live: list[tuple[list[int], float, dict[int, Any]]] = [([], 0.0, root)]
    completed: list[tuple[list[int], float]] = []
    for _ in range(params.max_tokens):
        candidates: list[tuple[list[int], float, dict[int, Any] | None]] = []
        for tokens, cum, node in live:
            allowed = [t for t in node if t != -1]
            if use_eos and -1 in node:
                allowed.append(eos_token_id)
            if not allowed:
                if -1 in node:  # a whole item nothing continues, no EOS to take
                    completed.append((tokens, cum))
                continue
            logprobs = await next_logprobs(prompt + tokens)
            ranked = sorted(allowed, key=lambda t: (-logprobs[t], t))[:2 * width]
            for t in ranked:
                nxt = None if (use_eos and t == eos_token_id) else node[t]
                candidates.append((tokens + [t], cum + float(logprobs[t]), nxt))
        live = []
        for tokens, cum, node in candidates:
            if node is None:
                completed.append((tokens, cum))
        rest = [c for c in candidates if c[2] is not None]
        live = sorted(rest, key=lambda c: -c[1])[:width]  # sorted() is stable
        if not live:
            break
    dropped = sum(-1 not in node for _, _, node in live)
    completed += [(tokens, cum) for tokens, cum, node in live if -1 in node]

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        length = len(prompt) + len(tokens) - (1 if use_eos and tokens[-1] == eos_token_id
                                              else 0)
        return cum / (max(length, 1) ** params.length_penalty)

    best = sorted(completed, key=score, reverse=True)[:width]
    return Reference([Beam(token_ids=tokens, cum_logprob=cum,
                           finish_reason="stop" if use_eos and tokens and tokens[-1] == eos_token_id
                           else "length")
                      for tokens, cum in best], dropped)


def engine_logprobs(engine: Any, vocab_size: int, request_id: str) -> NextLogprobs:
    """``next_logprobs`` from a running engine (``engine.VllmEngine``): one request per
    call, ``max_tokens=1``, logprobs over the whole vocabulary (the engine's
    ``max_logprobs`` must reach it)."""
    from vllm import SamplingParams

    calls = 0

    async def next_logprobs(tokens: list[int]) -> list[float]:
        nonlocal calls
        calls += 1
        out = await engine.generate(tokens, SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=vocab_size, detokenize=False),
            f"{request_id}-ref{calls}")
        row = out.outputs[0].logprobs[0]
        assert len(row) >= vocab_size, f"{len(row)} logprobs, not the whole vocabulary"
        values = [float("-inf")] * vocab_size
        for token, lp in row.items():
            values[token] = lp.logprob
        return values

    return next_logprobs

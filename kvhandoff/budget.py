"""The block budget of a stage 2: the one formula the router, D's server, D's scheduler
and the Ray Serve deployments count with. Light: no vLLM, no grpc.

Block arithmetic for a prompt of n tokens, block size B, beam width W, T beam tokens::

    | full blocks: n // B, shared by all beams | tail: n % B + T tokens, one per beam |
    needed = n // B + W * cdiv(n % B + T, B)

Beam search runs in W slots (``decode_engine.beam_slots``), each over ``parent + [its first
token]`` until T tokens. With beam fork on (the default), step 0's request is kept until
every slot copied its partial last block: at the slots' first step it still holds its
private block (``priv(n) = cdiv(n, B) - n // B``) beside the slots' first blocks::

    needed = n // B + max(W * cdiv(n % B + T, B),
                          priv(n) + W * (cdiv(n + 1, B) - n // B))

If the pool holds the beams without fork but not with it, the import is admitted with
fork off for that request (its output says so and the slots compute their partial block).

A search constrained to a catalog (``from_parent``) starts every slot at the parent
itself: the blocks before the one holding the parent's last token are shared, each slot
holds that one (copied from step 0's kept request with fork, computed without) and grows
its own; with fork, step 0's kept block is held beside them until the slots copied it::

    needed = (n - 1) // B + W * cdiv((n - 1) % B + 1 + T, B) [+ 1 with fork]
"""

from __future__ import annotations

import functools


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def blocks_needed(num_prompt_tokens: int, block_size: int, beam_width: int,
                  beam_max_tokens: int, beam_fork: bool = False,
                  from_parent: bool = False) -> int:
    """Blocks D must have free to import a parent and grow ``beam_width`` beams
    (``from_parent``: the slots start at the parent, fork or not: module docstring)."""
    if from_parent:
        num_full = (num_prompt_tokens - 1) // block_size
        tail = num_prompt_tokens - num_full * block_size + beam_max_tokens
        return num_full + beam_width * cdiv(tail, block_size) + (1 if beam_fork else 0)
    num_full = num_prompt_tokens // block_size
    tail = num_prompt_tokens - num_full * block_size + beam_max_tokens
    peak = beam_width * cdiv(tail, block_size)
    if beam_fork and beam_max_tokens > 1:
        kept = cdiv(num_prompt_tokens, block_size) - num_full
        first = cdiv(num_prompt_tokens + 1, block_size) - num_full
        peak = max(peak, kept + beam_width * first)
    return num_full + peak


def live_slots(beam_width: int, nodes_at_depth: list[int] | None, steps: int) -> int:
    """The slots a search of ``steps`` tokens makes: W, or for one kept in a catalog
    (``nodes_at_depth``: its trie's widths, ``Catalog.nodes_at_depth``) no more than the
    catalog can keep alive at once."""
    if nodes_at_depth is None:
        return beam_width
    return max(1, min(beam_width, max(nodes_at_depth[:steps], default=0)))


def stage2_reservation(num_prompt_tokens: int, block_size: int, beam_width: int,
                       beam_max_tokens: int, beam_fork: bool, num_total_blocks: int,
                       from_parent: bool = False) -> int:
    """Blocks a stage 2 is counted at while it runs on D: its peak with beam fork, or
    without it when that peak exceeds the whole pool (admission then turns fork off)."""
    if beam_fork:
        peak = blocks_needed(num_prompt_tokens, block_size, beam_width, beam_max_tokens, True,
                             from_parent)
        if peak <= num_total_blocks:
            return peak
    return blocks_needed(num_prompt_tokens, block_size, beam_width, beam_max_tokens,
                         from_parent=from_parent)


@functools.lru_cache(maxsize=4096)
def stage2_reservation_upto(shortest: int, longest: int, block_size: int, beam_width: int,
                            beam_max_tokens: int, beam_fork: bool, num_total_blocks: int,
                            from_parent: bool = False) -> int:
    """The most :func:`stage2_reservation` of any prompt of ``shortest`` to ``longest``
    tokens: a stage 2 whose prompt is not known yet (before stage 1 ends). Not the
    longest's: a shorter prompt can need more, when its last block is fuller and every
    beam's tail spills into one more block (3000 tokens reserve 157 blocks of 32 for 32
    beams of 16 tokens, 3008 tokens 126)."""
    return max(stage2_reservation(n, block_size, beam_width, beam_max_tokens, beam_fork,
                                  num_total_blocks, from_parent)
               for n in range(max(1, min(shortest, longest)), longest + 1))

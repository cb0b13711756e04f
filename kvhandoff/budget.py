"""The block budget of a stage 2: the one formula the router, D's server, D's scheduler
and the Ray Serve deployments count with. Light: no vLLM, no grpc.

Block arithmetic for a prompt of n tokens, block size B, beam width W, T beam tokens::

    | full blocks: n // B, shared by all beams | tail: n % B + T tokens, one per beam |
    needed = n // B + W * cdiv(n % B + T, B)

With beam fork on (the default), step k's requests (1 at step 0, then W) are kept
until step k+1's requests were scheduled. Worst case at step k+1: every kept request
still holds its private blocks (past the shared ``n // B``: ``priv(L) = cdiv(L, B) -
n // B`` for L tokens), and each new request adds the blocks past its source's full ones::

    needed = n // B + max(W * cdiv(n % B + T, B),
                          max over k of  W_k * priv(n + k)
                                         + W * (cdiv(n + k + 1, B) - (n + k) // B))

If the pool holds the beams without fork but not with it, the import is admitted with
fork off for that request (its output says so and the beam search stops keeping).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def blocks_needed(num_prompt_tokens: int, block_size: int, beam_width: int,
                  beam_max_tokens: int, beam_fork: bool = False) -> int:
    """Blocks D must have free to import a parent and grow ``beam_width`` beams."""
    num_full = num_prompt_tokens // block_size
    tail = num_prompt_tokens - num_full * block_size + beam_max_tokens
    peak = beam_width * cdiv(tail, block_size)
    if beam_fork:
        def private(num_tokens: int) -> int:
            return cdiv(num_tokens, block_size) - num_full

        for k in range(beam_max_tokens - 1):
            n = num_prompt_tokens + k
            kept = (1 if k == 0 else beam_width) * private(n)
            peak = max(peak, kept + beam_width * (cdiv(n + 1, block_size) - n // block_size))
    return num_full + peak


def stage2_reservation(num_prompt_tokens: int, block_size: int, beam_width: int,
                       beam_max_tokens: int, beam_fork: bool, num_total_blocks: int) -> int:
    """Blocks a stage 2 is counted at while it runs on D: its peak with beam fork, or
    without it when that peak exceeds the whole pool (admission then turns fork off)."""
    if beam_fork:
        peak = blocks_needed(num_prompt_tokens, block_size, beam_width, beam_max_tokens, True)
        if peak <= num_total_blocks:
            return peak
    return blocks_needed(num_prompt_tokens, block_size, beam_width, beam_max_tokens)

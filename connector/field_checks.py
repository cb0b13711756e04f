"""Every field of a handoff checked before anything uses it, signed or not.

A signature says who sent a handoff, not that it is sane: a buggy P signs whatever it
sends, and without a secret nothing is signed at all. So D (and P, for a stage 1 moved
to it) checks each field a handoff carries against its type, its own geometry and the
handoff's other fields at admission, before the READ is posted and before vLLM's
connector indexes any of it (``connector.admission``). P's pool size is what the
handoff says (``num_pool_blocks``); the worker checks the ids again against P's pool as
P's handshake gave it, before it posts the READ (``connector.nixl_worker``), and P
confirms after the READ that the blocks were the export's (``connector.liveness``).
A handoff that fails is refused with reason ``malformed`` (INVALID_ARGUMENT) and a
message naming the field; nothing a caller sends may raise anything else inside an
engine core.

The rules (N parent tokens, B P's block size, G this engine's KV cache groups):

- every :class:`~connector.handoff.Handoff` field has its declared type (``bool`` is
  not an ``int``), strings are at most ``MAX_STR`` characters, numbers finite and not
  negative (:meth:`Handoff.from_params`, before anything reads them);
- ``N >= 2`` (a prompt and one sampled token), ``N - 1 <= MAX_TOKENS``; ``B`` in
  1..:data:`MAX_BLOCK_SIZE`; ``num_blocks`` is ``ceil((N-1)/B)`` (one more allowed:
  the block P may have allocated for its last token), and ``kv_bytes_per_block`` > 0;
- the block ids: G groups (P and D serve one model), each of ``num_blocks`` ids, every
  id an ``int`` below ``num_pool_blocks`` (P's pool, at most ``2**31``), no id twice in
  a group (0, vLLM's null block, may repeat: a sliding-window group's skipped blocks);
- the transport agrees with the handoff (``remote_engine_id``, ``remote_request_id``,
  ``remote_num_tokens``), its sizes are at least 1 and at most :data:`MAX_RANKS`, its
  port is a port, its host non-empty;
- the lease: exported at most :data:`CLOCK_SKEW_S` in the future, ending at most
  ``max_lease_s`` from now (D's setting ``max_lease_s``; a lease already over is the
  later ``expired`` check's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from connector.handoff import Handoff
from kvhandoff.types import HandoffError

#: Largest parent accepted (tokens): far above any model's context, far below overflow.
MAX_TOKENS = 1 << 24
MAX_BLOCK_SIZE = 1 << 12
#: Largest tp/dcp/pp size a handoff may name.
MAX_RANKS = 1024
MAX_BLOCK_ID = (1 << 31) - 1
#: How far P's clock may run ahead of D's (exported_at in D's future).
CLOCK_SKEW_S = 60.0
#: The longest lease D accepts by default (seconds from now).
DEFAULT_MAX_LEASE_S = 3600.0


def _bad(field: str, why: str) -> HandoffError:
    return HandoffError("malformed", f"malformed handoff: {field} {why}")


def check_geometry(handoff: Handoff, params: Mapping[str, Any], *, num_groups: int,
                   now: float | None = None,
                   max_lease_s: float = DEFAULT_MAX_LEASE_S) -> None:
    """The handoff's counts, block ids, transport and lease agree with each other and
    with this engine (``num_groups`` KV cache groups); raises :class:`HandoffError`
    ("malformed") naming what does not. Call after :meth:`Handoff.from_params`."""
    n, b = handoff.num_parent_tokens, handoff.block_size
    if n < 2 or n - 1 > MAX_TOKENS:
        raise _bad("num_parent_tokens", f"is {n} (2..{MAX_TOKENS + 1})")
    if not 1 <= b <= MAX_BLOCK_SIZE:
        raise _bad("block_size", f"is {b} (1..{MAX_BLOCK_SIZE})")
    least = -(-(n - 1) // b)
    if not least <= handoff.num_blocks <= least + 1:
        raise _bad("num_blocks", f"is {handoff.num_blocks}; {n - 1} computed tokens in "
                                 f"blocks of {b} take {least}")
    if handoff.kv_bytes_per_block <= 0:
        raise _bad("kv_bytes_per_block", "is 0")
    if not 2 <= handoff.num_pool_blocks <= MAX_BLOCK_ID + 1:
        raise _bad("num_pool_blocks", f"is {handoff.num_pool_blocks}")
    _check_block_ids(params.get("remote_block_ids"), handoff.num_blocks, num_groups,
                     handoff.num_pool_blocks)
    _check_transport(handoff, params)
    _check_lease(handoff, time.time() if now is None else now, max_lease_s)


def _check_block_ids(groups: Any, num_blocks: int, num_groups: int, pool: int) -> None:
    if not isinstance(groups, (list, tuple)) or len(groups) != num_groups:
        count = len(groups) if isinstance(groups, (list, tuple)) else type(groups).__name__
        raise _bad("remote_block_ids", f"has {count} groups; this engine has {num_groups}")
    for g, group in enumerate(groups):
        if not isinstance(group, (list, tuple)) or len(group) != num_blocks:
            size = len(group) if isinstance(group, (list, tuple)) else type(group).__name__
            raise _bad("remote_block_ids", f"group {g} has {size} ids, num_blocks is "
                                           f"{num_blocks}")
        seen: set[int] = set()
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < pool:
                raise _bad("remote_block_ids", f"group {g} holds {block!r}, outside P's "
                                               f"pool of {pool} blocks")
            if block and block in seen:
                raise _bad("remote_block_ids", f"group {g} names block {block} twice")
            seen.add(block)


def _check_transport(handoff: Handoff, params: Mapping[str, Any]) -> None:
    if params.get("remote_engine_id") != handoff.engine_id:
        raise _bad("remote_engine_id", f"{params.get('remote_engine_id')!r} is not the "
                                       f"handoff's engine {handoff.engine_id!r}")
    if params.get("remote_request_id") != handoff.request_id:
        raise _bad("remote_request_id", "is not the handoff's request id")
    if not handoff.engine_id or not handoff.request_id:
        raise _bad("engine_id/request_id", "is empty")
    tokens = params.get("remote_num_tokens", handoff.num_computed_tokens)
    if tokens != handoff.num_computed_tokens:
        raise _bad("remote_num_tokens", f"is {tokens!r}, the handoff computed "
                                        f"{handoff.num_computed_tokens}")
    host = params.get("remote_host")
    if not isinstance(host, str) or not host or len(host) > 255 or "\x00" in host:
        raise _bad("remote_host", f"is {host!r}")
    port = params.get("remote_port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise _bad("remote_port", f"is {port!r}")
    for name in ("tp_size", "dcp_size", "pp_size"):
        size = params.get(name, 1)
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_RANKS:
            raise _bad(name, f"is {size!r} (1..{MAX_RANKS})")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and (isinstance(expiry, bool) or not isinstance(expiry, (int, float))
                               or not math.isfinite(expiry)):
        raise _bad("remote_blocks_expiry_time", f"is {expiry!r}")


def _check_lease(handoff: Handoff, now: float, max_lease_s: float) -> None:
    if handoff.exported_at > now + CLOCK_SKEW_S:
        raise _bad("exported_at", f"is {handoff.exported_at - now:.0f}s in this engine's "
                                  f"future (clocks may differ by {CLOCK_SKEW_S:.0f}s)")
    if handoff.lease_expires_at - now > max_lease_s:
        raise _bad("lease_expires_at", f"is {handoff.lease_expires_at - now:.0f}s away, "
                                       f"beyond the longest lease ({max_lease_s:.0f}s)")

"""A READ that costs its bytes: blocks allocated in runs, descriptors merged over runs.

vLLM's pull connector posts one NIXL descriptor per block per layer region, so a READ's
time is its descriptor count (~5 us each), not its bytes. Two halves fix that, one per
process of an engine:

- :class:`RunAllocator` (engine core, scheduler side): just before vLLM allocates the
  blocks of an import (D) or of a stage 1's prompt and output (P), it moves a run of
  free blocks with consecutive ids to the front of vLLM's free queue, so the allocation
  that follows pops them in order. It picks the run of free blocks that evicts the
  fewest cached ones (uncached blocks first), never a block this request is about to
  hit in the prefix cache.
- :func:`merge` (worker side): the READ's per-block, per-region descriptors, put in
  the order of the local addresses, are joined wherever both sides continue without
  a gap; a run of ``n`` blocks becomes one descriptor per region (per layer K and V on
  vLLM's CPU layout), or one descriptor in all on a blocks-outermost layout (every
  layer's page of a block side by side)::

      local  | b7 | b8 | b9 |       | b3 |          b7..b9 on D, from P's r20..r22:
      remote | r20| r21| r22|       | r5 |   ->     (b7, r20, 3 blocks), (b3, r5, 1 block)

The merge is exact: every byte moves from the same source to the same destination as in
vLLM's descriptors. Its negative controls (``merge-long``, ``merge-short``) are the two
ways a merge goes wrong, a run joined one block past its boundary and a run one block
short; the harness must catch both (``connector.faults``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool

logger = logging.getLogger(__name__)

#: The merge faults (``connector.faults``): a run joined across its boundary, one short.
MERGE_LONG = "merge-long"
MERGE_SHORT = "merge-short"
MERGE_FAULTS = frozenset({MERGE_LONG, MERGE_SHORT})


@dataclass(slots=True)
class Arranged:
    """What :meth:`RunAllocator.arrange` put at the front of the free queue."""

    block_ids: list[int]
    #: Runs of consecutive ids among them (1 is the goal).
    num_runs: int
    #: Cached blocks among them (evicted by the allocation that follows), and those of
    #: them the LRU order would not have evicted yet (the cost to prefix caching: each
    #: goes before an older cached block).
    num_cached: int
    num_out_of_order: int


class RunAllocator:
    """Makes vLLM's next allocation of ``n`` blocks a run of consecutive block ids.

    Owned by the connector's scheduler side; it touches only the order of vLLM's free
    queue (which blocks are free does not change, and vLLM still allocates, caches and
    frees them). Called from ``get_num_new_matched_tokens``, which vLLM calls for a
    waiting request right before ``allocate_slots``.
    """

    def __init__(self, block_pool: BlockPool):
        self._pool = block_pool

    def arrange(self, num_blocks: int, avoid_hashes: list[Any] = (),
                gap: bool = False) -> Arranged | None:
        """Put ``num_blocks`` free blocks with consecutive ids at the front of the free
        queue, in id order; ``avoid_hashes``: the block hashes this request will hit
        in the prefix cache (those blocks are left where they are). ``gap`` (the
        ``merge-long`` fault only) leaves one block out of the middle of the run, so
        the READ has a boundary to merge across. None where nothing was moved."""
        if num_blocks < 2 and not gap:
            return None
        queue = self._pool.free_block_queue
        # More than the pool has free: the first blocks in a run, vLLM's order after.
        want = min(num_blocks + (1 if gap else 0), queue.num_free_blocks)
        if want < 2:
            return None
        # One pass over the pool by id (a free block is linked in the free queue; the
        # null block never is): cheaper than walking the queue itself.
        blocks = self._pool.blocks
        is_free = np.fromiter((b.prev_free_block is not None for b in blocks), bool,
                              len(blocks))
        is_free[list(self._hit_block_ids(avoid_hashes))] = False
        free_ids = np.flatnonzero(is_free)
        cached_ids = np.fromiter((i for i in free_ids.tolist()
                                  if blocks[i].block_hash is not None), np.int64)
        ids = pick_run(free_ids, cached_ids, want)
        if ids is None:
            return None
        if gap:
            ids = ids[: want // 2] + ids[want // 2 + 1:]
        lru_next = self._lru_next(len(ids))
        chosen = [blocks[i] for i in ids]
        for block in chosen:
            queue.remove(block)
        queue.prepend_n(chosen)
        cached = [b.block_id for b in chosen if b.block_hash is not None]
        out_of_order = sum(1 for i in cached if i not in lru_next)
        return Arranged(ids, count_runs(ids), len(cached), out_of_order)

    def arrange_for(self, request: Any, block_size: int, num_computed_tokens: int,
                    num_tokens: int, gap: bool = False) -> Arranged | None:
        """:meth:`arrange` for ``request`` (a vLLM ``Request``) about to be allocated
        blocks for ``num_tokens`` tokens, of which ``num_computed_tokens`` hit the
        prefix cache (whole blocks)."""
        num_hit_blocks = num_computed_tokens // block_size
        arranged = self.arrange(-(-num_tokens // block_size) - num_hit_blocks,
                                request.block_hashes[:num_hit_blocks], gap=gap)
        if arranged is not None:
            logger.debug("%s: %d blocks in %d runs, %d of them cached (%d out of LRU "
                         "order)", request.request_id, len(arranged.block_ids),
                         arranged.num_runs, arranged.num_cached, arranged.num_out_of_order)
        return arranged

    def _lru_next(self, n: int) -> set[int]:
        """The ids of the ``n`` blocks vLLM would allocate next (the free queue's head)."""
        ids: set[int] = set()
        block = self._pool.free_block_queue.fake_free_list_head.next_free_block
        while block is not None and block.block_id >= 0 and len(ids) < n:
            ids.add(block.block_id)
            block = block.next_free_block
        return ids

    def _hit_block_ids(self, hashes: list[Any]) -> set[int]:
        hit: set[int] = set()
        for block_hash in hashes:
            blocks = self._pool.get_cached_block(block_hash, [0])
            if blocks is None:
                break
            hit.update(b.block_id for b in blocks)
        return hit



def pick_run(free_ids: np.ndarray, cached_ids: np.ndarray, n: int) -> list[int] | None:
    """``n`` ids among ``free_ids`` in as few runs of consecutive ids as possible: one
    window of ``n`` consecutive free ids if any (the one holding the fewest
    ``cached_ids``, then the lowest), else the longest runs, longest first. None when
    there are fewer than ``n`` free ids."""
    if n <= 0 or len(free_ids) < n:
        return None
    top = int(free_ids.max()) + 1
    is_free = np.zeros(top, dtype=bool)
    is_free[free_ids] = True
    # Cost per id: 0 uncached free, 1 cached free, n + 1 not free (never chosen).
    cost = np.where(is_free, 0, n + 1).astype(np.int64)
    cost[cached_ids] += 1
    if top >= n:
        total = np.concatenate(([0], np.cumsum(cost)))
        sums = total[n:] - total[:-n]
        start = int(np.argmin(sums))
        if sums[start] <= n:
            return list(range(start, start + n))
    # No window: the longest runs of free ids.
    ids = np.sort(free_ids)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    runs = sorted(np.split(ids, breaks), key=len, reverse=True)
    chosen: list[int] = []
    for run in runs:
        chosen.extend(int(i) for i in run[: n - len(chosen)])
        if len(chosen) == n:
            break
    return sorted(chosen)


def kv_layout(vllm_config: Any) -> str | None:
    """The KV layout the connector asks vLLM for, None: vLLM's NIXL choice. On CUDA,
    blocks outermost (``BLHNC``: every layer's page of a block side by side in one
    allocation), so a run of blocks is one piece for all layers and a READ one
    descriptor per run. FlashAttention takes any layout; a backend that does not take
    it makes vLLM keep its own, with a warning. Elsewhere (the CPU backend reads only
    ``LBHNC``), for MLA, or with ``kv_layout="vllm"`` in the connector's extra config:
    None. P and D decide alike (the same connector and platform); NIXL's handshake
    refuses a mismatch."""
    from vllm.platforms import current_platform

    extra = vllm_config.kv_transfer_config
    wanted = extra.get_from_extra_config("kv_layout", "auto") if extra else "auto"
    model = vllm_config.model_config
    if (wanted == "auto" and current_platform.is_cuda()
            and model is not None and not model.use_mla):
        return "BLHNC"
    return None


def count_runs(ids: list[int]) -> int:
    return 0 if not ids else 1 + sum(1 for a, b in zip(ids, ids[1:]) if b != a + 1)


@dataclass(slots=True)
class Merged:
    """A READ's merged descriptors: ``local[i]`` is read from ``remote[i]``."""

    local: np.ndarray
    remote: np.ndarray
    #: Whether the fault asked for took effect, and the destination ranges it left
    #: unread, ``(address, length)``.
    took: bool = False
    unread: list[tuple[int, int]] = field(default_factory=list)

    @property
    def unread_bytes(self) -> int:
        return sum(length for _, length in self.unread)


def merge(local: np.ndarray, remote: np.ndarray, fault: str | None = None) -> Merged:
    """Join a READ's descriptors over runs. ``local``, ``remote``: ``(k, 3)`` arrays of
    ``(address, length, device)``, row ``i`` of one read into row ``i`` of the other
    (vLLM's descriptors for the READ, any order). Returns the merged pair, in the
    order of the local addresses, and what ``fault`` did:

    - ``merge-long``: the first boundary (one where the local side jumps, if any) is
      ignored, so the pieces after it are read as if the run went on (each into its
      neighbour's destination, the last one's destination left unread); without a
      boundary it does nothing (reading past the run would write a block that is not
      this READ's, perhaps another request's);
    - ``merge-short``: the first run is one piece shorter, so that piece is never read.
    """
    assert local.shape == remote.shape and local.shape[1:] == (3,), "descriptor pairs"
    if len(local) == 0:
        return Merged(local, remote)
    order = np.argsort(local[:, 0], kind="stable")
    la, ra = local[order], remote[order]
    length = la[:, 1]
    # A new run starts where either side does not continue the previous piece.
    starts = np.ones(len(la), dtype=bool)
    local_jumps = (la[:-1, 0] + length[:-1] != la[1:, 0]) | (la[:-1, 2] != la[1:, 2])
    starts[1:] = (local_jumps
                  | (ra[:-1, 0] + length[:-1] != ra[1:, 0])
                  | (la[:-1, 2] != la[1:, 2]) | (ra[:-1, 2] != ra[1:, 2]))
    out = Merged(la, ra)
    if fault == MERGE_LONG:
        # A boundary where D's side jumps (D allocates the import with a gap for it):
        # there the joined run leaves a destination unread. Joined where only P's side
        # jumps, the run reads P's next block, which may hold the very same KV (an
        # earlier export of the same tokens), and the fault would not show.
        boundaries = np.flatnonzero(starts[1:] & local_jumps) + 1
        if not len(boundaries):
            boundaries = np.flatnonzero(starts[1:]) + 1
        if len(boundaries):
            starts[boundaries[0]] = False
            out.took = True
            # The joined run covers as many bytes from its start as its pieces hold:
            # the pieces it no longer reaches are left unread.
            first_run = np.flatnonzero(starts)
            s = first_run[first_run < boundaries[0]][-1]
            later = first_run[first_run > boundaries[0]]
            e = later[0] if len(later) else len(la)
            end = la[s, 0] + length[s:e].sum()
            out.unread.extend((int(a), int(n)) for a, n, _ in la[s:e].tolist()
                              if a + n > end)
    first = np.flatnonzero(starts)
    sizes = np.add.reduceat(length, first)
    out.local = la[first].copy()
    out.remote = ra[first].copy()
    out.local[:, 1] = out.remote[:, 1] = sizes
    if fault == MERGE_SHORT:
        # The first run's last piece.
        last = (first[1] if len(first) > 1 else len(la)) - 1
        out.local[0, 1] -= length[last]
        out.remote[0, 1] -= length[last]
        out.took = True
        out.unread.append((int(la[last, 0]), int(length[last])))
        if out.local[0, 1] == 0:
            out.local, out.remote = out.local[1:], out.remote[1:]
    return out


def fill_host_bytes(address: int, length: int, value: int = 0x3C) -> None:
    """Overwrite ``length`` bytes of this process's host memory (a merge fault's unread
    destination): ``0x3C`` bytes read as small finite floats in fp32, bf16 and fp16."""
    ctypes.memset(address, value, length)

"""connector.runs without engines: runs picked from a free pool, vLLM's free queue
reordered, descriptors merged exactly, and the two merge faults."""

from __future__ import annotations

import numpy as np
import pytest
from vllm.v1.core.block_pool import BlockPool

from connector.runs import MERGE_LONG, MERGE_SHORT, RunAllocator, count_runs, merge, pick_run

PIECE = 64 * 1024


def _rows(base: int, block_ids: list[int], regions: int = 3, region_bytes: int = 1 << 30,
          piece: int = PIECE) -> np.ndarray:
    """vLLM's descriptors of ``block_ids``: one per block per region, region-major."""
    return np.array([(base + r * region_bytes + b * piece, piece, 0)
                     for r in range(regions) for b in block_ids], dtype=np.uint64)


def _bytes_moved(local: np.ndarray, remote: np.ndarray) -> dict[int, int]:
    """Destination byte offset (in pieces) -> source, for every piece of a READ."""
    moved: dict[int, int] = {}
    for (la, n, _), (ra, _, _) in zip(local.tolist(), remote.tolist()):
        for k in range(n // PIECE):
            assert la + k * PIECE not in moved, "a destination written twice"
            moved[la + k * PIECE] = ra + k * PIECE
    return moved


@pytest.mark.parametrize("local_ids,remote_ids,expected", [
    ([7, 8, 9], [20, 21, 22], 3),            # one run each side: one per region
    ([7, 8, 9, 3], [20, 21, 22, 5], 6),      # two runs
    ([7, 8, 9], [20, 22, 23], 6),            # D contiguous, P not
    ([5, 1, 9], [2, 4, 6], 9),               # nothing to merge
])
def test_merge_moves_the_same_bytes_in_fewer_descriptors(local_ids, remote_ids, expected):
    local, remote = _rows(1 << 40, local_ids), _rows(2 << 40, remote_ids)
    merged = merge(local, remote)
    assert len(merged.local) == expected and not merged.took
    assert _bytes_moved(merged.local, merged.remote) == _bytes_moved(local, remote)


def test_merge_joins_layers_of_a_blocks_outermost_layout():
    """Every layer's page of a block side by side (vLLM's BLHNC): a run of blocks is one
    descriptor across all layers."""
    layers, row = 4, 4 * PIECE

    def rows(base, ids):
        return np.array([(base + b * row + layer * PIECE, PIECE, 0)
                         for layer in range(layers) for b in ids], dtype=np.uint64)
    local, remote = rows(1 << 40, [10, 11, 12, 13]), rows(2 << 40, [3, 4, 5, 6])
    merged = merge(local, remote)
    assert len(merged.local) == 1 and int(merged.local[0, 1]) == 16 * PIECE
    assert _bytes_moved(merged.local, merged.remote) == _bytes_moved(local, remote)


def test_merge_long_reads_one_piece_from_the_wrong_place():
    local, remote = _rows(1 << 40, [7, 8, 10, 11]), _rows(2 << 40, [20, 21, 22, 23])
    good = _bytes_moved(local, remote)
    merged = merge(local, remote, MERGE_LONG)
    assert merged.took and merged.unread_bytes == PIECE
    bad = _bytes_moved(merged.local, merged.remote)
    unread = merged.unread[0][0]
    assert unread in good and unread not in bad           # a destination left unread
    assert len(set(bad) - set(good)) == 1                 # one piece written elsewhere
    assert sum(bad[k] != good[k] for k in set(bad) & set(good)) == 1  # one from elsewhere
    # Without a boundary it does nothing: past the run lies a block of another READ.
    one_run = merge(_rows(1 << 40, [7, 8], regions=1), _rows(2 << 40, [1, 2], regions=1),
                    MERGE_LONG)
    assert not one_run.took and not one_run.unread


def test_merge_long_joins_where_ds_side_jumps():
    """Joined where only P's side jumps, the run would read P's next block, which may
    hold the same KV (an earlier export of the same tokens): the fault prefers the
    boundary where D's side jumps, which always leaves a destination unread."""
    local, remote = _rows(1 << 40, [7, 8, 9, 11], regions=1), _rows(2 << 40, [20, 30, 31, 32],
                                                                      regions=1)
    merged = merge(local, remote, MERGE_LONG)
    assert merged.took and merged.unread == [(int(local[3, 0]), PIECE)]


def test_merge_short_leaves_one_piece_unread():
    local, remote = _rows(1 << 40, [7, 8, 9]), _rows(2 << 40, [1, 2, 3])
    good = _bytes_moved(local, remote)
    merged = merge(local, remote, MERGE_SHORT)
    bad = _bytes_moved(merged.local, merged.remote)
    assert merged.took and set(good) - set(bad) == {merged.unread[0][0]}
    assert all(bad[k] == good[k] for k in bad)
    single = merge(_rows(1 << 40, [7], regions=1), _rows(2 << 40, [1], regions=1), MERGE_SHORT)
    assert single.took and len(single.local) == 0


def test_pick_run_prefers_a_window_without_cached_blocks():
    free = np.array([1, 2, 3, 4, 6, 7, 8, 9, 10, 12])
    assert pick_run(free, np.array([2]), 3) == [6, 7, 8]
    assert pick_run(free, np.array([], dtype=np.int64), 4) == [1, 2, 3, 4]
    # All windows hold a cached block: the one with fewest, then the lowest.
    assert pick_run(free, np.array([3, 8]), 4) == [1, 2, 3, 4]
    # No window of 6 free ids: the longest runs, longest first.
    assert pick_run(free, np.array([], dtype=np.int64), 6) == [1, 6, 7, 8, 9, 10]
    assert pick_run(free, np.array([], dtype=np.int64), 11) is None
    assert count_runs([1, 6, 7, 8, 9, 10]) == 2


def _pool(num_blocks: int = 32) -> BlockPool:
    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def test_allocator_makes_the_next_allocation_one_run():
    pool = _pool()
    # Churn: free blocks come back shuffled, as in a pool after a while.
    blocks = pool.get_new_blocks(24)
    order = np.random.default_rng(0).permutation(len(blocks))
    pool.free_blocks([blocks[i] for i in order])
    assert count_runs([b.block_id for b in pool.get_new_blocks(8)]) > 1
    arranged = RunAllocator(pool).arrange(8)
    assert arranged is not None and arranged.num_runs == 1 and arranged.num_cached == 0
    assert arranged.num_out_of_order == 0
    got = [b.block_id for b in pool.get_new_blocks(8)]
    assert got == arranged.block_ids and count_runs(got) == 1


def test_allocator_gap_for_the_merge_long_fault():
    pool = _pool()
    arranged = RunAllocator(pool).arrange(6, gap=True)
    assert arranged is not None and arranged.num_runs == 2 and len(arranged.block_ids) == 6
    assert [b.block_id for b in pool.get_new_blocks(6)] == arranged.block_ids


def _config(use_mla: bool = False, **extra):
    from types import SimpleNamespace

    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(get_from_extra_config=lambda k, d: extra.get(k, d)),
        model_config=SimpleNamespace(use_mla=use_mla))


def test_the_connector_asks_for_blocks_outermost_on_cuda(monkeypatch):
    """On CUDA the connector asks vLLM for BLHNC (a run of blocks one piece for all
    layers), which vLLM's CUDA FlashAttention accepts (it declares no layouts, so vLLM's
    default preference applies, BLHNC in it); on CPU, whose attention reads only LBHNC,
    and with ``kv_layout="vllm"`` or MLA, vLLM's NIXL choice."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from connector.nixl_continuation import ContinuationConnector

    assert ContinuationConnector.get_required_kvcache_layout(_config()) == "LBHNC"
    assert get_supported_kv_cache_layouts([CPUAttentionBackend]) == [KVCacheLayout.LBHNC]
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    assert ContinuationConnector.get_required_kvcache_layout(_config()) == "BLHNC"
    assert FlashAttentionBackend.supported_kv_cache_layouts() is None
    assert KVCacheLayout.BLHNC in get_supported_kv_cache_layouts([FlashAttentionBackend])
    assert ContinuationConnector.get_required_kvcache_layout(_config(kv_layout="vllm")) == "LBHNC"
    assert ContinuationConnector.get_required_kvcache_layout(_config(use_mla=True)) is None

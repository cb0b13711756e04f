"""What each engine's prefix cache holds, as the router knows it from vLLM's KV events.

Every engine publishes vLLM's KV-cache events (``KVEventsConfig``, ZMQ PUB with a replay
ROUTER; ``engine.config``): ``BlockStored`` (a run of full blocks: their token ids, the
engine's hashes, its parent block's hash), ``BlockRemoved`` (hashes) and
``AllBlocksCleared``. The router keeps one :class:`BlockIndex` per engine, keyed by its
*own* chained key of each block's tokens (:func:`prefix_keys`: no hash seed is shared
with the engines), and asks it how many leading blocks of a prompt the engine holds.

The index is a hint, never an answer: a block it lists may be gone by the time a
request lands (the engine recomputes what it lacks), and a block it misses costs only a
better placement. It is bounded (``max_blocks``; the oldest stored blocks are forgotten
first, counted) and cleared whenever it cannot be trusted (``router.cache_feed.EventFeed``:
a gap in the sequence numbers that the replay cannot fill, an engine restart, a batch it
cannot read).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def prefix_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None
                ) -> list[int]:
    """The router's key of each full block of ``token_ids``: chained, so a key names the
    whole prefix up to its block; ``adapter`` (a LoRA's name) keeps adapters apart."""
    keys: list[int] = []
    key = hash(("kvhandoff", adapter))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, tuple(token_ids[start:start + block_size])))
        keys.append(key)
    return keys


@dataclass
class IndexStats:
    stored: int = 0
    removed: int = 0
    #: Stored blocks whose parent the index did not know (its events were missed).
    orphans: int = 0
    #: Blocks forgotten to stay within ``max_blocks``.
    evicted: int = 0
    clears: int = 0


class BlockIndex:
    """One engine's blocks (module docstring). Not thread-safe: one owner."""

    def __init__(self, block_size: int, max_blocks: int):
        self.block_size = block_size
        self.max_blocks = max_blocks
        # engine hash -> router key, oldest first; a key may have several engine hashes
        # (the same prefix stored twice), so keys are counted.
        self._by_hash: OrderedDict[object, int] = OrderedDict()
        self._keys: dict[int, int] = {}
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._by_hash)

    def store(self, parent_hash: object | None, block_hashes: Sequence[object],
              token_ids: Sequence[int], adapter: str | None = None) -> None:
        """A ``BlockStored`` event: ``block_hashes[i]`` holds
        ``token_ids[i * B:(i + 1) * B]``, after the block ``parent_hash`` (None: the
        first block of a prompt)."""
        if parent_hash is None:
            key = hash(("kvhandoff", adapter))
        else:
            parent = self._by_hash.get(parent_hash)
            if parent is None:
                self.stats.orphans += len(block_hashes)
                return
            key = parent
        size = self.block_size
        for i, engine_hash in enumerate(block_hashes):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            if len(tokens) < size:
                break
            key = hash((key, tokens))
            self._put(engine_hash, key)
            self.stats.stored += 1
        while len(self._by_hash) > self.max_blocks:
            _, old = self._by_hash.popitem(last=False)
            self._drop(old)
            self.stats.evicted += 1

    def _put(self, engine_hash: object, key: int) -> None:
        old = self._by_hash.pop(engine_hash, None)
        if old is not None:
            self._drop(old)
        self._by_hash[engine_hash] = key
        self._keys[key] = self._keys.get(key, 0) + 1

    def _drop(self, key: int) -> None:
        left = self._keys[key] - 1
        if left:
            self._keys[key] = left
        else:
            del self._keys[key]

    def remove(self, block_hashes: Iterable[object]) -> None:
        """A ``BlockRemoved`` event."""
        for engine_hash in block_hashes:
            key = self._by_hash.pop(engine_hash, None)
            if key is not None:
                self._drop(key)
                self.stats.removed += 1

    def clear(self) -> None:
        """``AllBlocksCleared``, or an index that can no longer be trusted."""
        self._by_hash.clear()
        self._keys.clear()
        self.stats.clears += 1

    def cached_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its :func:`prefix_keys`) the engine
        holds."""
        for i, key in enumerate(keys):
            if key not in self._keys:
                return i
        return len(keys)

"""The chunk registry: the named KV chunks a router knows, by id, and the tree they make
(a chunk registered under another). :class:`ChunkStore` is what ``router.chunks`` needs
of it; :class:`ChunkRegistry` keeps it in this process (another store, shared by
several routers, may stand in)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from router.endpoint import Endpoint
from router.requests import Chunk


@dataclass
class ChunkRecord:
    chunk_id: str
    #: The chunk it extends ("": a root).
    under: str
    #: Its own tokens, and the chain's through it.
    token_ids: list[int]
    chain_ids: list[int]
    adapter: str
    prefill: Endpoint
    #: The engine behind ``prefill`` that holds it, and its name there.
    engine_id: str = ""
    held_name: str = ""
    #: Blocks it holds beyond its chain's (what it counts against the share).
    num_blocks: int = 0
    children: set[str] = field(default_factory=set)
    uses: int = 0
    #: Running requests that compose it now (never evicted or deleted meanwhile).
    in_use: int = 0
    last_used: float = field(default_factory=time.time)
    prefill_ms: float = 0.0
    num_cached_tokens: int = 0
    #: Until P has prefilled and holds it: not composable, not evictable.
    ready: bool = False

    def as_chunk(self) -> Chunk:
        """The chunk as the API answers it (RegisterChunk, ListChunks)."""
        return Chunk(chunk_id=self.chunk_id, under=self.under, token_ids=self.token_ids,
                     num_chain_tokens=len(self.chain_ids), num_blocks=self.num_blocks,
                     prefill_endpoint=self.prefill.address, adapter=self.adapter,
                     uses=self.uses, last_used=self.last_used, prefill_ms=self.prefill_ms,
                     num_cached_tokens=self.num_cached_tokens)


class ChunkStore(Protocol):
    """The chunks by id. Every method answers at once (no await): ``router.chunks``
    relies on no other request running between a check and its write (room made and
    the new chunk added)."""

    def __contains__(self, chunk_id: str) -> bool: ...

    def find(self, chunk_id: str) -> ChunkRecord | None:
        """The chunk named so, ready or still registering (None: none)."""
        ...

    def values(self) -> list[ChunkRecord]:
        """Every chunk, ready or still registering, in the order they were added."""
        ...

    def add(self, record: ChunkRecord) -> None:
        """Add ``record`` (its id unused), listed as a child of the chunk it is under."""
        ...

    def forget(self, records: list[ChunkRecord]) -> None:
        """Drop these chunks (those still here), and their links from their parents."""
        ...

    def chain(self, record: ChunkRecord | None) -> list[ChunkRecord]:
        """``record`` and the chunks it is under, up to its root (leaf first)."""
        ...

    def subtree(self, record: ChunkRecord) -> list[ChunkRecord]:
        """``record`` and every chunk under it, breadth first."""
        ...


class ChunkRegistry:
    """:class:`ChunkStore` in this process: a dict."""

    def __init__(self) -> None:
        self._records: dict[str, ChunkRecord] = {}

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._records

    def find(self, chunk_id: str) -> ChunkRecord | None:
        return self._records.get(chunk_id)

    def values(self) -> list[ChunkRecord]:
        return list(self._records.values())

    def add(self, record: ChunkRecord) -> None:
        self._records[record.chunk_id] = record
        if record.under in self._records:
            self._records[record.under].children.add(record.chunk_id)

    def forget(self, records: list[ChunkRecord]) -> None:
        for r in records:
            if self._records.get(r.chunk_id) is r:
                del self._records[r.chunk_id]
            if r.under in self._records:
                self._records[r.under].children.discard(r.chunk_id)

    def chain(self, record: ChunkRecord | None) -> list[ChunkRecord]:
        chain = []
        while record is not None:
            chain.append(record)
            record = self._records.get(record.under) if record.under else None
        return chain

    def subtree(self, record: ChunkRecord) -> list[ChunkRecord]:
        out, todo = [], [record]
        while todo:
            r = todo.pop(0)
            out.append(r)
            todo.extend(self._records[c] for c in sorted(r.children) if c in self._records)
        return out

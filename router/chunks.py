"""Named KV chunks (Router.RegisterChunk, ListChunks, DeleteChunk; a request's
``chunk_ids``).

A chunk is token ids prefilled once on a P, which then holds its blocks pinned (no
lease ends them) until the chunk is deleted or evicted. Registered *under* another
chunk, its tokens follow that chunk's chain, on the same P: the chain is an exact
prefix. A request whose ``chunk_ids`` name a chain (root first) starts with the chain's
tokens and runs on the chain's P, where its full blocks are prefix-cache hits (held
blocks are never evicted): P computes only the chain's partial last block and what
follows. That is what standard generation of the same tokens computes with prefix
caching, token for token (``tests/test_chunks.py`` compares them). Chunks prefilled
apart are composed by position only where a request asks for an approximate composition
(``router.composition``); otherwise such ids are refused as "not a chain".

Room: the chunks on one P hold at most ``RouterConfig.chunk_pool_share`` of its blocks.
A chunk that would not fit evicts the least recently used chunks first: leaves only (a
chunk others are registered under stays while they do), never one a running request
composes or the new chunk's own chain. One that finds the share held by chunks in use:
RESOURCE_EXHAUSTED (a retry may find room); one larger than the share alone:
INVALID_ARGUMENT (it never fits).

Who owns the blocks: P, under the chunk's held name (``chunk-<namespace>-...``), until
the router's Release (delete, eviction, or at its next start: every chunk under its
namespace, which a router that died left pinned). Deleting a chunk deletes those
registered under it. If the chunk's P leaves rotation, requests composing it run on
another P, which computes the chain (the same tokens; ``num_cached_prompt_tokens`` says
so).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import re
import time
from collections.abc import Iterator

import grpc

from kvhandoff.model import ModelTokens
from kvhandoff.types import BeamParams, InvalidRequest, Path, Stage1Params, validate_prompt
from router.chunk_registry import ChunkRecord, ChunkRegistry, ChunkStore
from router.composition import Composition, approximate, check_adapter, is_chain
from router.config import RouterConfig
from router.endpoint import Endpoint
from router.errors import grpc_error
from router.pin_releases import PinReleases
from router.plan import CHUNK_PREFIX, Outcome, Plan, ids_of
from router.pool import EnginePool
from router.requests import ChunkCall, ChunkListing
from router.stages import StageCalls

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class Chunks:
    def __init__(self, config: RouterConfig, tokens: ModelTokens, pool: EnginePool,
                 stages: StageCalls, store: ChunkStore | None = None):
        self.config, self.tokens, self.pool, self.stages = config, tokens, pool, stages
        #: The chunks by id (``router.chunk_registry``).
        self.store: ChunkStore = store if store is not None else ChunkRegistry()
        self._ids = itertools.count()
        #: Chunks evicted to make room, and requests that composed chunks, since the start.
        self.evictions = 0
        self.compositions = 0
        #: Chunks forgotten because their P restarted.
        self.lost = 0
        #: Ending P's pins, now, again after a failure, and at the process's start.
        self.releases = PinReleases(stages, f"{CHUNK_PREFIX}{config.chunk_namespace}-")

    @property
    def prefix(self) -> str:
        return self.releases.prefix

    def hold_registrations(self) -> None:
        self.releases.hold_registrations()

    async def release_leftovers(self) -> None:
        """At the router's start: see :meth:`PinReleases.release_leftovers`."""
        await self.releases.release_leftovers(self.pool.prefill)

    # ---- reading ------------------------------------------------------------------------
    def get(self, chunk_id: str) -> ChunkRecord:
        self._forget_restarted()
        record = self.store.find(chunk_id)
        if record is None or not record.ready:
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"chunk {chunk_id!r} is unknown here (never registered, "
                             "deleted, evicted, or its registration still runs)")
        return record

    def records(self) -> list[ChunkRecord]:
        self._forget_restarted()
        return [r for r in self.store.values() if r.ready]

    def _forget_restarted(self) -> None:
        """Chunks whose P restarted since (its engine id changed: their blocks went
        with it) are forgotten; a request naming one gets NOT_FOUND, as after a delete.
        Only where an endpoint is one engine (not a Serve deployment's replicas)."""
        lost = [r for r in self.store.values()
                if r.ready and r.prefill.one_engine and r.prefill.capacity is not None
                and r.prefill.capacity.engine_id != r.engine_id]
        for r in sorted(lost, key=lambda r: len(r.chain_ids), reverse=True):
            self.store.forget([r])
        if lost:
            self.lost += len(lost)
            logger.warning("chunks lost with their P's restart: %s",
                           ", ".join(r.chunk_id for r in lost))

    def listing(self) -> ChunkListing:
        """ListChunks' answer."""
        return ChunkListing([r.as_chunk() for r in self.records()],
                         {ep.address: self.held_blocks(ep) for ep in self.pool.prefill},
                         {ep.address: self.share_blocks(ep) for ep in self.pool.prefill},
                         self.evictions)

    def held_blocks(self, ep: Endpoint) -> int:
        """Blocks the chunks on ``ep`` hold: registered, being registered, or forgotten
        with their Release still to reach P."""
        self._forget_restarted()
        return sum(r.num_blocks for r in [*self.store.values(),
                                          *self.releases.unreleased(ep)]
                   if r.prefill is ep)

    def share_blocks(self, ep: Endpoint) -> int:
        total = ep.capacity.num_total_blocks if ep.capacity is not None else 0
        return int(total * self.config.chunk_pool_share)

    def compose(self, chunk_ids: tuple[str, ...], adapter: str,
                recompute_share: float | None = None) -> Composition:
        """The chain ``chunk_ids`` name, root first; with ``recompute_share``, the
        chunks in that order composed approximately unless they are such a chain
        (``router.composition``); the status that says why not."""
        chain = tuple(self.get(c) for c in chunk_ids)
        if recompute_share is not None and not is_chain(chain):
            return approximate(chain, recompute_share, adapter)
        for i, record in enumerate(chain):
            expected = chain[i - 1].chunk_id if i else ""
            if record.under != expected:
                raise grpc_error(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"chunk_ids are not a registered chain: {record.chunk_id!r} is "
                    + (f"registered under {record.under!r}" if record.under
                       else "a root") + (f", not under {expected!r}" if expected
                                         else ": list its chain from the root")
                    + " (chunks prefilled apart are composed only approximately: "
                      "register each under the one before it, or ask for approximate)")
        if chain:
            check_adapter(chain[-1], adapter)
        return Composition(chain)

    @contextlib.contextmanager
    def using(self, chunk_ids: tuple[str, ...]) -> Iterator[None]:
        """Marks the chunks a request composes in use while it runs (those deleted
        since it was planned are not: its stage 1 then computes them)."""
        chain = [self.store.find(c) for c in chunk_ids if c in self.store]
        self.compositions += bool(chunk_ids)
        now = time.time()
        for r in chain:
            r.in_use += 1
            r.uses += 1
            r.last_used = now
        try:
            yield
        finally:
            for r in chain:
                r.in_use -= 1

    # ---- registering, deleting ----------------------------------------------------------
    async def register(self, call: ChunkCall, deadline: float | None) -> ChunkRecord:
        """Prefill ``call``'s tokens (after its chain's) on a P, which holds them until
        deleted or evicted."""
        chunk_id = call.chunk_id or f"chunk-{next(self._ids)}"
        if not _NAME.fullmatch(chunk_id):
            raise InvalidRequest("chunk_id", "use 1 to 128 of [A-Za-z0-9._:-]")
        if chunk_id in self.store:
            raise grpc_error(grpc.StatusCode.ALREADY_EXISTS,
                             f"chunk {chunk_id!r} exists: delete it first, or pick another "
                             "name")
        if call.fault and call.fault != "stale":
            raise InvalidRequest("fault", f"a chunk takes only the 'stale' fault (its held "
                                          f"blocks overwritten), not {call.fault!r}")
        if call.tokens is None:
            raise InvalidRequest("tokens", "set text or token_ids")
        own = ids_of(self.tokens, call.tokens, "text" if isinstance(call.tokens, str)
                     else "token_ids")
        if not own:
            raise InvalidRequest("tokens", "is empty")
        parent = self.get(call.under) if call.under else None
        if parent is not None:
            check_adapter(parent, call.adapter, under=True)
        chain_ids = (parent.chain_ids if parent else []) + own
        p = parent.prefill if parent is not None else await self.pool.pick_prefill(
            deadline, prompt_ids=chain_ids, adapter=call.adapter)
        await self.releases.started.wait()  # an earlier run's leftovers released first
        if chunk_id in self.store:  # registered meanwhile
            raise grpc_error(grpc.StatusCode.ALREADY_EXISTS,
                             f"chunk {chunk_id!r} exists: delete it first, or pick another "
                             "name")
        if parent is not None and self.store.find(parent.chunk_id) is not parent:
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"chunk {parent.chunk_id!r} was deleted or evicted meanwhile")
        cap = p.capacity
        if cap is not None:
            validate_prompt(chain_ids, vocab_size=cap.vocab_size,
                            max_model_len=cap.max_model_len, num_new_tokens=1)
        record = ChunkRecord(chunk_id, call.under, own, chain_ids, call.adapter, p,
                             held_name=f"{self.prefix}{next(self._ids)}-{chunk_id}")
        if cap is not None:
            below = len(parent.chain_ids) // cap.block_size if parent is not None else 0
            record.num_blocks = math.ceil(len(chain_ids) / cap.block_size) - below
        # Room made and this chunk counted with no await between: registrations running
        # at once cannot take the same room.
        evicted = self._make_room(p, record,
                                  keep={c.chunk_id for c in self.store.chain(parent)})
        self.store.add(record)
        try:
            await self.releases.release(p, evicted)
            await self._prefill(record, deadline, call.fault)
        except BaseException:
            self.store.forget([record])
            # It may be held already (the client went away after P finished), or held
            # after this Release reaches P (the prefill still finishing there): ended now,
            # and named again with the next release on that P.
            with contextlib.suppress(Exception):
                await self.releases.release(p, [record])
            self.releases.once_more(p, record)
            raise
        logger.info("chunk %s registered on %s: %d tokens (chain %d), %d blocks, %d cached",
                    chunk_id, p.address, len(own), len(chain_ids), record.num_blocks,
                    record.num_cached_tokens)
        return record

    async def delete(self, chunk_id: str) -> list[str]:
        """Delete ``chunk_id`` and the chunks under it; P frees their blocks now."""
        record = self.get(chunk_id)
        subtree = self.store.subtree(record)
        busy = [r.chunk_id for r in subtree if r.in_use or not r.ready]
        if busy:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"chunk {chunk_id!r} cannot be deleted now: {busy} in use by "
                             "running requests or registrations")
        self.store.forget(subtree)
        await self.releases.release(record.prefill, subtree)
        logger.info("chunks deleted: %s", ", ".join(r.chunk_id for r in subtree))
        return [r.chunk_id for r in subtree]

    async def _prefill(self, record: ChunkRecord, deadline: float | None, fault: str) -> None:
        t0 = time.perf_counter()
        plan = Plan(record.held_name, record.chain_ids, [], Stage1Params(max_tokens=1),
                    BeamParams(beam_width=1, max_tokens=1), Path.COLOCATED, deadline,
                    fault=fault, adapter=record.adapter)
        out = Outcome(plan, record.prefill.address, None)
        async for _ in self.stages.stage1(record.prefill, None, plan, out, export=False,
                                          hold=True, pin=True,
                                          request_id=record.held_name):
            pass
        if not out.held_until:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"{record.prefill.address} did not hold chunk "
                             f"{record.chunk_id!r} (it runs without beam fork)")
        record.engine_id = out.stage1_engine_id
        record.num_cached_tokens = out.cached_prompt_tokens
        record.prefill_ms = (time.perf_counter() - t0) * 1e3
        record.ready = True

    def _make_room(self, p: Endpoint, record: ChunkRecord, keep: set[str]
                   ) -> list[ChunkRecord]:
        """The chunks to evict so ``record`` fits in ``p``'s share (forgotten now), or
        RESOURCE_EXHAUSTED."""
        share = self.share_blocks(p)
        if p.capacity is None:
            return []
        if record.num_blocks > share:  # never fits: not a retry's to fix
            raise grpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                             f"chunk {record.chunk_id!r} needs {record.num_blocks} blocks; "
                             f"chunks may hold {share} of {p.address}'s "
                             f"{p.capacity.num_total_blocks} (--chunk-pool-share "
                             f"{self.config.chunk_pool_share:g})")
        held = self.held_blocks(p)
        candidates = sorted((r for r in self.store.values()
                             if r.prefill is p and r.ready and not r.children
                             and not r.in_use and r.chunk_id not in keep),
                            key=lambda r: r.last_used)
        evicted: list[ChunkRecord] = []
        while held + record.num_blocks > share and candidates:
            victim = candidates.pop(0)
            evicted.append(victim)
            held -= victim.num_blocks
        if held + record.num_blocks > share:
            raise grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"chunk {record.chunk_id!r} needs {record.num_blocks} blocks "
                             f"and the chunks on {p.address} that may not be evicted (in "
                             f"use, or with chunks under them) hold {held} of the {share} "
                             "chunks may hold")
        if evicted:
            logger.info("evicting chunks for %s: %s", record.chunk_id,
                        ", ".join(r.chunk_id for r in evicted))
            self.evictions += len(evicted)
            self.store.forget(evicted)
        return evicted

"""The router's engines, wired from their parts: their snapshots and rotation
(``router.snapshots``), the claims and wait queue through which requests get room on a
D (``router.decode_queue``), and here the picks: which P runs a stage 1, how Ds rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from router import placement
from router.cache_feed import EngineCaches
from router.config import RouterConfig
from router.decode_queue import DecodeQueue
from router.endpoint import Endpoint, EngineObserver
from router.errors import none_in_rotation
from router.placement import check_servable
from router.snapshots import Snapshots, give_up_at

logger = logging.getLogger(__name__)


class EnginePool:
    """The P and D endpoints, wired from their parts: ``snapshots`` (snapshots and
    rotation), ``queue`` (claims and the D wait queue); the picks are its own."""

    def __init__(self, config: RouterConfig, prefill: list[Endpoint],
                 decode: list[Endpoint]):
        self.config = config
        self.prefill, self.decode = prefill, decode
        self.snapshots = Snapshots(config, prefill, decode, (
            EngineCaches(logger, keys=config.kv_events_keys())
            if config.placement == "cache" else None))
        self.queue = DecodeQueue(config, decode, self.snapshots, self.decode_ranker,
                                 self.cached_blocks)
        #: A claim on a D with room for a stage 2: the queue's (``DecodeQueue.pick_decode``).
        self.pick_decode = self.queue.pick_decode

    @property
    def caches(self) -> EngineCaches | None:
        """What each engine's prefix cache holds, from its KV events (None: placement by
        load alone, ``RouterConfig.placement``); the snapshots feed it."""
        return self.snapshots.caches

    @caches.setter
    def caches(self, caches: EngineCaches | None) -> None:
        self.snapshots.caches = caches

    @property
    def observer(self) -> EngineObserver:
        """Told of engine state changes, capacity answers and placements."""
        return self.snapshots.observer

    @observer.setter
    def observer(self, observer: EngineObserver) -> None:
        self.snapshots.observer = observer

    @property
    def on_back(self) -> Callable[[Endpoint], None] | None:
        """Called with an engine that answers again after being out of rotation."""
        return self.snapshots.on_back

    @on_back.setter
    def on_back(self, on_back: Callable[[Endpoint], None] | None) -> None:
        self.snapshots.on_back = on_back

    @property
    def endpoints(self) -> list[Endpoint]:
        return [*self.prefill, *self.decode]

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the D queue now."""
        return len(self.queue)

    def find(self, address: str) -> Endpoint | None:
        return next((ep for ep in self.endpoints if ep.address == address), None)

    def is_prefill(self, ep: Endpoint) -> bool:
        return any(ep is p for p in self.prefill)

    def role(self, ep: Endpoint) -> str:
        return "prefill" if self.is_prefill(ep) else "decode"

    def known(self) -> str:
        return ", ".join(ep.address for ep in self.endpoints)

    async def close(self) -> None:
        if self.caches is not None:
            await self.caches.close()
        self.snapshots.close()
        for ep in self.endpoints:
            if ep.channel is not None:
                await ep.channel.close()

    # ---- snapshots, rotation and room (the parts') ----------------------------------
    async def refresh_capacity(self, endpoints: list[Endpoint]) -> None:
        await self.snapshots.refresh_capacity(endpoints)

    def refresh_soon(self, ep: Endpoint) -> asyncio.Task:
        return self.snapshots.refresh_soon(ep)

    async def poll_capacity(self) -> None:
        await self.snapshots.poll_capacity()

    def room_changed(self) -> None:
        self.snapshots.room_changed()

    # ---- picks --------------------------------------------------------------------------
    def cached_blocks(self, ep: Endpoint, token_ids: Sequence[int] | None,
                      adapter: str = "") -> int:
        """Leading blocks of ``token_ids`` (under ``adapter``) ``ep``'s prefix cache
        holds, by its events."""
        if self.caches is None or not token_ids:
            return 0
        return self.caches.cached_blocks(ep.address, token_ids, adapter or None)

    def decode_ranker(self, candidates: Sequence[Endpoint],
                      prompt_ids: Sequence[int] | None, adapter: str = ""
                      ) -> Callable[[Endpoint], tuple[float, int, int]]:
        """How Ds with room rank for a stage 2 on ``prompt_ids`` (``placement.
        decode_rank``): by the prompt each holds against its queue when the router
        follows every candidate's events, else by load."""
        caches = self.caches
        informed = caches is not None and all(caches.feed(ep.address) is not None
                                               for ep in candidates)
        return placement.decode_rank(placement.cached_prefix(
            lambda e: self.cached_blocks(e, prompt_ids, adapter),
            lambda e: e.capacity.block_size) if informed else None)

    def prefill_picker(self, prompt_ids: Sequence[int] | None,
                       exclude: Endpoint | None = None,
                       catalog: str | None = None, adapter: str = "") -> placement.Picker:
        """Stage 1's placement (``router.placement``): a P taking work (with
        ``catalog``, one that loaded it: its stage 2 runs there too; with ``adapter``,
        one that serves it), scored by the prompt's prefix it holds (under that
        adapter) against its queue."""
        return placement.Picker(
            filters=(placement.takes_work, placement.not_excluded(exclude),
                     placement.has_catalog(catalog), placement.serves_adapter(adapter)),
            scorers=(placement.cached_prefix(
                lambda ep: self.cached_blocks(ep, prompt_ids, adapter),
                lambda ep: ep.capacity.block_size), placement.queue()))

    async def pick_prefill(self, deadline: float | None,
                           exclude: Endpoint | None = None,
                           prompt_ids: Sequence[int] | None = None,
                           catalog: str | None = None, adapter: str = "",
                           prefer: Endpoint | None = None) -> Endpoint:
        """The P for a stage 1 (``prefill_picker``; ``prefer``, the P holding the
        prompt's chunks, whenever the picker would take it at all). With none taking
        work each is asked once more, then the request waits for one (``decode_wait_s``,
        its ``deadline``) while some P answered lately; UNAVAILABLE if none did;
        NOT_FOUND if none in rotation has ``catalog`` or ``adapter``."""
        wait_until = give_up_at(self.config, deadline)
        picker = self.prefill_picker(prompt_ids, exclude, catalog, adapter)
        asked = False
        while True:
            changed = self.snapshots.changed
            candidates = [ep for ep in self.prefill if ep is not exclude]
            live = [ep for ep in candidates if ep.takes_work]
            check_servable(catalog, adapter, live, "prefill")
            chosen = picker.pick([prefer] if prefer in live else live) or picker.pick(live)
            if chosen is not None:
                self.observer.placed("prefill", chosen.address,
                                     self.cached_blocks(chosen, prompt_ids, adapter))
                return chosen
            if not live and candidates and not asked:
                # An engine back from a restart may not be polled since: each one out of
                # rotation is asked once (bounded) before the request is refused.
                asked = True
                await asyncio.wait([self.refresh_soon(ep) for ep in candidates],
                                   timeout=self.config.capacity_timeout_s)
                continue
            self.snapshots.raise_unless_answered_lately(candidates, "prefill")
            left = wait_until - time.monotonic()
            if left <= 0:
                if deadline is not None and wait_until >= deadline:
                    raise TimeoutError()
                raise none_in_rotation(candidates, "prefill", self.config.decode_wait_s)
            for ep in self.prefill:
                self.refresh_soon(ep)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, self.config.capacity_poll_s))


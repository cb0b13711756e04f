"""Room on a D: a request routed to a D holds a :class:`~router.endpoint.Claim` on the
blocks its stage 2 will reserve there until a snapshot shows them
(``Endpoint.settle_claims``) or it releases the claim. With no room on any D a request
waits in a bounded FIFO queue (:meth:`DecodeQueue.pick_decode`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Sequence

from kvhandoff.budget import live_slots, stage2_reservation_upto
from kvhandoff.types import BeamParams
from router import placement
from router.config import RouterConfig
from router.endpoint import Claim, Endpoint
from router.errors import decode_queue_full, decode_too_small, no_room_in_time, none_in_rotation
from router.placement import catalog_widths, check_servable
from router.snapshots import Snapshots, give_up_at

#: How Ds with room rank for a stage 2 (``EnginePool.decode_ranker``), and the leading
#: blocks of a prompt an engine's prefix cache holds (``EnginePool.cached_blocks``).
Ranker = Callable[[Sequence[Endpoint], Sequence[int] | None, str],
                  Callable[[Endpoint], tuple[float, int, int]]]
CachedBlocks = Callable[[Endpoint, Sequence[int] | None, str], int]


class DecodeQueue:
    """Claims on the Ds' room, first come first served."""

    def __init__(self, config: RouterConfig, decode: list[Endpoint], snapshots: Snapshots,
                 ranker: Ranker, cached_blocks: CachedBlocks):
        self.config, self.decode, self.snapshots = config, decode, snapshots
        self.ranker, self.cached_blocks = ranker, cached_blocks
        #: Requests waiting for room on a D, first come first served.
        self._queue: collections.deque[object] = collections.deque()

    def __len__(self) -> int:
        return len(self._queue)

    async def pick_decode(self, num_prompt_tokens: int, beam: BeamParams,
                          deadline: float | None, *, fresh: bool = False,
                          only: list[Endpoint] | None = None,
                          prompt_ids: Sequence[int] | None = None,
                          shortest: int | None = None, adapter: str = "",
                          warming_ok: bool = False) -> Claim:
        """A claim on the D with the most unclaimed blocks among those with room for a
        stage 2 of ``num_prompt_tokens`` (or, before stage 1 ends, any length from
        ``shortest`` to it) and ``beam``; the caller owns it and releases it. With no
        room on any D the request waits its turn (FIFO) for up to ``decode_wait_s`` and
        its ``deadline``. ``fresh`` asks every D first (after a failed handoff); ``only``
        limits the choice to those Ds (a held parent's continuation: the D its handoff
        names; the warm-up's pair); ``prompt_ids`` (what stage 2 will read, under
        ``adapter``: only Ds that serve it): among those with room, the D whose prefix
        cache holds most of it wins; ``warming_ok``: or one whose warm-up runs (its own)."""
        cfg = self.config
        decode = only if only is not None else self.decode

        def usable(ep: Endpoint) -> bool:
            return ep.takes_work or (warming_ok and ep.in_rotation and not ep.draining)

        def need(ep: Endpoint) -> int:  # what D reserves for it
            cap = ep.capacity
            slots = live_slots(beam.beam_width, catalog_widths(cap, beam.catalog),
                               beam.max_tokens)
            return stage2_reservation_upto(
                num_prompt_tokens if shortest is None else shortest, num_prompt_tokens,
                cap.block_size, slots, beam.max_tokens, cap.beam_fork, cap.num_total_blocks,
                from_parent=beam.catalog is not None)

        def can_hold(ep: Endpoint) -> bool:
            return (beam.beam_width <= ep.capacity.max_beam_width
                    and need(ep) <= ep.capacity.num_total_blocks
                    and (beam.catalog is None or beam.catalog in ep.capacity.catalogs)
                    and serves(ep))

        serves = placement.serves_adapter(adapter)

        ticket = object()
        asked = False
        wait_until = give_up_at(cfg, deadline)
        max_age = cfg.capacity_max_age_s
        try:
            while True:
                changed = self.snapshots.changed
                oldest = time.monotonic() - max_age
                stale = [ep for ep in decode if fresh or ep.capacity_at < oldest]
                fresh = False
                if stale:
                    # A slow D does not hold the request: at most one poll interval, then
                    # its last snapshot (or none) is used and the call goes on.
                    await asyncio.wait([self.snapshots.refresh_soon(ep) for ep in stale],
                                       timeout=cfg.capacity_poll_s)
                live = [ep for ep in decode if usable(ep)]
                if not live and decode and not asked:
                    # A D back from a restart that answers slower than a poll interval:
                    # each is asked once more (bounded) before the request is refused.
                    asked = True
                    await asyncio.wait([self.snapshots.refresh_soon(ep) for ep in decode],
                                       timeout=cfg.capacity_timeout_s)
                    live = [ep for ep in decode if usable(ep)]
                if not live:
                    self.snapshots.raise_unless_answered_lately(decode, "decode")
                check_servable(beam.catalog, adapter, live, "decode")
                holding = [ep for ep in live if can_hold(ep)]
                if live and not holding:
                    # The largest of those that could run it (the catalog's and the
                    # adapter's, if any).
                    biggest = max((ep for ep in live if serves(ep) and (
                                   beam.catalog is None or beam.catalog in ep.capacity.catalogs)),
                                  key=lambda ep: ep.capacity.num_total_blocks)
                    raise decode_too_small(need(biggest), biggest, num_prompt_tokens, beam)
                my_turn = not self._queue or self._queue[0] is ticket
                fitting = [ep for ep in holding if need(ep) <= ep.num_unclaimed_blocks]
                if my_turn and fitting:
                    # By load, or the prompt it holds (those blocks need no READ)
                    # against its queue.
                    d = max(fitting, key=self.ranker(fitting, prompt_ids, adapter))
                    self.snapshots.observer.placed("decode", d.address,
                                         self.cached_blocks(d, prompt_ids, adapter))
                    claim = Claim(d, need(d), on_release=self._released)
                    d.claims.add(claim)
                    return claim
                if ticket not in self._queue:
                    if len(self._queue) >= cfg.decode_queue_limit:
                        raise decode_queue_full(len(self._queue), cfg.decode_queue_limit)
                    self._queue.append(ticket)
                    # The queue's head asks the Ds itself if nobody polls them.
                    max_age = 2 * cfg.capacity_poll_s
                left = wait_until - time.monotonic()
                if left <= 0:
                    if deadline is not None and wait_until >= deadline:
                        raise TimeoutError()
                    if not live:
                        raise none_in_rotation(decode, "decode", cfg.decode_wait_s)
                    most = max(holding, key=lambda ep: ep.num_unclaimed_blocks)
                    raise no_room_in_time(need(most), most, cfg.decode_wait_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, cfg.capacity_poll_s))
        finally:
            if ticket in self._queue:
                self._queue.remove(ticket)
                self.snapshots.room_changed()

    def _released(self, claim: Claim) -> None:
        """A claim ended. Still in stage 1, its blocks are free again now; once its stage
        2 ran on D, D's reservation for it ends with it: ask D again now rather than at
        the next poll."""
        if claim.sent_at is None:
            self.snapshots.room_changed()
        else:
            self.snapshots.refresh_soon(claim.endpoint)

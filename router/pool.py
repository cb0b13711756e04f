"""The router's engines: which are in rotation, what room their pools have, and the
claims and wait queue through which requests get room on a D.

Each engine's ``GetCapacity`` snapshot is refreshed off the request path
(:meth:`EnginePool.poll_capacity`); a request routed to a D holds a :class:`Claim` on the
blocks its stage 2 will reserve there until a snapshot shows them
(``Endpoint.settle_claims``) or it releases the claim. With no room on any D a request
waits in a bounded FIFO queue (:meth:`EnginePool.pick_decode`).

Rotation: an engine is routed to while it is *in rotation*. It leaves when it refuses the
connection (or answers with any error other than a timeout), or when it has not answered
for ``engine_silence_s``; a late answer alone keeps it in on its last snapshot (a busy
2-core host answers late; slow is not dead). It comes back with its next answer. While
no engine of a role is in rotation but one answered within ``engine_silence_s``, requests
for that role wait (within their queue, wait and deadline bounds) instead of failing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from kvhandoff.budget import live_slots, stage2_reservation_upto
from kvhandoff.tls import aio_channel
from kvhandoff.types import BeamParams
from kvhandoff.v1 import engine_pb2, engine_pb2_grpc
from router import placement
from router.cache_feed import EngineCaches
from router.config import RouterConfig
from router.endpoint import Claim, Endpoint, EngineObserver
from router.errors import (
    RouterError,
    code_of,
    decode_queue_full,
    decode_too_small,
    details_of,
    no_room_in_time,
    none_in_rotation,
)
from router.placement import catalog_widths, check_servable

logger = logging.getLogger(__name__)

#: Keepalive: an engine whose host vanished (no FIN, no RST: a link down, a machine
#: gone) fails the calls in flight to it within ~20 s (a ping every 10 s, 10 s to answer)
#: instead of when TCP gives up (minutes). A stopped process (SIGSTOP) answers pings once
#: it resumes: pauses under 10 s do not end its calls. The engine servers accept pings
#: this often (wire.grpc_server.SERVER_OPTIONS).
KEEPALIVE_MS = 10_000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def connect(config: RouterConfig) -> tuple[list[Endpoint], list[Endpoint]]:
    """Endpoints over gRPC channels to ``config``'s P and D addresses (with its key)."""
    def endpoint(address: str) -> Endpoint:
        channel = aio_channel(address, config.channel_tls, CHANNEL_OPTIONS, config.engine_key)
        return Endpoint(address, engine_pb2_grpc.EngineStub(channel), channel)

    return [endpoint(a) for a in config.prefill], [endpoint(a) for a in config.decode]


class EnginePool:
    """The P and D endpoints, their snapshots, rotation, claims and the D wait queue."""

    def __init__(self, config: RouterConfig, prefill: list[Endpoint],
                 decode: list[Endpoint]):
        self.config = config
        self.prefill, self.decode = prefill, decode
        #: Told of engine state changes and capacity answers (RouterMetrics).
        self.observer = EngineObserver()
        #: Called with an engine that answers again after being out of rotation (the
        #: warm-up of its pairs); None: nobody is told.
        self.on_back: Callable[[Endpoint], None] | None = None
        #: Requests waiting for room on a D, first come first served.
        self._decode_queue: collections.deque[object] = collections.deque()
        #: Set (and replaced) whenever room on a D may have changed.
        self._changed = asyncio.Event()
        #: GetCapacity calls in flight, by address.
        self._refreshing: dict[str, asyncio.Task] = {}
        #: What each engine's prefix cache holds, from its KV events (None: placement by
        #: load alone, ``RouterConfig.placement``).
        self.caches = (EngineCaches(logger, keys=config.kv_events_keys())
                       if config.placement == "cache" else None)

    @property
    def endpoints(self) -> list[Endpoint]:
        return [*self.prefill, *self.decode]

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the D queue now."""
        return len(self._decode_queue)

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
        for task in self._refreshing.values():
            task.cancel()
        for ep in self.endpoints:
            if ep.channel is not None:
                await ep.channel.close()

    # ---- snapshots and rotation ---------------------------------------------------------
    async def refresh_capacity(self, endpoints: list[Endpoint]) -> None:
        """Ask each of ``endpoints`` for a snapshot (one call in flight per engine:
        callers asking while one runs share its answer) and wait for the answers."""
        # Shielded: a caller that goes away does not cancel a call others wait on.
        await asyncio.gather(*(asyncio.shield(self.refresh_soon(ep)) for ep in endpoints))

    def refresh_soon(self, ep: Endpoint) -> asyncio.Task:
        """The GetCapacity call to ``ep`` in flight, started if there is none."""
        task = self._refreshing.get(ep.address)
        if task is None or task.done():
            task = asyncio.create_task(self._refresh_one(ep))
            self._refreshing[ep.address] = task
            task.add_done_callback(lambda t: self._refreshing.pop(ep.address, None)
                                   if self._refreshing.get(ep.address) is t else None)
        return task

    async def poll_capacity(self) -> None:
        """Ask every engine for a snapshot each ``capacity_poll_s``, until cancelled:
        keeps GetCapacity off the request path and notices engines that went away or
        came back. A slow engine does not hold up the others' polls (its call in flight
        is not started again)."""
        while True:
            for ep in self.endpoints:
                self.refresh_soon(ep)
            await asyncio.sleep(self.config.capacity_poll_s)

    async def _refresh_one(self, ep: Endpoint) -> None:
        cfg, role = self.config, self.role(ep)
        asked_at = time.monotonic()
        try:
            capacity = await ep.stub.GetCapacity(engine_pb2.CapacityRequest(),
                                                 timeout=cfg.capacity_timeout_s)
        except (grpc.aio.AioRpcError, RouterError) as e:
            code, now = code_of(e), time.monotonic()
            self.observer.capacity_answer(role, ep.address, now - asked_at, code.name)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                ep.num_late_answers += 1
                silent_s = now - ep.answered_at
                if ep.in_rotation and silent_s >= cfg.engine_silence_s:
                    self._leave_rotation(ep, "silent", f"silent for {silent_s:.1f}s (limit "
                                                       f"{cfg.engine_silence_s:g}s)")
                elif ep.in_rotation:
                    logger.info("engine %s did not answer within %gs (%d in a row, silent "
                                "%.1fs): its snapshot of %.1fs ago stays in use", ep.address,
                                cfg.capacity_timeout_s, ep.num_late_answers, silent_s,
                                now - ep.capacity_at)
            else:
                ep.num_late_answers = 0
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED):
                    ep.answered_at = now  # it answered (refusing this router's key: not)
                self._leave_rotation(ep, code.name.lower(), f"{code.name}: {details_of(e)}")
            self.room_changed()
            return
        now = time.monotonic()
        self.observer.capacity_answer(role, ep.address, now - asked_at, "OK")
        first = ep.capacity_at == float("-inf")
        ep.answered_at, ep.num_late_answers = now, 0
        came_back = not ep.in_rotation
        ep.capacity, ep.capacity_at = capacity, asked_at
        ep.settle_claims()
        if self.caches is not None:
            self.caches.follow(ep.address, capacity)
        if came_back:
            logger.log(logging.INFO if first else logging.WARNING,
                       "engine %s (%s) in rotation: it answered (out before: %s)",
                       ep.address, role, ep.out_reason)
            self.observer.engine_state(role, ep.address, "in",
                                       "first answer" if first else "answered")
            ep.out_reason = None
            if self.on_back is not None:
                self.on_back(ep)
        self.room_changed()

    def _leave_rotation(self, ep: Endpoint, kind: str, reason: str) -> None:
        """Take ``ep`` out of rotation (``kind``: the metric's reason label)."""
        if not ep.in_rotation:
            ep.out_reason = reason
            return
        logger.warning("engine %s (%s) out of rotation: %s", ep.address, self.role(ep),
                       reason)
        ep.capacity, ep.out_reason = None, reason
        self.observer.engine_state(self.role(ep), ep.address, "out", kind)

    def room_changed(self) -> None:
        """Wake the requests waiting for an engine or for room (something changed)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _raise_unless_answered_lately(self, endpoints: list[Endpoint], role: str) -> None:
        """UNAVAILABLE when no engine of ``endpoints`` answered within
        ``engine_silence_s`` (else it is worth waiting for)."""
        since = time.monotonic() - self.config.engine_silence_s
        if not any(ep.answered_at >= since for ep in endpoints):
            raise none_in_rotation(endpoints, role, self.config.engine_silence_s)

    def _wait_until(self, deadline: float | None) -> float:
        wait_until = time.monotonic() + self.config.decode_wait_s
        return wait_until if deadline is None else min(wait_until, deadline)

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
        work the request waits for one (``decode_wait_s``, its ``deadline``) while some
        P answered lately; UNAVAILABLE if none did; NOT_FOUND if none in rotation has
        ``catalog`` or ``adapter``."""
        wait_until = self._wait_until(deadline)
        picker = self.prefill_picker(prompt_ids, exclude, catalog, adapter)
        while True:
            changed = self._changed
            candidates = [ep for ep in self.prefill if ep is not exclude]
            live = [ep for ep in candidates if ep.takes_work]
            check_servable(catalog, adapter, live, "prefill")
            chosen = picker.pick([prefer] if prefer in live else live) or picker.pick(live)
            if chosen is not None:
                self.observer.placed("prefill", chosen.address,
                                     self.cached_blocks(chosen, prompt_ids, adapter))
                return chosen
            self._raise_unless_answered_lately(candidates, "prefill")
            left = wait_until - time.monotonic()
            if left <= 0:
                if deadline is not None and wait_until >= deadline:
                    raise TimeoutError()
                raise none_in_rotation(candidates, "prefill", self.config.decode_wait_s)
            for ep in self.prefill:
                self.refresh_soon(ep)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, self.config.capacity_poll_s))

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
        wait_until = self._wait_until(deadline)
        max_age = cfg.capacity_max_age_s
        try:
            while True:
                changed = self._changed
                oldest = time.monotonic() - max_age
                stale = [ep for ep in decode if fresh or ep.capacity_at < oldest]
                fresh = False
                if stale:
                    # A slow D does not hold the request: at most one poll interval, then
                    # its last snapshot (or none) is used and the call goes on.
                    await asyncio.wait([self.refresh_soon(ep) for ep in stale],
                                       timeout=cfg.capacity_poll_s)
                live = [ep for ep in decode if usable(ep)]
                if not live:
                    self._raise_unless_answered_lately(decode, "decode")
                check_servable(beam.catalog, adapter, live, "decode")
                holding = [ep for ep in live if can_hold(ep)]
                if live and not holding:
                    # The largest of those that could run it (the catalog's and the
                    # adapter's, if any).
                    biggest = max((ep for ep in live if serves(ep) and (
                                   beam.catalog is None or beam.catalog in ep.capacity.catalogs)),
                                  key=lambda ep: ep.capacity.num_total_blocks)
                    raise decode_too_small(need(biggest), biggest, num_prompt_tokens, beam)
                my_turn = not self._decode_queue or self._decode_queue[0] is ticket
                fitting = [ep for ep in holding if need(ep) <= ep.num_unclaimed_blocks]
                if my_turn and fitting:
                    # By load, or the prompt it holds (those blocks need no READ)
                    # against its queue.
                    d = max(fitting, key=self.decode_ranker(fitting, prompt_ids, adapter))
                    self.observer.placed("decode", d.address,
                                         self.cached_blocks(d, prompt_ids, adapter))
                    claim = Claim(d, need(d), on_release=self._released)
                    d.claims.add(claim)
                    return claim
                if ticket not in self._decode_queue:
                    if len(self._decode_queue) >= cfg.decode_queue_limit:
                        raise decode_queue_full(len(self._decode_queue), cfg.decode_queue_limit)
                    self._decode_queue.append(ticket)
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
            if ticket in self._decode_queue:
                self._decode_queue.remove(ticket)
                self.room_changed()

    def _released(self, claim: Claim) -> None:
        """A claim ended. Still in stage 1, its blocks are free again now; once its stage
        2 ran on D, D's reservation for it ends with it: ask D again now rather than at
        the next poll."""
        if claim.sent_at is None:
            self.room_changed()
        else:
            self.refresh_soon(claim.endpoint)

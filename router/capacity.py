"""What the router knows of its engines' pools, and how it claims room on a D.

Each engine's ``GetCapacity`` snapshot is refreshed off the request path
(``poll_capacity``); a request routed to a D *claims* the blocks its stage 2 will
reserve there until a snapshot shows them (``Endpoint.settle_claims``). With no room on
any D a request waits in a bounded FIFO queue (``_pick_decode``). Mixed into
``router.core.Router``, whose ``config``, ``prefill``, ``decode`` and queue state it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from kvhandoff.budget import stage2_reservation
from kvhandoff.v1 import engine_pb2
from router.plan import Plan, RouterError, grpc_error

if TYPE_CHECKING:
    import collections

    from router.core import RouterConfig

logger = logging.getLogger(__name__)


@dataclass
class Endpoint:
    address: str
    #: ``EngineStub`` or anything with its Stage1 / Stage2 / GetCapacity calls.
    stub: Any
    channel: grpc.aio.Channel | None
    outstanding: int = 0
    capacity: engine_pb2.Capacity | None = None
    #: time.monotonic() of the last GetCapacity attempt (answered or not).
    capacity_at: float = float("-inf")
    #: Blocks promised to requests routed here that ``capacity`` may not show yet.
    claims: dict[object, Claim] = field(default_factory=dict)
    #: GetCapacity calls in a row that timed out (see RouterConfig.capacity_late_limit).
    num_late_answers: int = 0

    @property
    def num_claimed_blocks(self) -> int:
        return sum(c.num_blocks for c in self.claims.values())

    @property
    def num_unclaimed_blocks(self) -> int:
        """Blocks a new request may count on: free now and after the running stage 2s
        reach their peaks, less the claims the snapshot does not show yet."""
        cap = self.capacity
        if cap is None:
            return 0
        room = min(cap.num_free_blocks, cap.num_total_blocks - cap.num_reserved_blocks)
        return room - self.num_claimed_blocks

    def settle_claims(self) -> None:
        """Forget the claims a snapshot taken at ``capacity_at`` shows: their stage 2
        was sent at least ``ADMIT_S`` before it was asked (D reserves its peak when the
        call arrives). Claims still in stage 1 stay."""
        for key in [k for k, c in self.claims.items()
                    if c.sent_at is not None and c.sent_at + ADMIT_S <= self.capacity_at]:
            del self.claims[key]


#: Time a stage 2 is given to reach D (and be reserved there) before a snapshot is
#: assumed to show it.
ADMIT_S = 0.25


@dataclass
class Claim:
    """Blocks a request routed to a D will need there."""

    num_blocks: int
    #: time.monotonic() when its stage 2 was sent to D (None: still in stage 1).
    sent_at: float | None = None


class CapacityMixin:
    """Capacity snapshots, claims and the D queue of a :class:`~router.core.Router`."""

    config: RouterConfig
    prefill: list[Endpoint]
    decode: list[Endpoint]
    _decode_queue: collections.deque[object]
    _decode_changed: asyncio.Event
    _refreshing: dict[str, asyncio.Task]
    _rewarm: bool
    # Also uses ``_warm_up_later`` (router.warmup.WarmUpMixin).

    async def refresh_capacity(self, endpoints: list[Endpoint]) -> None:
        async def one(ep: Endpoint) -> None:
            asked_at = time.monotonic()
            try:
                capacity = await ep.stub.GetCapacity(
                    engine_pb2.CapacityRequest(), timeout=self.config.capacity_timeout_s)
            except (grpc.aio.AioRpcError, RouterError) as e:
                code = e.code() if isinstance(e, grpc.aio.AioRpcError) else e.code
                if (code == grpc.StatusCode.DEADLINE_EXCEEDED and ep.capacity is not None
                        and ep.num_late_answers < self.config.capacity_late_limit):
                    ep.num_late_answers += 1
                    logger.info("engine %s did not answer within %gs (%d in a row): its "
                                "snapshot of %.1fs ago stays in use", ep.address,
                                self.config.capacity_timeout_s, ep.num_late_answers,
                                time.monotonic() - ep.capacity_at)
                    return
                if ep.capacity is not None:
                    logger.warning("engine %s unavailable: %s", ep.address, code.name)
                capacity = None
            ep.num_late_answers = 0
            came_back = capacity is not None and ep.capacity is None
            ep.capacity, ep.capacity_at = capacity, asked_at
            ep.settle_claims()
            if came_back and self._rewarm:
                self._warm_up_later(ep)

        await asyncio.gather(*(one(ep) for ep in endpoints))
        self._decode_room_changed()

    def _decode_room_changed(self) -> None:
        self._decode_changed.set()
        self._decode_changed = asyncio.Event()

    async def poll_capacity(self) -> None:
        """Refresh every engine's capacity each ``capacity_poll_s``, until cancelled:
        keeps GetCapacity off the request path and notices engines that went away or
        came back."""
        while True:
            await self.refresh_capacity([*self.prefill, *self.decode])
            await asyncio.sleep(self.config.capacity_poll_s)

    def _pick_prefill(self) -> Endpoint:
        live = [ep for ep in self.prefill if ep.capacity is not None] or self.prefill
        return min(live, key=lambda ep: ep.outstanding)

    async def _pick_decode(self, num_prompt_tokens: int, plan: Plan, key: object, *,
                           fresh: bool = False) -> Endpoint:
        """The D with the most unclaimed blocks among those with room for the request;
        its blocks are claimed there under ``key`` (``_release`` gives them back). With no
        room on any D the request waits its turn (FIFO) for up to ``decode_wait_s``.
        ``fresh`` asks every D first (after a failed handoff)."""
        cfg = self.config

        def need(ep: Endpoint) -> int:  # what D reserves for it
            cap = ep.capacity
            return stage2_reservation(num_prompt_tokens, cap.block_size, plan.beam.beam_width,
                                      plan.beam.max_tokens, cap.beam_fork,
                                      cap.num_total_blocks)

        def can_hold(ep: Endpoint) -> bool:
            return (plan.beam.beam_width <= ep.capacity.max_beam_width
                    and need(ep) <= ep.capacity.num_total_blocks)

        ticket = object()
        wait_until = time.monotonic() + cfg.decode_wait_s
        if plan.deadline is not None:
            wait_until = min(wait_until, plan.deadline)
        max_age = cfg.capacity_max_age_s
        try:
            while True:
                changed = self._decode_changed
                oldest = time.monotonic() - max_age
                stale = [ep for ep in self.decode if fresh or ep.capacity_at < oldest]
                fresh = False
                if stale:
                    await self.refresh_capacity(stale)
                live = [ep for ep in self.decode if ep.capacity is not None]
                if not live:
                    raise grpc_error(grpc.StatusCode.UNAVAILABLE, "no decode engine is reachable")
                holding = [ep for ep in live if can_hold(ep)]
                if not holding:
                    biggest = max(live, key=lambda ep: ep.capacity.num_total_blocks)
                    raise _too_small(need(biggest), biggest, num_prompt_tokens, plan)
                my_turn = not self._decode_queue or self._decode_queue[0] is ticket
                fitting = [ep for ep in holding if need(ep) <= ep.num_unclaimed_blocks]
                if my_turn and fitting:
                    d = max(fitting, key=lambda ep: (ep.num_unclaimed_blocks, -ep.outstanding))
                    d.claims[key] = Claim(need(d))
                    return d
                if ticket not in self._decode_queue:
                    if len(self._decode_queue) >= cfg.decode_queue_limit:
                        raise _queue_full(len(self._decode_queue), cfg.decode_queue_limit)
                    self._decode_queue.append(ticket)
                    # The queue's head asks the Ds itself if nobody polls them.
                    max_age = 2 * cfg.capacity_poll_s
                left = wait_until - time.monotonic()
                if left <= 0:
                    if plan.deadline is not None and wait_until >= plan.deadline:
                        raise TimeoutError()
                    most = max(holding, key=lambda ep: ep.num_unclaimed_blocks)
                    raise _no_room_in_time(need(most), most, cfg.decode_wait_s)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, cfg.capacity_poll_s))
        finally:
            if ticket in self._decode_queue:
                self._decode_queue.remove(ticket)
                self._decode_room_changed()

    def _release(self, d: Endpoint | None, key: object) -> None:
        """Drop ``key``'s claim on ``d``. Once its stage 2 ran there, D's reservation
        for it ends with it: ask D again now rather than at the next poll."""
        if d is None or not any(ep is d for ep in self.decode):
            return
        claim = d.claims.pop(key, None)
        if claim is not None and claim.sent_at is None:
            self._decode_room_changed()
        elif d.address not in self._refreshing:
            task = asyncio.create_task(self.refresh_capacity([d]))
            self._refreshing[d.address] = task
            task.add_done_callback(lambda _: self._refreshing.pop(d.address, None))


# RESOURCE_EXHAUSTED answers carry the numbers a client needs to act on them.
def _too_small(need: int, biggest: Endpoint, num_prompt_tokens: int, plan: Plan) -> RouterError:
    cap = biggest.capacity
    return grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"decode pool too small: needs {need} blocks ({num_prompt_tokens}-token "
                      f"prompt, beam width {plan.beam.beam_width}, {plan.beam.max_tokens} beam "
                      f"tokens), the largest decode engine holds {cap.num_total_blocks} (beam "
                      f"width up to {cap.max_beam_width})")


def _queue_full(num_waiting: int, limit: int) -> RouterError:
    return grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"decode queue full: {num_waiting} requests wait for room on a decode "
                      f"engine (limit {limit})")


def _no_room_in_time(need: int, most: Endpoint, wait_s: float) -> RouterError:
    return grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"decode pool too small: no decode engine had room for {need} blocks "
                      f"within {wait_s:g} s (most unclaimed: {most.num_unclaimed_blocks} of "
                      f"{most.capacity.num_total_blocks})")

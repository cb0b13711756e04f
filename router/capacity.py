"""What the router knows of its engines' pools, and how it claims room on a D.

Each engine's ``GetCapacity`` snapshot is refreshed off the request path
(``poll_capacity``); a request routed to a D *claims* the blocks its stage 2 will
reserve there until a snapshot shows them (``Endpoint.settle_claims``). With no room on
any D a request waits in a bounded FIFO queue (``_pick_decode``). Mixed into
``router.core.Router``, whose ``config``, ``prefill``, ``decode`` and queue state it uses.

Rotation: an engine is routed to while it is *in rotation*. It leaves when it refuses the
connection (or answers with any error other than a timeout), or when it has not answered
for ``engine_silence_s``; a late answer alone keeps it in on its last snapshot (a busy
2-core host answers late; slow is not dead). It comes back with its next answer. While
no engine of a role is in rotation but one answered within ``engine_silence_s``, requests
for that role wait (within their queue, wait and deadline bounds) instead of failing.
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
    #: time.monotonic() when the GetCapacity that ``capacity`` answered was sent.
    capacity_at: float = float("-inf")
    #: time.monotonic() of the last answer (any status but a timeout counts: the engine
    #: is there), -inf before the first.
    answered_at: float = float("-inf")
    #: Blocks promised to requests routed here that ``capacity`` may not show yet.
    claims: dict[object, Claim] = field(default_factory=dict)
    #: Why the engine is out of rotation (None while in; "never answered" at first).
    out_reason: str | None = "never answered"
    #: GetCapacity calls in a row that timed out.
    num_late_answers: int = 0
    #: Drained (Router.Drain): in rotation or not, no new work is routed here.
    draining: bool = False

    @property
    def takes_work(self) -> bool:
        return self.in_rotation and not self.draining

    @property
    def in_rotation(self) -> bool:
        return self.capacity is not None

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


class EngineObserver:
    """What the capacity code reports (RouterMetrics implements it; this one ignores)."""

    def engine_state(self, role: str, address: str, state: str, reason: str) -> None:
        """``address`` went ``state`` ("in"/"out") of rotation, for ``reason``."""

    def capacity_answer(self, role: str, address: str, seconds: float, code: str) -> None:
        """A GetCapacity call to ``address`` ended with ``code`` after ``seconds``."""


class CapacityMixin:
    """Capacity snapshots, claims and the D queue of a :class:`~router.core.Router`."""

    config: RouterConfig
    prefill: list[Endpoint]
    decode: list[Endpoint]
    _decode_queue: collections.deque[object]
    _decode_changed: asyncio.Event
    _refreshing: dict[str, asyncio.Task]
    _rewarm: bool
    observer: EngineObserver
    # Also uses ``_warm_up_later`` (router.warmup.WarmUpMixin).

    async def refresh_capacity(self, endpoints: list[Endpoint]) -> None:
        """Ask each of ``endpoints`` for a snapshot (one call in flight per engine:
        callers asking while one runs share its answer) and wait for the answers."""
        # Shielded: a caller that goes away does not cancel a call others wait on.
        await asyncio.gather(*(asyncio.shield(self._refresh_soon(ep)) for ep in endpoints))

    def _refresh_soon(self, ep: Endpoint) -> asyncio.Task:
        """The GetCapacity call to ``ep`` in flight, started if there is none."""
        task = self._refreshing.get(ep.address)
        if task is None or task.done():
            task = asyncio.create_task(self._refresh_one(ep))
            self._refreshing[ep.address] = task
            task.add_done_callback(lambda t: self._refreshing.pop(ep.address, None)
                                   if self._refreshing.get(ep.address) is t else None)
        return task

    async def _refresh_one(self, ep: Endpoint) -> None:
        cfg = self.config
        asked_at = time.monotonic()
        try:
            capacity = await ep.stub.GetCapacity(engine_pb2.CapacityRequest(),
                                                 timeout=cfg.capacity_timeout_s)
        except (grpc.aio.AioRpcError, RouterError) as e:
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else e.code
            now = time.monotonic()
            self.observer.capacity_answer(self._role(ep), ep.address, now - asked_at,
                                          code.name)
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
                if code != grpc.StatusCode.UNAVAILABLE:
                    ep.answered_at = now  # it answered, with an error
                detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                self._leave_rotation(ep, code.name.lower(), f"{code.name}: {detail}")
            self._decode_room_changed()
            return
        now = time.monotonic()
        self.observer.capacity_answer(self._role(ep), ep.address, now - asked_at, "OK")
        first = ep.capacity_at == float("-inf")
        ep.answered_at, ep.num_late_answers = now, 0
        came_back = not ep.in_rotation
        ep.capacity, ep.capacity_at = capacity, asked_at
        ep.settle_claims()
        if came_back:
            logger.log(logging.INFO if first else logging.WARNING,
                       "engine %s (%s) in rotation: it answered (out before: %s)",
                       ep.address, self._role(ep), ep.out_reason)
            self.observer.engine_state(self._role(ep), ep.address, "in",
                                       "first answer" if first else "answered")
            ep.out_reason = None
            if self._rewarm:
                self._warm_up_later(ep)
        self._decode_room_changed()

    def _leave_rotation(self, ep: Endpoint, kind: str, reason: str) -> None:
        """Take ``ep`` out of rotation (``kind``: the metric's reason label)."""
        if not ep.in_rotation:
            ep.out_reason = reason
            return
        logger.warning("engine %s (%s) out of rotation: %s", ep.address, self._role(ep),
                       reason)
        ep.capacity, ep.out_reason = None, reason
        self.observer.engine_state(self._role(ep), ep.address, "out", kind)

    def _role(self, ep: Endpoint) -> str:
        return "decode" if any(e is ep for e in self.decode) else "prefill"

    def _answered_lately(self, endpoints: list[Endpoint]) -> bool:
        """Some engine of ``endpoints`` answered within ``engine_silence_s``: worth
        waiting for rather than failing the request."""
        since = time.monotonic() - self.config.engine_silence_s
        return any(ep.answered_at >= since for ep in endpoints)

    def _decode_room_changed(self) -> None:
        self._decode_changed.set()
        self._decode_changed = asyncio.Event()

    async def poll_capacity(self) -> None:
        """Ask every engine for a snapshot each ``capacity_poll_s``, until cancelled:
        keeps GetCapacity off the request path and notices engines that went away or
        came back. A slow engine does not hold up the others' polls (its call in flight
        is not started again)."""
        while True:
            for ep in (*self.prefill, *self.decode):
                self._refresh_soon(ep)
            await asyncio.sleep(self.config.capacity_poll_s)

    async def _pick_prefill(self, plan: Plan, exclude: Endpoint | None = None) -> Endpoint:
        """The P taking work (in rotation, not drained; not ``exclude``) with the fewest
        requests outstanding. With none the request waits for one (``decode_wait_s``, its
        deadline) while some P answered lately; UNAVAILABLE if none did."""
        wait_until = time.monotonic() + self.config.decode_wait_s
        if plan.deadline is not None:
            wait_until = min(wait_until, plan.deadline)
        while True:
            changed = self._decode_changed
            candidates = [ep for ep in self.prefill if ep is not exclude]
            live = [ep for ep in candidates if ep.takes_work]
            if live:
                return min(live, key=lambda ep: ep.outstanding)
            _unavailable_unless_recent(self, candidates, "prefill")
            left = wait_until - time.monotonic()
            if left <= 0:
                if plan.deadline is not None and wait_until >= plan.deadline:
                    raise TimeoutError()
                raise _none_in_rotation(candidates, "prefill", self.config.decode_wait_s)
            for ep in self.prefill:
                self._refresh_soon(ep)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, self.config.capacity_poll_s))

    async def _pick_decode(self, num_prompt_tokens: int, plan: Plan, key: object, *,
                           fresh: bool = False, only: list[Endpoint] | None = None
                           ) -> Endpoint:
        """The D with the most unclaimed blocks among those with room for the request;
        its blocks are claimed there under ``key`` (``_release`` gives them back). With no
        room on any D the request waits its turn (FIFO) for up to ``decode_wait_s``.
        ``fresh`` asks every D first (after a failed handoff); ``only`` limits the
        choice to those Ds (a held parent's continuation: the D its handoff names)."""
        cfg = self.config
        decode = only if only is not None else self.decode

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
                stale = [ep for ep in decode if fresh or ep.capacity_at < oldest]
                fresh = False
                if stale:
                    # A slow D does not hold the request: at most one poll interval, then
                    # its last snapshot (or none) is used and the call goes on.
                    await asyncio.wait([self._refresh_soon(ep) for ep in stale],
                                       timeout=cfg.capacity_poll_s)
                live = [ep for ep in decode if ep.takes_work]
                if not live:
                    _unavailable_unless_recent(self, decode, "decode")
                holding = [ep for ep in live if can_hold(ep)]
                if live and not holding:
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
                    if not live:
                        raise _none_in_rotation(decode, "decode", cfg.decode_wait_s)
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
        else:
            self._refresh_soon(d)


def _unavailable_unless_recent(router: CapacityMixin, endpoints: list[Endpoint],
                               role: str) -> None:
    """UNAVAILABLE when no engine of ``role`` answered within ``engine_silence_s``."""
    if not router._answered_lately(endpoints):
        raise _none_in_rotation(endpoints, role, router.config.engine_silence_s)


def _none_in_rotation(endpoints: list[Endpoint], role: str, waited_s: float) -> RouterError:
    why = "; ".join(f"{ep.address}: {ep.out_reason or 'drained'}"
                    for ep in endpoints) or "none configured"
    return grpc_error(grpc.StatusCode.UNAVAILABLE,
                      f"no {role} engine is reachable (none in rotation for {waited_s:g} s: "
                      f"{why})")


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

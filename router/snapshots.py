"""The engines' snapshots and their rotation: each engine's ``GetCapacity`` answer,
refreshed off the request path (:meth:`Snapshots.poll_capacity`), and whether it is
routed to.

Rotation: an engine is routed to while it is *in rotation*. It leaves when it refuses the
connection (or answers with any error other than a timeout), or when it has not answered
for ``engine_silence_s``; a late answer alone keeps it in on its last snapshot (a busy
2-core host answers late; slow is not dead). It comes back with its next answer. While
no engine of a role is in rotation but one answered within ``engine_silence_s``, requests
for that role wait (within their queue, wait and deadline bounds) instead of failing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc

from kvhandoff.tls import aio_channel
from kvhandoff.v1 import engine_pb2, engine_pb2_grpc
from router.cache_feed import EngineCaches
from router.config import RouterConfig
from router.endpoint import Endpoint, EngineObserver
from router.errors import RouterError, code_of, details_of, none_in_rotation

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


def give_up_at(config: RouterConfig, deadline: float | None) -> float:
    """When a request waiting for an engine or for room gives up (``decode_wait_s``,
    or its ``deadline`` if sooner)."""
    wait_until = time.monotonic() + config.decode_wait_s
    return wait_until if deadline is None else min(wait_until, deadline)


class Snapshots:
    """The endpoints' snapshots (``Endpoint.capacity``) and rotation, refreshed one
    GetCapacity call in flight per engine; ``changed`` wakes whoever waits for room."""

    def __init__(self, config: RouterConfig, prefill: list[Endpoint], decode: list[Endpoint],
                 caches: EngineCaches | None):
        self.config = config
        self.prefill, self.decode = prefill, decode
        self.caches = caches
        #: Told of engine state changes and capacity answers (RouterMetrics).
        self.observer = EngineObserver()
        #: Called with an engine that answers again after being out of rotation (the
        #: warm-up of its pairs); None: nobody is told.
        self.on_back: Callable[[Endpoint], None] | None = None
        #: Set (and replaced) whenever room on an engine may have changed.
        self.changed = asyncio.Event()
        #: GetCapacity calls in flight, by address.
        self._refreshing: dict[str, asyncio.Task] = {}

    def role(self, ep: Endpoint) -> str:
        return "prefill" if any(ep is p for p in self.prefill) else "decode"

    def close(self) -> None:
        for task in self._refreshing.values():
            task.cancel()

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
            for ep in [*self.prefill, *self.decode]:
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
        self.changed.set()
        self.changed = asyncio.Event()

    def raise_unless_answered_lately(self, endpoints: list[Endpoint], role: str) -> None:
        """UNAVAILABLE when no engine of ``endpoints`` answered within
        ``engine_silence_s`` (else it is worth waiting for)."""
        since = time.monotonic() - self.config.engine_silence_s
        if not any(ep.answered_at >= since for ep in endpoints):
            raise none_in_rotation(endpoints, role, self.config.engine_silence_s)

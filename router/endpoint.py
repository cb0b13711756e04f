"""One engine as the router sees it (:class:`Endpoint`: its stub, last capacity snapshot,
rotation state and load) and a request's hold on room in its pool (:class:`Claim`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvhandoff.v1 import engine_pb2

#: Time a stage 2 is given to reach D (and be reserved there) before a snapshot is
#: assumed to show it.
ADMIT_S = 0.25


@dataclass(eq=False)
class Endpoint:
    address: str
    #: ``EngineStub`` or anything with its Stage1 / Stage2 / GetCapacity calls.
    stub: Any
    channel: grpc.aio.Channel | None
    #: Calls of this router's requests running on the engine now.
    outstanding: int = 0
    capacity: engine_pb2.Capacity | None = None
    #: time.monotonic() when the GetCapacity that ``capacity`` answered was sent.
    capacity_at: float = float("-inf")
    #: time.monotonic() of the last answer (any status but a timeout counts: the engine
    #: is there), -inf before the first.
    answered_at: float = float("-inf")
    #: Blocks promised to requests routed here that ``capacity`` may not show yet.
    claims: set[Claim] = field(default_factory=set)
    #: Why the engine is out of rotation (None while in; "never answered" at first).
    out_reason: str | None = "never answered"
    #: GetCapacity calls in a row that timed out.
    num_late_answers: int = 0
    #: Drained (Router.Drain): in rotation or not, no new work is routed here.
    draining: bool = False
    #: One engine behind it (its ``capacity.engine_id`` changes only when it restarts);
    #: False where the address stands for several (Ray Serve's replicas).
    one_engine: bool = True
    #: A Stop naming a stage 2 this router runs here reaches the engine running it, and
    #: a resume sent here avoids the engine its export comes from: True where
    #: ``one_engine`` (the address is the engine); Ray Serve's Decode handle stands for
    #: several and finds the replica its call reached (``deploy.handles.HandleStub``).
    finds_runs: bool = True
    #: Back after being out of rotation, its pairs' warm-up still running
    #: (``router.warmup``): only that warm-up is routed here (a connection the outage
    #: broke fails its first READ, which must not be a client's).
    warming: bool = False

    @property
    def takes_work(self) -> bool:
        return self.in_rotation and not self.draining and not self.warming

    @property
    def in_rotation(self) -> bool:
        return self.capacity is not None

    @property
    def num_claimed_blocks(self) -> int:
        return sum(c.num_blocks for c in self.claims)

    @property
    def num_unclaimed_blocks(self) -> int:
        """Blocks a new request may count on: free now and after the running stage 2s
        reach their peaks, less the claims the snapshot does not show yet."""
        cap = self.capacity
        if cap is None:
            return 0
        room = min(cap.num_free_blocks, cap.num_total_blocks - cap.num_reserved_blocks)
        return room - self.num_claimed_blocks

    @property
    def handoff_target(self) -> str:
        """What P addresses (and signs) a handoff for this engine to ("" before its first
        snapshot)."""
        cap = self.capacity
        return "" if cap is None else cap.handoff_target or cap.engine_id

    def settle_claims(self) -> None:
        """Forget the claims a snapshot taken at ``capacity_at`` shows: their stage 2
        was sent at least ``ADMIT_S`` before it was asked (D reserves its peak when the
        call arrives). Claims still in stage 1 stay."""
        self.claims = {c for c in self.claims
                       if c.sent_at is None or c.sent_at + ADMIT_S > self.capacity_at}


@dataclass(eq=False)
class Claim:
    """Blocks a request routed to ``endpoint`` (a D) will need there. Its owner (one
    request) calls :meth:`mark_sent` when its stage 2 goes to D and :meth:`release` when
    it is done with D, whatever happened (idempotent)."""

    endpoint: Endpoint
    num_blocks: int
    #: time.monotonic() when its stage 2 was sent to D (None: still in stage 1).
    sent_at: float | None = None
    #: Told once, on release (the pool: room may have changed).
    on_release: Callable[[Claim], None] | None = field(default=None, repr=False)
    released: bool = False

    def mark_sent(self) -> None:
        self.sent_at = time.monotonic()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.endpoint.claims.discard(self)
        if self.on_release is not None:
            self.on_release(self)


class EngineObserver:
    """What the pool reports (RouterMetrics implements it; this one ignores)."""

    def engine_state(self, role: str, address: str, state: str, reason: str) -> None:
        """``address`` went ``state`` ("in"/"out") of rotation, for ``reason``."""

    def capacity_answer(self, role: str, address: str, seconds: float, code: str) -> None:
        """A GetCapacity call to ``address`` ended with ``code`` after ``seconds``."""

    def placed(self, role: str, address: str, cached_blocks: int) -> None:
        """A request was placed on ``address``, whose prefix cache held
        ``cached_blocks`` leading blocks of its prompt (by the engine's KV events)."""

    def warm_up(self, source: str, dest: str, outcome: str) -> None:
        """A warm-up from ``source`` to ``dest`` ended: "imported", "recomputed" or
        "failed"."""

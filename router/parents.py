"""The parent registry: parents (stage 1s served with ``StartParent``) by id, kept for
their continuations (``router.continuations`` runs both).

P exports a parent with ``hold``: its KV blocks stay on P until P's lease ends, however
many continuations read them. The registry keeps each parent's token ids and handoff: at
most ``max_parents`` records (least recently used evicted first), each forgotten
``parent_ttl_s`` after its last use, and held blocks limited to ``parent_pool_share`` of
P's pool (counted until each lease ends, evicted or not), so held parents never starve new
stage 1s.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvhandoff.types import InvalidRequest, Stage1Params, TokenLogprob
from kvhandoff.v1 import common_pb2
from router.config import LEASE_MARGIN_S
from router.requests import Approximation

if TYPE_CHECKING:
    from router.endpoint import Endpoint

logger = logging.getLogger(__name__)


def _serves(ep: Endpoint) -> bool:
    """In rotation and not drained; one still warming up serves once it is done (the
    continuation waits for it)."""
    return ep.in_rotation and not ep.draining


class ParentState(enum.Enum):
    """Where a parent stands."""

    #: Stage 1 runs (a continuation waits for its end).
    RUNNING = "running"
    #: Stage 1 ended and P holds its blocks (until ``held_until``: the lease may end).
    HELD = "held"
    #: Stage 1 ended and P does not hold it, or no longer (``not_held_reason`` says why).
    NOT_HELD = "not held"
    #: Stage 1 failed (``error`` says how); the registry forgets it.
    FAILED = "failed"


#: A parent's allowed transitions, the only place they are written: a hold ends early
#: (P's share was needed, the client released it), and a parent not held may be
#: released with a new reason; nothing follows a failure.
_NEXT: dict[ParentState, frozenset[ParentState]] = {
    ParentState.RUNNING: frozenset({ParentState.HELD, ParentState.NOT_HELD,
                                    ParentState.FAILED}),
    ParentState.HELD: frozenset({ParentState.NOT_HELD}),
    ParentState.NOT_HELD: frozenset({ParentState.NOT_HELD}),
    ParentState.FAILED: frozenset(),
}


@dataclass
class ParentRecord:
    """One parent: what a continuation needs of it. Owned by the registry."""

    parent_id: str
    model: str
    prompt_ids: list[int]
    #: The LoRA adapter stage 1 ran under ("": none): its continuations run under it.
    adapter: str = ""
    prefill: str = ""
    #: The D its handoff is addressed to (signed for), when held for a D.
    decode: Endpoint | None = None
    #: The P that ran stage 1 (and holds the parent itself, when ``local``), and its
    #: engine id (one of several behind ``prefill_ep`` under Serve).
    prefill_ep: Endpoint | None = None
    prefill_engine_id: str = ""
    #: Held on P for continuations on P (the one-engine path), not exported.
    local: bool = False
    #: When P's hold on the blocks ends (Unix time); 0 until known.
    held_until: float = 0.0
    thinking_ids: list[int] = field(default_factory=list)
    #: Its stage-1 sampling as run (the seed the router picked, if it did).
    stage1: Stage1Params | None = None
    #: Per stage-1 token, when asked for (filled as P samples them).
    thinking_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    handoff: common_pb2.Handoff | None = None
    #: An approximate composition's KV (None: exact), which its continuations carry.
    approximation: Approximation | None = None
    #: The identity of the weights that computed its KV (``model_fingerprint`` of its
    #: handoff, or of its P's capacity when held there; "": not known, not checked).
    model_fingerprint: str = ""
    #: Why P does not hold it ("" while it is held or still running).
    not_held_reason: str = ""
    #: P blocks counted against the share (an estimate until stage 1 ends).
    num_blocks: int = 0
    stage1_ms: float = 0.0
    #: Set when stage 1 has ended; ``error`` says how, if it failed.
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str = ""
    last_used: float = field(default_factory=time.monotonic)
    #: Continuations of it running now: a parent in use is never released early.
    in_use: int = 0
    #: Read freely; changed only through :meth:`enter` (``done`` is set on leaving
    #: RUNNING).
    state: ParentState = ParentState.RUNNING

    def enter(self, state: ParentState, why: str = "") -> None:
        """Change ``state``: NOT_HELD with ``why`` (kept from before when "": decided
        before stage 1 ran), FAILED with ``why`` as its ``error``. An illegal
        transition (``_NEXT``) is a bug in the caller."""
        if state not in _NEXT[self.state]:
            raise AssertionError(f"parent {self.parent_id!r}: {self.state.name} -> "
                                 f"{state.name} is not a parent's transition")
        self.state = state
        if state is ParentState.NOT_HELD and why:
            self.not_held_reason = why
        if state is ParentState.FAILED:
            self.error = why
        self.done.set()

    @property
    def held(self) -> bool:
        return (self.state is ParentState.HELD and not self.not_held_reason
                and self.held_until > 0 and time.time() < self.held_until - LEASE_MARGIN_S)

    @property
    def held_name(self) -> str:
        """The request id P holds its blocks under (what P's Release names)."""
        if self.local or self.handoff is None:
            return f"{self.parent_id}-s1"
        return self.handoff.request_id

    def why_not_importable(self) -> str:
        """Why a continuation cannot read it where it is held ("" when it can)."""
        if self.not_held_reason:
            return self.not_held_reason
        if not self.held:
            return "P's lease on its blocks has ended"
        if self.local:
            if self.prefill_ep is None or not _serves(self.prefill_ep):
                return "the prefill engine holding it is out of rotation or drained"
            return self._other_weights(self.prefill_ep, "the prefill engine holding it")
        if self.decode is None or not _serves(self.decode):
            return "the decode engine it is addressed to is out of rotation or drained"
        return self._other_weights(self.decode, "the decode engine it is addressed to")

    def _other_weights(self, ep: Endpoint, which: str) -> str:
        """Why ``ep`` may not use this parent's KV: it serves other weights now (restarted
        on another model, as in a rolling update), "" when it serves the parent's."""
        now = ep.capacity.model_fingerprint if ep.capacity is not None else ""
        if self.model_fingerprint and now and now != self.model_fingerprint:
            return (f"{which} now serves other weights (model {now}; the parent's KV was "
                    f"computed by model {self.model_fingerprint})")
        return ""


class ParentStore(Protocol):
    """The parents by id, and the P blocks their holds take. Every method answers at
    once (no await): ``router.continuations`` relies on no other request running
    between a check and its write (``to_release``/``may_hold`` then ``hold``).
    :class:`ParentRegistry` keeps them in this process; another store may stand in."""

    #: Parents forgotten or released, by reason; continuations, by outcome.
    evictions: collections.Counter
    continuations: collections.Counter

    def __len__(self) -> int: ...

    def add(self, record: ParentRecord) -> None:
        """Keep ``record`` (InvalidRequest when its id is taken)."""
        ...

    def get(self, parent_id: str) -> ParentRecord | None:
        """The parent named so (None: unknown or forgotten); counts as a use."""
        ...

    def ids(self) -> list[str]: ...

    def discard(self, parent_id: str) -> None: ...

    def hold(self, record: ParentRecord, until: float) -> None:
        """Count ``record``'s blocks against the share until ``until`` (time.time())."""
        ...

    def unhold(self, record: ParentRecord) -> None: ...

    def may_hold(self, num_blocks: int, p_total_blocks: int) -> str:
        """"" when a parent of ``num_blocks`` fits in the share, else why not."""
        ...

    def to_release(self, num_blocks: int, p_total_blocks: int) -> list[ParentRecord]:
        """Idle held parents whose holds, ended now, make room for ``num_blocks``."""
        ...

    def held_blocks(self) -> int: ...

    def num_held(self) -> int: ...


class ParentRegistry:
    """Parents by id: bounded in number (LRU), in time (TTL since last use) and in the P
    blocks their holds take (a share of P's pool, counted until each lease ends)."""

    def __init__(self, max_parents: int, ttl_s: float, pool_share: float):
        self.max_parents, self.ttl_s, self.pool_share = max_parents, ttl_s, pool_share
        self._records: collections.OrderedDict[str, ParentRecord] = collections.OrderedDict()
        #: (lease end as time.time(), blocks) of every hold P may still keep.
        self._holds: list[tuple[float, int, ParentRecord]] = []
        self.evictions = collections.Counter()  # reason -> count
        self.continuations = collections.Counter()  # outcome -> count

    def __len__(self) -> int:
        return len(self._records)

    def held_blocks(self) -> int:
        now = time.time()
        self._holds = [h for h in self._holds if h[0] > now]
        return sum(blocks for _, blocks, _ in self._holds)

    def num_held(self) -> int:
        self.held_blocks()
        return len({id(r) for _, _, r in self._holds})

    def may_hold(self, num_blocks: int, p_total_blocks: int) -> str:
        """"" when a parent of ``num_blocks`` fits in the share, else why not."""
        share = int(self.pool_share * p_total_blocks)
        held = self.held_blocks()
        if held + num_blocks > share:
            return (f"the share of P's pool for held parents is full ({held} of {share} "
                    f"blocks held, this parent needs up to {num_blocks})")
        return ""

    def to_release(self, num_blocks: int, p_total_blocks: int) -> list[ParentRecord]:
        """Held parents whose holds, ended now, make room in the share for a parent of
        ``num_blocks``: those the registry forgot first, then the least recently used;
        never one in use. Empty when it fits already, or cannot be made to."""
        share = int(self.pool_share * p_total_blocks)
        held = self.held_blocks()
        if held + num_blocks <= share or num_blocks > share:
            return []
        live = set(map(id, self._records.values()))
        idle = sorted({id(r): (r, b) for _, b, r in self._holds
                       if r.in_use == 0 and r.done.is_set() and r.held}.values(),
                      key=lambda rb: (id(rb[0]) in live, rb[0].last_used))
        chosen = []
        for record, blocks in idle:
            if held + num_blocks <= share:
                break
            chosen.append(record)
            held -= blocks
        return chosen if held + num_blocks <= share else []

    def hold(self, record: ParentRecord, until: float) -> None:
        """Count ``record``'s blocks against the share until ``until`` (time.time()),
        replacing what was counted for it before."""
        self.unhold(record)
        self._holds.append((until, record.num_blocks, record))

    def unhold(self, record: ParentRecord) -> None:
        self._holds = [h for h in self._holds if h[2] is not record]

    def add(self, record: ParentRecord) -> None:
        self.sweep()
        if record.parent_id in self._records:
            raise InvalidRequest("request_id", f"parent {record.parent_id!r} already exists")
        self._records[record.parent_id] = record
        while len(self._records) > self.max_parents:
            old_id, old = next(iter(self._records.items()))
            if not old.done.is_set():
                break  # never evict a running parent (its stage 1 adds it back in order)
            del self._records[old_id]
            self.evictions["lru"] += 1
            logger.info("parent %s evicted (least recently used of %d)", old_id,
                        self.max_parents)

    def ids(self) -> list[str]:
        self.sweep()
        return list(self._records)

    def get(self, parent_id: str) -> ParentRecord | None:
        self.sweep()
        record = self._records.get(parent_id)
        if record is not None:
            record.last_used = time.monotonic()
            self._records.move_to_end(parent_id)
        return record

    def sweep(self) -> None:
        """Forget finished parents unused for ``ttl_s``."""
        oldest = time.monotonic() - self.ttl_s
        for pid in [p for p, r in self._records.items()
                    if r.done.is_set() and r.last_used < oldest]:
            del self._records[pid]
            self.evictions["ttl"] += 1

    def discard(self, parent_id: str) -> None:
        self._records.pop(parent_id, None)

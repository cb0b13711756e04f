"""The router's configuration: one frozen dataclass, validated when made."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvhandoff.keys import check_key_form
from kvhandoff.tls import ChannelTLS

if TYPE_CHECKING:
    from kvhandoff.event_keys import EventKeys

HANDOFF_FAILURE_POLICIES = ("recompute", "fail")
#: A held parent is imported only while P's lease has at least this long to run: D
#: refuses a READ within its lease safety margin (2 s by default), so closer to the end
#: the continuation is recomputed at once instead of failing over.
LEASE_MARGIN_S = 2.5


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    model: str
    #: AUTO runs requests whose parent can be at most this long colocated on P.
    colocated_below_tokens: int = 0
    capacity_timeout_s: float = 2.0
    #: An engine that has not answered GetCapacity for this long leaves rotation; until
    #: then late answers keep it in on its last snapshot (an overloaded host answers
    #: late). A refused connection or any other error takes it out at once. Requests
    #: wait for an engine of their role while one answered within this time.
    engine_silence_s: float = 10.0
    #: A D's capacity snapshot younger than this is used as it is, less the blocks of
    #: requests the router sent it since; an older one is asked again before a pick.
    #: ``EnginePool.poll_capacity`` refreshes every engine each ``capacity_poll_s`` so
    #: the request path rarely waits on a GetCapacity call (D's admission has the last
    #: word).
    capacity_max_age_s: float = 1.0
    capacity_poll_s: float = 0.25
    #: Requests the router runs at once, over all its fronts (gRPC, HTTP, Ray Serve);
    #: beyond it, RESOURCE_EXHAUSTED (HTTP 429) at once.
    max_inflight: int = 256
    #: Requests that may wait for room on a D (0: none wait, a request no D has room
    #: for now is refused at once); beyond it, RESOURCE_EXHAUSTED at once.
    decode_queue_limit: int = 64
    #: The longest a request waits for room on a D (its deadline may cut it shorter).
    decode_wait_s: float = 30.0
    #: TLS towards the engines (None: plaintext, for 127.0.0.1).
    channel_tls: ChannelTLS | None = None
    #: The engine key (``kvhandoff.keys``) every call to an engine sends; None: none.
    #: Kept out of the repr: configs get logged.
    engine_key: str | None = field(default=None, repr=False)
    #: When D cannot complete a handoff (UNAVAILABLE: D went away, or its READ from P
    #: failed; FAILED_PRECONDITION: P's lease ended first): "recompute" runs stage 2
    #: from the parent's token ids on a live D (flagged in the response); "fail" answers
    #: with D's status.
    on_handoff_failure: str = "recompute"
    #: Before serving, one tiny handoff per (P, D) pair (see router.warmup).
    warm_up: bool = True
    #: Parents (StartParent) the registry keeps for continuations, least recently used
    #: evicted first; each is forgotten this long after its last use.
    max_parents: int = 256
    parent_ttl_s: float = 300.0
    #: The share of P's pool held parents may keep (new stage 1s keep the rest).
    parent_pool_share: float = 0.25
    #: How long P holds a parent's blocks (seconds, at most P's lease); 0: P's lease.
    parent_hold_s: float = 0.0
    #: The share of P's pool named KV chunks may hold (``router.chunks``); beyond it the
    #: least recently used are evicted. With parent_pool_share at most 1.
    chunk_pool_share: float = 0.25
    #: What this router's chunks are named under on the Ps (``chunk-<namespace>-...``):
    #: started again, it releases every chunk there under it. Routers sharing Ps need
    #: their own.
    chunk_namespace: str = "default"
    #: Sample positionally (engine.sampling) unless a request says otherwise; False:
    #: vLLM's own sampling unless a request asks for positional.
    positional_sampling: bool = True
    #: Where requests go: "cache" weighs what each engine's prefix cache holds (its KV
    #: events) against its queue (router.placement), and falls back to "load" (the
    #: queue and room alone) where an engine's events are not followed.
    placement: str = "cache"
    #: The engines' KV-events secret (``kvhandoff.event_keys``) for engines that publish
    #: CURVE events; None: those engines are placed by load.
    kv_events_key_file: str | None = None

    def __post_init__(self) -> None:
        if self.placement not in ("cache", "load"):
            raise ValueError(f"placement must be 'cache' or 'load', not {self.placement!r}")
        if not self.prefill:
            raise ValueError("at least one prefill endpoint is needed")
        if self.colocated_below_tokens < 0:
            raise ValueError("colocated_below_tokens must be >= 0")
        if self.max_inflight <= 0:
            raise ValueError("max_inflight must be positive")
        if self.engine_silence_s <= self.capacity_poll_s:
            raise ValueError("engine_silence_s must be above capacity_poll_s")
        if self.decode_queue_limit < 0 or self.decode_wait_s < 0:
            raise ValueError("decode_queue_limit and decode_wait_s must be >= 0")
        if not 0 < self.capacity_poll_s < self.capacity_max_age_s:
            raise ValueError("capacity_poll_s must be positive and below capacity_max_age_s")
        if self.max_parents < 1 or self.parent_ttl_s <= 0:
            raise ValueError("max_parents must be >= 1 and parent_ttl_s positive")
        if self.parent_hold_s != 0 and not self.parent_hold_s > LEASE_MARGIN_S:
            raise ValueError(f"parent_hold_s must be 0 (P's lease) or above {LEASE_MARGIN_S} s: "
                             "a parent is imported only while its hold has that long to run")
        if not (0 <= self.parent_pool_share and 0 <= self.chunk_pool_share
                and self.parent_pool_share + self.chunk_pool_share <= 1):
            raise ValueError("parent_pool_share and chunk_pool_share must be >= 0, and at "
                             "most 1 together")
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,32}", self.chunk_namespace):
            raise ValueError("chunk_namespace must be 1 to 32 of [A-Za-z0-9_.]")
        if self.engine_key is not None:
            check_key_form(self.engine_key, "the engine key")
        if self.kv_events_key_file:
            self.kv_events_keys()  # a missing or short file: ValueError naming it
        if self.on_handoff_failure not in HANDOFF_FAILURE_POLICIES:
            raise ValueError(f"on_handoff_failure must be one of {HANDOFF_FAILURE_POLICIES}")

    def kv_events_keys(self) -> EventKeys | None:
        from kvhandoff.event_keys import EventKeys

        return EventKeys.from_file(self.kv_events_key_file) if self.kv_events_key_file else None

    @property
    def recompute(self) -> bool:
        """A handoff or move that cannot complete is recomputed (resumed) elsewhere."""
        return self.on_handoff_failure == "recompute"

    @property
    def model_name(self) -> str:
        """The served model's name: the last part of its directory."""
        return Path(self.model).name

    @property
    def model_names(self) -> set[str]:
        """Names a request's ``model`` may give: the model directory or its last part."""
        return {self.model, self.model_name}

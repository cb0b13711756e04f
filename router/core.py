"""The router's logic: pick engines, run a two-stage request over gRPC, collect results.

Prompts arrive as text or token ids; text is tokenised once here and the parent is
never re-tokenised (stage 2's prompt is built from token ids). P is chosen by least
outstanding requests; D by capacity, before stage 1 (P addresses and, with a shared
secret, signs the handoff for that D): the D with the most unclaimed blocks among those
whose pool can hold the longest parent the request can make, the suffix and the beam tails.
When none has room now, the request waits in a bounded FIFO queue for one (at most
``decode_wait_s``, its deadline, and ``decode_queue_limit`` waiters); a request no D could
hold even empty, a full queue and a wait that ran out are RESOURCE_EXHAUSTED with the
numbers, before stage 1 runs. D's admission still has the last word (it refuses with
RESOURCE_EXHAUSTED and tells P to release the parent's blocks at once).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvhandoff.budget import stage2_reservation
from kvhandoff.tls import ChannelTLS, aio_channel
from kvhandoff.types import (
    InvalidRequest,
    Stage1Params,
    continuation_prompt,
    validate_prompt,
    validate_token_ids,
)
from kvhandoff.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2
from server import convert as engine_pb

logger = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


HANDOFF_FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    model: str
    #: AUTO runs requests whose parent can be at most this long colocated on P.
    colocated_below_tokens: int = 0
    capacity_timeout_s: float = 2.0
    #: GetCapacity calls in a row a D or P may leave unanswered past ``capacity_timeout_s``
    #: and stay in rotation on its last snapshot: an overloaded host answers late (seen
    #: on 2 cores, which then sent every request to the other D). A refused connection
    #: or any other error takes it out at once.
    capacity_late_limit: int = 2
    #: A D's capacity snapshot younger than this is used as it is, less the blocks of
    #: requests the router sent it since; an older one is asked again before a pick.
    #: ``Router.poll_capacity`` refreshes every engine each ``capacity_poll_s`` so the
    #: request path rarely waits on a GetCapacity call (D's admission has the last word).
    capacity_max_age_s: float = 1.0
    capacity_poll_s: float = 0.25
    #: Requests the router runs at once; beyond it, RESOURCE_EXHAUSTED at once.
    max_inflight: int = 256
    #: Requests that may wait for room on a D (0: none wait, a request no D has room
    #: for now is refused at once); beyond it, RESOURCE_EXHAUSTED at once.
    decode_queue_limit: int = 64
    #: The longest a request waits for room on a D (its deadline may cut it shorter).
    decode_wait_s: float = 30.0
    #: TLS towards the engines (None: plaintext, for 127.0.0.1).
    channel_tls: ChannelTLS | None = None
    #: When D cannot complete a handoff (UNAVAILABLE: D went away, or its READ from P
    #: failed; FAILED_PRECONDITION: P's lease ended first): "recompute" runs stage 2
    #: from the parent's token ids on a live D (flagged in the response); "fail" answers
    #: with D's status.
    on_handoff_failure: str = "recompute"
    #: Before serving, one tiny handoff per (P, D) pair (see Router.warm_up).
    warm_up: bool = True

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ValueError("at least one prefill endpoint is needed")
        if self.colocated_below_tokens < 0:
            raise ValueError("colocated_below_tokens must be >= 0")
        if self.max_inflight <= 0:
            raise ValueError("max_inflight must be positive")
        if self.capacity_late_limit < 0:
            raise ValueError("capacity_late_limit must be >= 0")
        if self.decode_queue_limit < 0 or self.decode_wait_s < 0:
            raise ValueError("decode_queue_limit and decode_wait_s must be >= 0")
        if not 0 < self.capacity_poll_s < self.capacity_max_age_s:
            raise ValueError("capacity_poll_s must be positive and below capacity_max_age_s")
        if self.on_handoff_failure not in HANDOFF_FAILURE_POLICIES:
            raise ValueError(f"on_handoff_failure must be one of {HANDOFF_FAILURE_POLICIES}")


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


@dataclass
class Plan:
    """A validated two-stage request, all token ids."""

    request_id: str
    prompt_ids: list[int]
    suffix_ids: list[int]
    stage1: Stage1Params
    beam: Any  # BeamParams
    path: int
    deadline: float | None  # time.monotonic() by which the request must be done
    #: (P, D) to use instead of choosing (the router's warm-up).
    pinned: tuple[Endpoint, Endpoint] | None = None


@dataclass
class Outcome:
    plan: Plan
    prefill: str
    decode: str | None
    thinking_ids: list[int] = field(default_factory=list)
    stage1_finish_reason: str = ""
    suffix_ids: list[int] = field(default_factory=list)
    stage2: engine_pb2.Stage2Response | None = None
    stage1_ms: float = 0.0
    total_ms: float = 0.0
    #: Time spent waiting on P's Stage1 stream and D's Stage2 call.
    engine_ms: float = 0.0
    #: The handoff failed and stage 2 was recomputed on ``decode`` (was ``failed_decode``).
    failed_decode: str | None = None
    #: Why that handoff failed (the D's status message).
    handoff_failure: str = ""


class Router:
    def __init__(self, config: RouterConfig,
                 endpoints: tuple[list[Endpoint], list[Endpoint]] | None = None):
        """``endpoints`` (P, D) replace gRPC channels to ``config``'s addresses (the Ray
        Serve router passes deployment handles)."""
        from kvhandoff.model import ModelTokens

        self.config = config
        self.tokens = ModelTokens.load(config.model)
        if endpoints is not None:
            self.prefill, self.decode = endpoints
        else:
            self.prefill = [self._endpoint(a) for a in config.prefill]
            self.decode = [self._endpoint(a) for a in config.decode]
        self._ids = itertools.count()
        #: Requests waiting for room on a D, first come first served.
        self._decode_queue: collections.deque[object] = collections.deque()
        #: Set (and replaced) whenever room on a D may have changed.
        self._decode_changed = asyncio.Event()
        #: Capacity refreshes asked for after a stage 2 ended, by D address.
        self._refreshing: dict[str, asyncio.Task] = {}
        #: After the start-up warm-up: an engine that answers again (restarted, or up
        #: late) gets its pairs warmed up in the background (``_warming``).
        self._rewarm = False
        self._warming: set[asyncio.Task] = set()

    def _endpoint(self, address: str) -> Endpoint:
        channel = aio_channel(address, self.config.channel_tls, CHANNEL_OPTIONS)
        return Endpoint(address, engine_pb2_grpc.EngineStub(channel), channel)

    async def close(self) -> None:
        self._rewarm = False
        for task in [*self._refreshing.values(), *self._warming]:
            task.cancel()
        for ep in (*self.prefill, *self.decode):
            if ep.channel is not None:
                await ep.channel.close()

    # ---- request -> plan ---------------------------------------------------------------
    def _ids_of(self, text: str, field_name: str) -> list[int]:
        if len(text) > 1 << 20:
            raise InvalidRequest(field_name, "longer than 1 MiB")
        return self.tokens.tokenizer.encode(text, add_special_tokens=False)

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

    def plan(self, req: router_pb2.GenerateRequest, deadline: float | None) -> Plan:
        which = req.WhichOneof("prompt")
        if which == "prompt_text":
            prompt = self._ids_of(req.prompt_text, "prompt_text")
        elif which == "prompt_token_ids":
            prompt = list(req.prompt_token_ids.ids)
        else:
            raise InvalidRequest("prompt", "set prompt_text or prompt_token_ids")
        which = req.WhichOneof("suffix")
        if which == "suffix_text":
            suffix = self._ids_of(req.suffix_text, "suffix_text")
        elif which == "suffix_token_ids":
            suffix = list(req.suffix_token_ids.ids)
        else:
            suffix = list(self.tokens.default_suffix_ids)
        think_end = self.tokens.think_end_id
        stage1 = engine_pb.stage1_from_pb(
            req.stage1, default_stop_ids=(think_end,) if think_end is not None else ())
        beam = engine_pb.beam_from_pb(req.beam)
        cap = next((ep.capacity for ep in self.prefill if ep.capacity), None)
        if cap is not None:
            validate_prompt(prompt, vocab_size=cap.vocab_size, max_model_len=cap.max_model_len,
                            num_new_tokens=stage1.max_tokens + len(suffix) + beam.max_tokens)
            validate_token_ids(suffix, vocab_size=cap.vocab_size, field_name="suffix")
            validate_token_ids(stage1.stop_token_ids, vocab_size=cap.vocab_size,
                               field_name="stage1.stop_token_ids")
        elif not prompt:
            raise InvalidRequest("prompt", "is empty")
        if req.timeout_ms:
            t = time.monotonic() + req.timeout_ms / 1e3
            deadline = t if deadline is None else min(deadline, t)
        request_id = req.request_id or f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        if len(request_id) > 128:
            raise InvalidRequest("request_id", "longer than 128 characters")
        path = req.path
        if path == common_pb2.PATH_AUTO:
            longest_parent = len(prompt) + stage1.max_tokens
            path = (common_pb2.PATH_COLOCATED
                    if not self.decode or longest_parent < self.config.colocated_below_tokens
                    else common_pb2.PATH_HANDOFF)
        if path == common_pb2.PATH_HANDOFF and not self.decode:
            raise InvalidRequest("path", "no decode engine is configured")
        return Plan(request_id, prompt, suffix, stage1, beam, path, deadline)

    async def warm_up(self, timeout_s: float = 120.0,
                      pairs: list[tuple[Endpoint, Endpoint]] | None = None) -> dict[str, str]:
        """One tiny handoff per reachable (P, D) pair (``pairs``: those only). On their
        first handoff D adds P as a NIXL remote agent, with P's lease already running;
        on a 2-core host that was seen to take seconds, twice a whole lease (README: "The
        first handoff between a P and a D"). The router pays that before it serves, not
        a client, and again in the background for the pairs of an engine that answers
        after being down (restarted). A warm-up that fails is logged; the router serves
        anyway. Returns what happened per pair ("P -> D": "imported", "recomputed" or
        "failed: ..."); unreachable pairs are left out."""
        from kvhandoff.types import BeamParams

        everything = pairs is None
        pairs = list(itertools.product(self.prefill, self.decode)) if everything else pairs
        outcomes: dict[str, str] = {}
        for i, (p, d) in enumerate(pairs):
            if p.capacity is None or d.capacity is None:
                continue
            pair = f"{p.address} -> {d.address}"
            t0 = time.perf_counter()
            plan = Plan(f"warmup-{i}-{uuid.uuid4().hex[:8]}", list(range(10, 50)),
                        list(self.tokens.default_suffix_ids),
                        Stage1Params(max_tokens=2, temperature=0.0),
                        BeamParams(beam_width=1, max_tokens=1), common_pb2.PATH_HANDOFF,
                        time.monotonic() + timeout_s, pinned=(p, d))
            try:
                async for item in self.run(plan):
                    if isinstance(item, Outcome):
                        how = "recomputed" if item.failed_decode else "imported"
                        outcomes[pair] = how
                        logger.info("warm-up %s: %s in %.1fs", pair, how,
                                    time.perf_counter() - t0)
            except (TimeoutError, Exception) as e:  # noqa: BLE001 (logged; serve anyway)
                outcomes[pair] = f"failed: {e}"
                logger.warning("warm-up %s failed after %.1fs: %s", pair,
                               time.perf_counter() - t0, e)
        if everything:
            self._rewarm = True
        return outcomes

    def _warm_up_later(self, ep: Endpoint) -> None:
        if not self.decode:
            return
        pairs = ([(ep, d) for d in self.decode] if any(ep is p for p in self.prefill)
                 else [(p, ep) for p in self.prefill])
        logger.info("engine %s answers again: warming up its pairs", ep.address)
        task = asyncio.create_task(self.warm_up(pairs=pairs))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    # ---- engine choice -----------------------------------------------------------------
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
                    raise grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"decode pool too small: needs {need(biggest)} blocks "
                                     f"({num_prompt_tokens}-token prompt, beam width "
                                     f"{plan.beam.beam_width}, {plan.beam.max_tokens} beam "
                                     f"tokens), the largest decode engine holds "
                                     f"{biggest.capacity.num_total_blocks} (beam width up to "
                                     f"{biggest.capacity.max_beam_width})")
                my_turn = not self._decode_queue or self._decode_queue[0] is ticket
                fitting = [ep for ep in holding if need(ep) <= ep.num_unclaimed_blocks]
                if my_turn and fitting:
                    d = max(fitting, key=lambda ep: (ep.num_unclaimed_blocks, -ep.outstanding))
                    d.claims[key] = Claim(need(d))
                    return d
                if ticket not in self._decode_queue:
                    if len(self._decode_queue) >= cfg.decode_queue_limit:
                        raise grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"decode queue full: {len(self._decode_queue)} "
                                         f"requests wait for room on a decode engine "
                                         f"(limit {cfg.decode_queue_limit})")
                    self._decode_queue.append(ticket)
                    # The queue's head asks the Ds itself if nobody polls them.
                    max_age = 2 * cfg.capacity_poll_s
                left = wait_until - time.monotonic()
                if left <= 0:
                    if plan.deadline is not None and wait_until >= plan.deadline:
                        raise TimeoutError()
                    most = max(holding, key=lambda ep: ep.num_unclaimed_blocks)
                    raise grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"decode pool too small: no decode engine had room for "
                                     f"{need(most)} blocks within {cfg.decode_wait_s:g} s "
                                     f"(most unclaimed: {most.num_unclaimed_blocks} of "
                                     f"{most.capacity.num_total_blocks})")
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

    # ---- running -----------------------------------------------------------------------
    def _timeout(self, plan: Plan) -> float | None:
        if plan.deadline is None:
            return None
        left = plan.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError()
        return left

    async def run(self, plan: Plan) -> AsyncIterator[list[int] | Outcome]:
        """Yield stage-1 token batches as P samples them, then the Outcome."""
        t0 = time.perf_counter()
        handoff = plan.path == common_pb2.PATH_HANDOFF
        p = plan.pinned[0] if plan.pinned else self._pick_prefill()
        out = Outcome(plan, p.address, None)
        d = None
        key = object()  # this request's claim on D's blocks
        if handoff and plan.pinned:
            d = plan.pinned[1]
            out.decode = d.address
        elif handoff:
            # D is chosen first: P addresses (and signs) the handoff to it. The longest
            # stage-2 prompt the request can make is what must fit.
            longest = len(plan.prompt_ids) + plan.stage1.max_tokens + len(plan.suffix_ids) + 1
            d = await self._pick_decode(longest, plan, key)
            out.decode = d.address
        try:
            p.outstanding += 1
            try:
                call = p.stub.Stage1(engine_pb2.Stage1Request(
                    request_id=f"{plan.request_id}-s1", prompt_token_ids=plan.prompt_ids,
                    sampling=engine_pb.stage1_to_pb(plan.stage1), export=handoff,
                    target_engine_id=_handoff_target(d)),
                    timeout=self._timeout(plan))
                handoff_msg = None
                waiting_since = time.perf_counter()
                async for event in call:
                    out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
                    if event.new_token_ids:
                        out.thinking_ids.extend(event.new_token_ids)
                        yield list(event.new_token_ids)
                    if event.finish_reason:
                        out.stage1_finish_reason = event.finish_reason
                        if event.HasField("handoff"):
                            handoff_msg = event.handoff
                    waiting_since = time.perf_counter()
                out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
            finally:
                p.outstanding -= 1
            out.stage1_ms = (time.perf_counter() - t0) * 1e3

            parent = plan.prompt_ids + out.thinking_ids
            stage2_prompt = continuation_prompt(parent, plan.suffix_ids, self.tokens.think_end_id)
            out.suffix_ids = stage2_prompt[len(parent):]
            request = engine_pb2.Stage2Request(
                request_id=f"{plan.request_id}-s2", prompt_token_ids=stage2_prompt,
                beam=engine_pb.beam_to_pb(plan.beam))
            if handoff:
                if handoff_msg is None:
                    raise grpc_error(grpc.StatusCode.INTERNAL, "prefill engine exported no handoff")
                request.handoff.CopyFrom(handoff_msg)
                logger.debug("%s: stage 1 done in %.0f ms (%d tokens); stage 2 to %s, P's "
                             "lease ends in %.2fs", plan.request_id, out.stage1_ms,
                             len(out.thinking_ids), d.address,
                             handoff_msg.lease_expires_at - time.time())
            else:
                d = p
            try:
                out.stage2 = await self._stage2(d, request, plan, out, key)
            except (RouterError, grpc.aio.AioRpcError) as e:
                code = e.code if isinstance(e, RouterError) else e.code()
                # UNAVAILABLE: D is gone or its READ failed; FAILED_PRECONDITION: P's lease
                # ended before D could read (D was busy, or the transfer stalled).
                if not (handoff and code in (grpc.StatusCode.UNAVAILABLE,
                                             grpc.StatusCode.FAILED_PRECONDITION)
                        and self.config.on_handoff_failure == "recompute"):
                    raise
                # The parent's KV is out of reach; its token ids are not. P's blocks go back
                # when the lease ends (or at once, if D told P before it failed).
                reason = (e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)) or code.name
                logger.warning("%s: handoff to %s failed (%s); recomputing stage 2 from the "
                               "parent's token ids", plan.request_id, d.address, reason)
                out.failed_decode, out.handoff_failure = d.address, reason
                request.ClearField("handoff")
                request.request_id = f"{plan.request_id}-s2r"
                self._release(d, key)
                d = await self._pick_decode(len(stage2_prompt), plan, key, fresh=True)
                out.decode = d.address
                out.stage2 = await self._stage2(d, request, plan, out, key)
        finally:
            self._release(d, key)
        out.total_ms = (time.perf_counter() - t0) * 1e3
        yield out

    async def _stage2(self, d: Endpoint, request: engine_pb2.Stage2Request, plan: Plan,
                      out: Outcome, key: object) -> engine_pb2.Stage2Response:
        if key in d.claims:
            d.claims[key].sent_at = time.monotonic()
        d.outstanding += 1
        waiting_since = time.perf_counter()
        try:
            return await d.stub.Stage2(request, timeout=self._timeout(plan))
        finally:
            out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
            d.outstanding -= 1


def _handoff_target(d: Endpoint | None) -> str:
    if d is None or d.capacity is None:
        return ""
    return d.capacity.handoff_target or d.capacity.engine_id


class RouterError(Exception):
    """An error with a gRPC status decided by the router itself."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def grpc_error(code: grpc.StatusCode, message: str) -> RouterError:
    return RouterError(code, message)


def to_response(out: Outcome, tokenizer: Any,
                received_at: float | None = None) -> router_pb2.GenerateResponse:
    """The response; ``received_at`` (perf_counter when the call arrived) sets the
    router's own overhead."""
    s2 = out.stage2
    assert s2 is not None
    beams = list(s2.beams)
    for b in beams:
        b.text = tokenizer.decode(list(b.token_ids), skip_special_tokens=False)
    return router_pb2.GenerateResponse(
        request_id=out.plan.request_id,
        prompt_token_ids=out.plan.prompt_ids,
        thinking_token_ids=out.thinking_ids,
        thinking_text=tokenizer.decode(out.thinking_ids, skip_special_tokens=False),
        stage1_finish_reason=out.stage1_finish_reason,
        suffix_token_ids=out.suffix_ids,
        beams=beams,
        timings=router_pb2.Timings(
            stage1_ms=out.stage1_ms, stage2_first_step_ms=s2.first_step_ms,
            stage2_ms=s2.total_ms, total_ms=out.total_ms,
            router_overhead_ms=0.0 if received_at is None else max(
                (time.perf_counter() - received_at) * 1e3 - out.engine_ms, 0.0)),
        stats=router_pb2.HandoffStats(
            path=out.plan.path, prefill_endpoint=out.prefill, decode_endpoint=out.decode or "",
            num_parent_tokens=len(out.plan.prompt_ids) + len(out.thinking_ids),
            num_imported_tokens=s2.num_imported_tokens, num_bytes_moved=s2.num_imported_bytes,
            num_computed_tokens_first_step=s2.num_computed_tokens_first_step,
            num_computed_tokens_total=s2.num_computed_tokens_total,
            num_recomputed_beam_tokens=s2.num_recomputed_beam_tokens,
            recomputed=out.failed_decode is not None,
            failed_decode_endpoint=out.failed_decode or "",
            handoff_failure=out.handoff_failure),
    )

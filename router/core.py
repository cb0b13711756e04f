"""The router's logic: pick engines, run a two-stage request over gRPC, collect results.

Prompts arrive as text or token ids; text is tokenised once here and the parent is
never re-tokenised (stage 2's prompt is built from token ids). P is chosen by least
outstanding requests; D by capacity, before stage 1 (P addresses and, with a shared
secret, signs the handoff for that D): a D whose pool cannot hold the longest parent the
request can make, the suffix and the beam tails is skipped. If none can, the request
still goes to the D with the most free blocks: its scheduler refuses at admission
(RESOURCE_EXHAUSTED with the numbers) and tells P to release the parent's blocks at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from decode_engine.scheduler import blocks_needed
from kvhandoff import engine_pb
from kvhandoff.tls import ChannelTLS, aio_channel
from kvhandoff.types import InvalidRequest, Stage1Params, continuation_prompt, validate_prompt
from kvhandoff.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2

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
    #: A D's capacity snapshot younger than this is used as it is, less the blocks of
    #: requests the router sent it since; an older one is asked again before a pick.
    #: ``Router.poll_capacity`` refreshes every engine each ``capacity_poll_s`` so the
    #: request path rarely waits on a GetCapacity call (D's admission has the last word).
    capacity_max_age_s: float = 1.0
    capacity_poll_s: float = 0.25
    #: Requests the router runs at once; beyond it, RESOURCE_EXHAUSTED at once (the
    #: queue is the engines' schedulers, bounded by this).
    max_inflight: int = 256
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
    #: Blocks the requests sent here since ``capacity`` was taken will need.
    num_claimed_blocks: int = 0

    @property
    def num_unclaimed_blocks(self) -> int:
        return self.capacity.num_free_blocks - self.num_claimed_blocks if self.capacity else 0


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
        from kvhandoff.local import ModelTokens

        self.config = config
        self.tokens = ModelTokens.load(config.model)
        if endpoints is not None:
            self.prefill, self.decode = endpoints
        else:
            self.prefill = [self._endpoint(a) for a in config.prefill]
            self.decode = [self._endpoint(a) for a in config.decode]
        self._ids = itertools.count()

    def _endpoint(self, address: str) -> Endpoint:
        channel = aio_channel(address, self.config.channel_tls, CHANNEL_OPTIONS)
        return Endpoint(address, engine_pb2_grpc.EngineStub(channel), channel)

    async def close(self) -> None:
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
                if ep.capacity is not None:
                    code = e.code() if isinstance(e, grpc.aio.AioRpcError) else e.code
                    logger.warning("engine %s unavailable: %s", ep.address, code.name)
                capacity = None
            ep.capacity, ep.capacity_at, ep.num_claimed_blocks = capacity, asked_at, 0

        await asyncio.gather(*(one(ep) for ep in endpoints))

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
            bad = next((t for t in suffix if not 0 <= t < cap.vocab_size), None)
            if bad is not None:
                raise InvalidRequest("suffix", f"token id {bad} is outside the vocabulary")
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

    async def warm_up(self, timeout_s: float = 120.0) -> None:
        """One tiny handoff per reachable (P, D) pair. The first NIXL transfers between
        two engine processes set up their UCX connection, which was seen to take 10-30 s
        on a 2-core host (up to P's lease): the router pays that before it serves, not a
        client. A warm-up that fails is logged; the router serves anyway."""
        from kvhandoff.types import BeamParams

        for i, (p, d) in enumerate(itertools.product(self.prefill, self.decode)):
            if p.capacity is None or d.capacity is None:
                continue
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
                        logger.info("warm-up %s -> %s: %s in %.1fs", p.address, d.address,
                                    how, time.perf_counter() - t0)
            except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 (logged; serve anyway)
                logger.warning("warm-up %s -> %s failed after %.1fs: %s", p.address,
                               d.address, time.perf_counter() - t0, e)

    # ---- engine choice -----------------------------------------------------------------
    def _pick_prefill(self) -> Endpoint:
        live = [ep for ep in self.prefill if ep.capacity is not None] or self.prefill
        return min(live, key=lambda ep: ep.outstanding)

    async def _pick_decode(self, num_prompt_tokens: int, plan: Plan, *,
                           fresh: bool = False) -> Endpoint:
        """The D with the most unclaimed blocks among those that can hold the request
        (else among all live ones: its admission refuses with the numbers). ``fresh``
        asks every D first (after a failed handoff)."""
        oldest = time.monotonic() - self.config.capacity_max_age_s
        stale = [ep for ep in self.decode if fresh or ep.capacity_at < oldest]
        if stale:
            await self.refresh_capacity(stale)
        live = [ep for ep in self.decode if ep.capacity is not None]
        if not live:
            raise grpc_error(grpc.StatusCode.UNAVAILABLE, "no decode engine is reachable")

        def need(ep: Endpoint) -> int:
            return blocks_needed(num_prompt_tokens, ep.capacity.block_size,
                                 plan.beam.beam_width, plan.beam.max_tokens)

        fitting = [ep for ep in live if need(ep) <= ep.num_unclaimed_blocks
                   and plan.beam.beam_width <= ep.capacity.max_beam_width]
        d = max(fitting or live, key=lambda ep: (ep.num_unclaimed_blocks, -ep.outstanding))
        d.num_claimed_blocks += need(d)
        return d

    # ---- running -----------------------------------------------------------------------
    def _timeout(self, plan: Plan) -> float | None:
        if plan.deadline is None:
            return None
        left = plan.deadline - time.monotonic()
        if left <= 0:
            raise asyncio.TimeoutError()
        return left

    async def run(self, plan: Plan) -> AsyncIterator[list[int] | Outcome]:
        """Yield stage-1 token batches as P samples them, then the Outcome."""
        t0 = time.perf_counter()
        handoff = plan.path == common_pb2.PATH_HANDOFF
        p = plan.pinned[0] if plan.pinned else self._pick_prefill()
        out = Outcome(plan, p.address, None)
        d = None
        if handoff and plan.pinned:
            d = plan.pinned[1]
            out.decode = d.address
        elif handoff:
            # D is chosen first: P addresses (and signs) the handoff to it. The longest
            # stage-2 prompt the request can make is what must fit.
            longest = len(plan.prompt_ids) + plan.stage1.max_tokens + len(plan.suffix_ids) + 1
            d = await self._pick_decode(longest, plan)
            out.decode = d.address
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
        else:
            d = p
        try:
            out.stage2 = await self._stage2(d, request, plan, out)
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
            d = await self._pick_decode(len(stage2_prompt), plan, fresh=True)
            out.decode = d.address
            out.stage2 = await self._stage2(d, request, plan, out)
        out.total_ms = (time.perf_counter() - t0) * 1e3
        yield out

    async def _stage2(self, d: Endpoint, request: engine_pb2.Stage2Request, plan: Plan,
                      out: Outcome) -> engine_pb2.Stage2Response:
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

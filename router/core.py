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
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from kvhandoff.model import ModelTokens
from kvhandoff.tls import ChannelTLS, aio_channel
from kvhandoff.types import continuation_prompt
from kvhandoff.v1 import common_pb2, engine_pb2, engine_pb2_grpc, router_pb2
from router.capacity import CapacityMixin, Endpoint, EngineObserver
from router.parents import ParentRegistry, ParentsMixin
from router.plan import Outcome, Plan, RouterError, grpc_error, plan_request
from router.warmup import WarmUpMixin
from server import convert

logger = logging.getLogger(__name__)

#: Keepalive: an engine whose host vanished (no FIN, no RST: a link down, a machine
#: gone) fails the calls in flight to it within ~20 s (a ping every 10 s, 10 s to answer)
#: instead of when TCP gives up (minutes). A stopped process (SIGSTOP) answers pings once
#: it resumes: pauses under 10 s do not end its calls. The engine servers accept pings
#: this often (server.grpc_common.SERVER_OPTIONS).
KEEPALIVE_MS = 10_000
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

HANDOFF_FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class _Running:
    """A two-stage request from its start to its end (Router.Move, Router.Drain)."""

    plan: Plan
    #: The P running stage 1 (another one after a resume).
    p: Endpoint
    d: Endpoint | None
    #: Stage 1's request id on ``p`` (what P's Stop names).
    s1_id: str = ""
    stage: int = 1
    #: "move" or "drain" once a move was asked for (until the destination streams).
    move_reason: str = ""
    #: The P a move asked for goes to (None: the request's D).
    move_to: Endpoint | None = None
    #: Stage 1 was finished on ``d`` (P died with no other P to resume on): D's prefix
    #: cache holds the parent, stage 2 needs no handoff.
    stage1_on_d: bool = False
    #: Set when the request ended; ``error`` then says how it ended.
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    error: BaseException | None = None

    @property
    def move_asked(self) -> bool:
        return bool(self.move_reason)

    def uses(self, ep: Endpoint) -> bool:
        return ep is self.p if self.stage == 1 else ep is self.d


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
    #: Parents (StartParent) the registry keeps for continuations, least recently used
    #: evicted first; each is forgotten this long after its last use.
    max_parents: int = 256
    parent_ttl_s: float = 300.0
    #: The share of P's pool held parents may keep (new stage 1s keep the rest).
    parent_pool_share: float = 0.25
    #: How long P holds a parent's blocks (seconds, at most P's lease); 0: P's lease.
    parent_hold_s: float = 0.0
    #: Sample positionally (engine.sampling) unless a request says otherwise; False:
    #: vLLM's own sampling unless a request asks for positional.
    positional_sampling: bool = True

    def __post_init__(self) -> None:
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
        if self.parent_hold_s < 0:
            raise ValueError("parent_hold_s must be >= 0")
        if not 0 <= self.parent_pool_share <= 1:
            raise ValueError("parent_pool_share must be in [0, 1]")
        if self.on_handoff_failure not in HANDOFF_FAILURE_POLICIES:
            raise ValueError(f"on_handoff_failure must be one of {HANDOFF_FAILURE_POLICIES}")



class Router(CapacityMixin, ParentsMixin, WarmUpMixin):
    """Runs two-stage requests over P and D (see the module docstring)."""

    def __init__(self, config: RouterConfig,
                 endpoints: tuple[list[Endpoint], list[Endpoint]] | None = None):
        """``endpoints`` (P, D) replace gRPC channels to ``config``'s addresses (the Ray
        Serve router passes deployment handles)."""
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
        #: Told of engine state changes and capacity answers (RouterMetrics.track_engines).
        self.observer = EngineObserver()
        #: Requests in stage 1, by request id (Router.Move).
        self._running: dict[str, _Running] = {}
        #: Parents served by StartParent, for continuations (router.parents).
        self.parents = ParentRegistry(config.max_parents, config.parent_ttl_s,
                                      config.parent_pool_share)

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

    def plan(self, req: router_pb2.GenerateRequest, deadline: float | None) -> Plan:
        return plan_request(
            req, deadline, tokens=self.tokens,
            prefill_capacity=next((ep.capacity for ep in self.prefill if ep.capacity), None),
            has_decode=bool(self.decode),
            colocated_below_tokens=self.config.colocated_below_tokens,
            new_id=lambda: f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}",
            positional=self.config.positional_sampling)

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
        p = plan.pinned[0] if plan.pinned else await self._pick_prefill(plan)
        out = Outcome(plan, p.address, None)
        d = None
        key = object()  # this request's claim on D's blocks
        running = _Running(plan, p, None, s1_id=f"{plan.request_id}-s1")
        tracked = self._running.setdefault(plan.request_id, running) is running
        try:
            if handoff and plan.pinned:
                d = plan.pinned[1]
            elif handoff:
                # D is chosen first: P addresses (and signs) the handoff to it. The longest
                # stage-2 prompt the request can make is what must fit.
                longest = (len(plan.prompt_ids) + plan.stage1.max_tokens
                           + len(plan.suffix_ids) + 1)
                d = await self._pick_decode(longest, plan, key)
            out.decode = d.address if d is not None else None
            running.d = d
            handoff_msg = None
            async for item in self._stage1_resuming(running, plan, out, export=handoff,
                                                    key=key):
                if isinstance(item, list):
                    yield item
                else:
                    handoff_msg = item
            # Stage 1 finished on D: D holds the parent, stage 2 reads its cache.
            on_d = running.stage1_on_d
            # A stage 1 stopped by a move ends "length" short of its max_tokens, with a
            # handoff of the tokens so far: it goes on at the move's destination.
            while (running.move_asked and handoff_msg is not None
                    and out.stage1_finish_reason == "length"
                    and len(out.thinking_ids) < plan.stage1.max_tokens):
                if running.move_to is not None:  # another P, which may be moved from again
                    source_handoff, handoff_msg = handoff_msg, None
                    async for item in self._move_to_p(running, source_handoff, plan, out,
                                                      key):
                        if isinstance(item, list):
                            yield item
                        else:
                            handoff_msg = item
                    continue
                running.stage = 2
                try:
                    async for rest in self._finish_stage1_on(d, handoff_msg, plan, out, key,
                                                             running.move_reason):
                        yield rest
                    on_d = True
                except (RouterError, grpc.aio.AioRpcError) as e:
                    if not self._move_resumable(e):
                        raise
                    handoff_msg = None
                    async for item in self._resume_after_failed_move(running, plan, out,
                                                                     key, e):
                        if isinstance(item, list):
                            yield item
                        else:
                            handoff_msg = item
                    d = running.d
                break
            running.stage = 2
            out.stage1_ms = (time.perf_counter() - t0) * 1e3
            request = self._stage2_request(plan, out)
            if handoff and not on_d:
                if handoff_msg is None:
                    raise grpc_error(grpc.StatusCode.INTERNAL, "prefill engine exported no handoff")
                request.handoff.CopyFrom(handoff_msg)
                logger.debug("%s: stage 1 done in %.0f ms (%d tokens); stage 2 to %s, P's "
                             "lease ends in %.2fs", plan.request_id, out.stage1_ms,
                             len(out.thinking_ids), d.address,
                             handoff_msg.lease_expires_at - time.time())
            elif not handoff:
                d = running.d = running.p
            d = await self._stage2_or_recompute(d, request, plan, out, key,
                                                handoff and not on_d)
            running.d = d
        except BaseException as e:
            running.error = e
            raise
        finally:
            self._release(d, key)
            if running.d is not d:  # a move that failed chose another D
                self._release(running.d, key)
            if tracked:
                del self._running[plan.request_id]
            running.done.set()
        out.total_ms = (time.perf_counter() - t0) * 1e3
        yield out

    async def _stage1_resuming(self, running: _Running, plan: Plan, out: Outcome, *,
                               export: bool, resume_at: int | None = None,
                               key: object | None = None
                               ) -> AsyncIterator[list[int] | common_pb2.Handoff]:
        """Stage 1 on ``running.p``; when that P fails mid-stream (UNAVAILABLE) and the
        request's tokens are positional, it resumes on another P in rotation from the
        prompt and the tokens streamed so far (their KV recomputed there, the move
        flagged "resume: ..."). The last streamed token is sampled again and must match:
        the new P's stream goes on from the next one. ``resume_at``: the first P starts
        that way too (a move whose destination failed). With no other P taking work and
        ``key`` given (``running.d`` is claimed under it for this request's stage 2),
        stage 1 is finished on that D from the tokens streamed so far (computed there,
        ``running.stage1_on_d``), as a move to D would, without a handoff."""
        while True:
            try:
                async for item in self._stage1(running.p, running.d, plan, out,
                                               export=export, resume_at=resume_at,
                                               request_id=running.s1_id):
                    yield item
                return
            except grpc.aio.AioRpcError as e:
                d = running.d if key is not None else None
                if not self._resumable(e, plan, on_d=d is not None):
                    raise
                failed, t = running.p, len(out.thinking_ids)
                reason = f"resume: {e.code().name}: {e.details()}"
                if d is not None and not any(ep.takes_work for ep in self.prefill
                                             if ep is not failed):
                    logger.warning("%s: P %s failed after %d stage-1 tokens (%s) and no "
                                   "other P takes work; finishing stage 1 on D %s",
                                   plan.request_id, failed.address, t, e.details(),
                                   d.address)
                    running.stage = 2  # from here the request runs on D
                    async for rest in self._finish_stage1_on(d, None, plan, out, key,
                                                             reason):
                        yield rest
                    running.stage1_on_d = True
                    return
                logger.warning("%s: P %s failed after %d stage-1 tokens (%s); resuming on "
                               "another P", plan.request_id, failed.address, t, e.details())
                running.p = await self._pick_prefill(plan, exclude=failed)
                resume_at = max(0, t - 1)
                running.s1_id = f"{plan.request_id}-s1r{len(out.moves)}"
                out.prefill = running.p.address
                out.moves.append(router_pb2.Move(
                    from_endpoint=failed.address, to_endpoint=running.p.address, at_token=t,
                    num_imported_tokens=0,
                    num_computed_tokens=len(plan.prompt_ids) + resume_at, reason=reason))

    async def _move_to_p(self, running: _Running, handoff: common_pb2.Handoff, plan: Plan,
                         out: Outcome, key: object
                         ) -> AsyncIterator[list[int] | common_pb2.Handoff]:
        """Stage 1, stopped on its P by a move to another P (``running.move_to``), goes on
        there: that P imports the tokens so far from ``handoff`` (checked up front by its
        scheduler, as D checks an import), samples on with the same (positional)
        sampling and exports to the request's D at the end. Yields its tokens, then its
        handoff. Movable again once the destination streams. When the destination fails
        (gone, or refused the import), stage 1 resumes on a P from every token so far,
        as after a failed move to D, with the same D."""
        source, dest, t = running.p, running.move_to, len(out.thinking_ids)
        assert dest is not None
        move = router_pb2.Move(from_endpoint=source.address, to_endpoint=dest.address,
                               at_token=t, reason=running.move_reason)
        out.moves.append(move)  # listed from the start: a failure stays in the record
        running.p, running.move_to = dest, None
        running.s1_id = f"{plan.request_id}-s1m{len(out.moves)}"
        out.prefill = dest.address
        streaming = False
        try:
            async for item in self._stage1(dest, running.d, plan, out, export=True,
                                           request_id=running.s1_id, import_from=handoff,
                                           move=move):
                if not streaming:  # the destination streams: movable again from here
                    running.move_reason, streaming = "", True
                yield item
        except (RouterError, grpc.aio.AioRpcError) as e:
            if not self._move_resumable(e):
                raise
            async for item in self._resume_after_failed_move(running, plan, out, key, e,
                                                             failed=dest, new_d=False):
                yield item
            return
        logger.info("%s: moved at token %d from %s to %s (%d imported, paused %.1f ms, "
                    "%d sampled there)", plan.request_id, t, source.address, dest.address,
                    move.num_imported_tokens, move.pause_ms, len(out.thinking_ids) - t)

    async def _resume_after_failed_move(self, running: _Running, plan: Plan, out: Outcome,
                                        key: object, e: Exception,
                                        failed: Endpoint | None = None, new_d: bool = True
                                        ) -> AsyncIterator[list[int] | common_pb2.Handoff]:
        """The engine a stage 1 was moving to (``failed``; by default its D) failed: gone,
        or refused the import. The request resumes on a P from its prompt and every
        token streamed so far (the source's and the destination's), the last sampled
        again and checked, exporting to its D; ``new_d``: a D chosen again (the failed
        one's claim released). Listed as a move "resume: <status>" from ``failed``."""
        failed, t = failed or running.d, len(out.thinking_ids)
        code = e.code if isinstance(e, RouterError) else e.code()
        details = str(e) if isinstance(e, RouterError) else e.details()
        logger.warning("%s: moving stage 1 to %s failed after %d tokens (%s: %s); resuming "
                       "on a P", plan.request_id, failed.address, t, code.name, details)
        if new_d:
            self._release(failed, key)
            longest = (len(plan.prompt_ids) + plan.stage1.max_tokens + len(plan.suffix_ids)
                       + 1)
            running.d = await self._pick_decode(longest, plan, key, fresh=True)
            out.decode = running.d.address
        running.p = await self._pick_prefill(plan, exclude=None if new_d else failed)
        # Stage 1 again, not movable again (move_reason stays set): a second stop would
        # end it short with no move to finish it.
        running.stage = 1
        running.s1_id = f"{plan.request_id}-s1r{len(out.moves)}"
        out.prefill = running.p.address
        resume_at = max(0, t - 1)
        out.moves.append(router_pb2.Move(
            from_endpoint=failed.address, to_endpoint=running.p.address, at_token=t,
            num_imported_tokens=0, num_computed_tokens=len(plan.prompt_ids) + resume_at,
            reason=f"resume: {code.name}: {details}"))
        async for item in self._stage1_resuming(running, plan, out, export=True,
                                                resume_at=resume_at):
            yield item

    def _move_resumable(self, e: Exception) -> bool:
        """A move's destination failed in a way stage 1 can resume from elsewhere: gone
        (UNAVAILABLE), no room (RESOURCE_EXHAUSTED), P's lease over (FAILED_PRECONDITION),
        under the "recompute" policy."""
        code = e.code if isinstance(e, RouterError) else e.code()
        return (self.config.on_handoff_failure == "recompute"
                and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             grpc.StatusCode.FAILED_PRECONDITION))

    def _resumable(self, e: grpc.aio.AioRpcError, plan: Plan, on_d: bool = False) -> bool:
        """P failed and stage 1 can go on elsewhere with the same tokens: P is gone
        (UNAVAILABLE), the policy is "recompute", the tokens are positional (or greedy)
        and there is another P, or a D to finish on (``on_d``)."""
        stage1 = plan.stage1
        return (e.code() == grpc.StatusCode.UNAVAILABLE
                and self.config.on_handoff_failure == "recompute"
                and (stage1.positional or stage1.temperature == 0)
                and (len(self.prefill) > 1 or on_d) and not plan.pinned)

    async def move(self, request_id: str, reason: str = "move",
                   to: str = "") -> router_pb2.MoveResponse:
        """Router.Move: ask P to stop ``request_id``'s stage 1 after its next token; its
        ``run`` then goes on at the destination: the D it is planned for
        (``_finish_stage1_on``), or the P at address ``to`` (``_move_to_p``)."""
        running = self._running.get(request_id)
        if running is None:
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"request {request_id!r} is not running here")
        why_not = _why_not_movable(running)
        if why_not:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r} {why_not}")
        dest = None
        if to and to != running.d.address:
            dest = next((ep for ep in self.prefill if ep.address == to), None)
            why_not = _why_not_to(dest, running, to, [*self.prefill, *self.decode])
            if why_not:
                code = (grpc.StatusCode.NOT_FOUND if why_not.startswith("unknown")
                        else grpc.StatusCode.FAILED_PRECONDITION)
                raise grpc_error(code, f"request {request_id!r} cannot move to {to}: "
                                       f"{why_not}")
        running.move_reason, running.move_to = reason, dest
        target = _handoff_target(dest) if dest is not None else ""
        try:
            await running.p.stub.Stop(engine_pb2.StopRequest(
                request_ids=[running.s1_id], target_engine_id=target),
                timeout=self.config.capacity_timeout_s)
        except BaseException:
            running.move_reason, running.move_to = "", None
            raise
        to_address = (dest or running.d).address
        logger.info("%s: moving stage 1 from %s to %s (%s)", request_id, running.p.address,
                    to_address, reason)
        return router_pb2.MoveResponse(from_endpoint=running.p.address,
                                       to_endpoint=to_address)

    async def drain(self, address: str, timeout_s: float = 300.0,
                    undo: bool = False) -> router_pb2.DrainResponse:
        """Router.Drain: no new work goes to the engine at ``address``; its running stage
        1s that can move go to their D (reason "drain"), the rest finish where they are.
        Returns once none of this router's requests use the engine (parents and
        continuations included), or after ``timeout_s``. ``undo``: back into rotation."""
        ep = next((e for e in (*self.prefill, *self.decode) if e.address == address), None)
        if ep is None:
            known = ", ".join(e.address for e in (*self.prefill, *self.decode))
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"engine {address!r} is not one of this router's ({known})")
        t0 = time.monotonic()
        if undo:
            ep.draining = False
            logger.info("%s takes new work again (drain undone)", address)
            self._decode_room_changed()
            return router_pb2.DrainResponse(endpoint=address, empty=True)
        ep.draining = True
        affected = [r for r in self._running.values() if r.uses(ep) or r.d is ep]
        logger.info("draining %s: %d running requests use it", address, len(affected))
        moved, in_place = 0, 0
        for r in affected:
            if r.stage == 1 and r.p is ep and not _why_not_movable(r):
                try:
                    await self.move(r.plan.request_id, reason="drain")
                    moved += 1
                    continue
                except (RouterError, grpc.aio.AioRpcError) as e:
                    logger.warning("drain of %s: %s not moved (%s)", address,
                                   r.plan.request_id, e)
            in_place += 1

        def busy() -> bool:
            return ep.outstanding > 0 or any(
                not r.done.is_set() and (r.uses(ep) or (r.stage == 1 and r.d is ep))
                for r in affected)

        deadline = t0 + timeout_s
        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        failed = sum(1 for r in affected if r.done.is_set() and r.error is not None)
        summary = router_pb2.DrainResponse(
            endpoint=address, moved=moved, finished_in_place=in_place, failed=failed,
            empty=not busy(), seconds=time.monotonic() - t0)
        logger.info("drained %s in %.2f s: %d moved, %d finished in place, %d failed%s",
                    address, summary.seconds, moved, in_place, failed,
                    "" if summary.empty else " (NOT empty at the timeout)")
        return summary

    async def _finish_stage1_on(self, d: Endpoint, handoff: common_pb2.Handoff | None,
                                plan: Plan, out: Outcome, key: object, reason: str
                                ) -> AsyncIterator[list[int]]:
        """Stage 1, stopped on P by a move, finished on ``d``: D imports what P has and
        samples the rest with the same (positional) sampling; yields the new tokens as D
        streams them. Without ``handoff`` (P is gone) D computes the tokens so far but the
        last, which it samples again and which must equal what was streamed (P may have
        died after its last token: D then only confirms it and the stop it made)."""
        t = len(out.thinking_ids)
        replay = min(1, t) if handoff is None else 0
        start = t - replay
        params = plan.stage1
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - start,
                                   min_tokens=max(0, params.min_tokens - start))
        request = engine_pb2.Stage2Request(
            request_id=f"{plan.request_id}-s1m", prompt_token_ids=plan.prompt_ids
            + out.thinking_ids[:start], sampling=convert.stage1_to_pb(rest))
        if handoff is not None:
            request.handoff.CopyFrom(handoff)
        first_at, resp = None, None
        # Listed from the start: a move whose destination fails stays in the record.
        move = router_pb2.Move(from_endpoint=out.prefill, to_endpoint=d.address, at_token=t,
                               reason=reason)
        out.moves.append(move)
        if key in d.claims:
            d.claims[key].sent_at = time.monotonic()
        d.outstanding += 1
        waiting_since = time.perf_counter()
        try:
            stream = d.stub.Stage2Stream(request, timeout=self._timeout(plan))
            async for event in stream:
                new = list(event.new_token_ids)
                if replay and new:
                    if new[0] != out.thinking_ids[start]:
                        if hasattr(stream, "cancel"):
                            stream.cancel()
                        raise grpc_error(grpc.StatusCode.INTERNAL,
                                         f"stage 1 finished on {d.address} sampled {new[0]} "
                                         f"where {out.thinking_ids[start]} was streamed")
                    new, replay = new[1:], 0
                if new:
                    first_at = first_at or time.perf_counter()
                    out.thinking_ids.extend(new)
                    yield new
                if event.HasField("result"):
                    resp = event.result
        finally:
            out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
            d.outstanding -= 1
        if resp is None:
            raise grpc_error(grpc.StatusCode.INTERNAL, f"{d.address} ended the moved stage 1 "
                             "without a result")
        new = len(out.thinking_ids) - t
        out.stage1_finish_reason = resp.beams[0].finish_reason if resp.beams else "length"
        pause_ms = ((first_at or time.perf_counter()) - out.last_token_at) * 1e3
        move.num_imported_tokens = resp.num_imported_tokens
        move.num_computed_tokens = resp.num_computed_tokens_first_step
        move.pause_ms, move.num_bytes_moved = pause_ms, resp.num_imported_bytes
        logger.info("%s: moved at token %d to %s (%d imported, paused %.1f ms, %d sampled "
                    "there)", plan.request_id, t, d.address, resp.num_imported_tokens,
                    pause_ms, new)

    async def _stage1(self, p: Endpoint, d: Endpoint | None, plan: Plan, out: Outcome, *,
                      export: bool, hold: bool = False, hold_s: float = 0.0,
                      resume_at: int | None = None, request_id: str = "",
                      import_from: common_pb2.Handoff | None = None,
                      move: router_pb2.Move | None = None
                      ) -> AsyncIterator[list[int] | common_pb2.Handoff]:
        """Stage 1 on P: yields token batches, then P's handoff (with ``export``; with
        ``hold`` P keeps the blocks for the whole lease, or ``hold_s``: a parent). ``hold``
        without ``export``: P holds the parent for continuations on P (``out.held_until``).
        ``resume_at``: P starts after the first ``resume_at`` tokens of ``out.thinking_ids``
        (their KV recomputed); the tokens it samples again must equal those already
        there, and only the ones after them are yielded. ``import_from``: P goes on after
        every token of ``out.thinking_ids``, importing them from another P's export (a
        move; ``move`` gets its counts and pause)."""
        prompt, params, replay = plan.prompt_ids, plan.stage1, 0
        if import_from is not None:
            resume_at = len(out.thinking_ids)
        if resume_at is not None:
            prompt = plan.prompt_ids + out.thinking_ids[:resume_at]
            params = dataclasses.replace(
                params, max_tokens=params.max_tokens - resume_at,
                min_tokens=max(0, params.min_tokens - resume_at))
            replay = len(out.thinking_ids) - resume_at
        request = engine_pb2.Stage1Request(
            request_id=request_id or f"{plan.request_id}-s1", prompt_token_ids=prompt,
            sampling=convert.stage1_to_pb(params), export=export, hold=hold, hold_s=hold_s,
            target_engine_id=_handoff_target(d))
        if import_from is not None:
            request.handoff.CopyFrom(import_from)
        p.outstanding += 1
        try:
            call = p.stub.Stage1(request, timeout=self._timeout(plan))
            waiting_since = time.perf_counter()
            async for event in call:
                out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
                new, logprobs = list(event.new_token_ids), list(event.logprobs)
                if replay and new:
                    k = min(replay, len(new))
                    again = out.thinking_ids[len(out.thinking_ids) - replay:][:k]
                    if new[:k] != again:
                        call.cancel()
                        raise grpc_error(grpc.StatusCode.INTERNAL,
                                         f"stage 1 resumed on {p.address} sampled {new[:k]} "
                                         f"where {again} was streamed")
                    new, logprobs, replay = new[k:], logprobs[k:], replay - k
                if new:
                    if move is not None and not move.pause_ms:
                        move.pause_ms = (time.perf_counter() - out.last_token_at) * 1e3
                    out.last_token_at = time.perf_counter()
                    out.thinking_ids.extend(new)
                    out.thinking_logprobs.extend(logprobs)
                    yield new
                if event.finish_reason:
                    out.stage1_finish_reason = event.finish_reason
                    out.held_until = event.held_until
                    if move is not None:
                        move.num_imported_tokens = event.num_imported_tokens
                        move.num_computed_tokens = event.num_computed_tokens
                        move.num_bytes_moved = event.num_imported_bytes
                    if event.HasField("handoff"):
                        yield event.handoff
                waiting_since = time.perf_counter()
            out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
        finally:
            p.outstanding -= 1

    def _stage2_request(self, plan: Plan, out: Outcome) -> engine_pb2.Stage2Request:
        """Stage 2's request: parent + suffix, from token ids (never re-tokenised); beam
        search, or sampling when the plan says so (a continuation)."""
        parent = plan.prompt_ids + out.thinking_ids
        stage2_prompt = continuation_prompt(parent, plan.suffix_ids, self.tokens.think_end_id)
        out.suffix_ids = stage2_prompt[len(parent):]
        request = engine_pb2.Stage2Request(
            request_id=f"{plan.request_id}-s2", prompt_token_ids=stage2_prompt,
            beam=convert.beam_to_pb(plan.beam))
        if plan.stage2_sampling is not None:
            request.sampling.CopyFrom(convert.stage1_to_pb(plan.stage2_sampling))
        return request

    async def _stage2_or_recompute(self, d: Endpoint, request: engine_pb2.Stage2Request,
                                   plan: Plan, out: Outcome, key: object,
                                   handoff: bool, *, recompute: bool | None = None
                                   ) -> Endpoint:
        """Stage 2 on ``d``; a handoff D cannot complete is recomputed from the parent's
        token ids on a live D (``recompute``; by default the router's policy is
        "recompute"). Returns the D that ran it."""
        if recompute is None:
            recompute = self.config.on_handoff_failure == "recompute"
        try:
            out.stage2 = await self._stage2(d, request, plan, out, key)
            return d
        except (RouterError, grpc.aio.AioRpcError) as e:
            code = e.code if isinstance(e, RouterError) else e.code()
            # UNAVAILABLE: D is gone or its READ failed; FAILED_PRECONDITION: P's lease
            # ended before D could read (D was busy, or the transfer stalled).
            if not (handoff and code in (grpc.StatusCode.UNAVAILABLE,
                                         grpc.StatusCode.FAILED_PRECONDITION)
                    and recompute):
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
        d = await self._pick_decode(len(request.prompt_token_ids), plan, key, fresh=True)
        out.decode = d.address
        try:
            out.stage2 = await self._stage2(d, request, plan, out, key)
        except BaseException:
            self._release(d, key)  # the caller releases only the D it chose
            raise
        return d

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


def _why_not_movable(running: _Running) -> str:
    """Why a running request cannot move to its D ("" when it can)."""
    if running.stage != 1:
        return "is past stage 1"
    if running.d is None:
        return ("has no D yet" if running.plan.path == common_pb2.PATH_HANDOFF
                else "runs colocated: no D to move it to")
    stage1 = running.plan.stage1
    if not (stage1.positional or stage1.temperature == 0):  # greedy is positional too
        return ("samples with vLLM's own sampling: moved, its tokens would change (use "
                "positional sampling)")
    if running.move_asked:
        return "is already being moved"
    if not running.d.takes_work:
        return (f"cannot move: its D {running.d.address} is "
                f"{'drained' if running.d.draining else 'out of rotation'}")
    return ""


def _why_not_to(dest: Endpoint | None, running: _Running, to: str,
                known: list[Endpoint]) -> str:
    """Why a running request cannot move to the P at ``to`` ("" when it can)."""
    if dest is None:
        if any(ep.address == to for ep in known):
            return "stage 1 moves to another prefill engine or to the request's own D"
        return f"unknown engine (this router's: {', '.join(ep.address for ep in known)})"
    if dest is running.p:
        return "stage 1 already runs there"
    if not dest.takes_work:
        return "it is " + ("drained" if dest.draining else "out of rotation")
    return ""


def _handoff_target(d: Endpoint | None) -> str:
    if d is None or d.capacity is None:
        return ""
    return d.capacity.handoff_target or d.capacity.engine_id

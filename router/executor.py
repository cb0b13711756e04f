"""The executor of a two-stage request: stage 1 on a P, the handoff, stage 2 on a D
(:meth:`Executor.run`), with what keeps a request alive when an engine fails or a move
asks it elsewhere: stage 1 resumed on another P, finished on D, or continued on the P
a move names; a handoff D cannot complete recomputed from token ids on a live D.

Engines are chosen from the pool (D before stage 1: P addresses, and with a shared
secret signs, the handoff for that D; the D with the most unclaimed blocks among those
whose pool can hold the longest parent the request can make, the suffix and the beam
tails, waiting in the pool's bounded queue when none has room). D's admission still has
the last word (it refuses with RESOURCE_EXHAUSTED and tells P to release the parent's
blocks at once). Each request owns at most one claim on a D at a time
(``Running.claim``), released when it ends, however it ends. A stage 2 a move stopped
on its D goes on on another (``router.search_moves``), as often as it is moved.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from kvhandoff.types import Path
from kvhandoff.v1 import common_pb2, engine_pb2
from router.config import RouterConfig
from router.endpoint import Claim, Endpoint
from router.errors import RouterError, code_of, details_of, grpc_error
from router.moves import MoveDesk, Running, Stage
from router.plan import Outcome, Plan
from router.pool import EnginePool
from router.requests import Move
from router.search_moves import Search, search_of
from router.stages import StageCalls, stage2_recomputed

logger = logging.getLogger(__name__)

#: D's refusals of a handoff that come before it reads anything (its checks of the
#: request, the catalog, the adapter and the signature): P is told to release the export.
#: Not RESOURCE_EXHAUSTED (D's scheduler tells P itself) nor UNAVAILABLE or
#: FAILED_PRECONDITION (a READ may have begun: the lease ends those).
REFUSED_BEFORE_READ = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                       grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE)

#: What a request's run yields: stage-1 token batches, then its Outcome.
Items = AsyncIterator[list[int] | Outcome]
_Stage1Items = AsyncIterator[list[int] | common_pb2.Handoff]


def longest_stage2(plan: Plan) -> int:
    """The longest stage-2 prompt ``plan`` can make: what a D must have room for."""
    return len(plan.prompt_ids) + plan.stage1.max_tokens + len(plan.suffix_ids) + 1


def shortest_stage2(plan: Plan) -> int:
    """The shortest (stage 1 ended at once): it can reserve more blocks than the longest
    (``kvhandoff.budget.stage2_reservation_upto``)."""
    return len(plan.prompt_ids) + len(plan.suffix_ids)


class Executor:
    def __init__(self, config: RouterConfig, pool: EnginePool, stages: StageCalls,
                 desk: MoveDesk):
        self.config, self.pool, self.stages, self.desk = config, pool, stages, desk

    async def run(self, plan: Plan) -> Items:
        """Yield stage-1 token batches as P samples them, then the Outcome."""
        t0 = time.perf_counter()
        handoff = plan.path == Path.HANDOFF
        # Colocated, stage 2 runs on P: a P that loaded its catalog (NOT_FOUND before
        # stage 1 when none did).
        p = plan.pinned[0] if plan.pinned else await self.pool.pick_prefill(
            plan.deadline, prompt_ids=plan.prompt_ids, adapter=plan.adapter,
            catalog=None if handoff else plan.beam.catalog, prefer=plan.prefer_prefill)
        out = Outcome(plan, p.address, None)
        running = Running(plan, p, None, s1_id=f"{plan.request_id}-s1", out=out)
        try:
            with self.desk.track(running):
                async for item in self._run(running, plan, out, t0, handoff):
                    yield item
        finally:
            if running.claim is not None:
                running.claim.release()
        out.total_ms = (time.perf_counter() - t0) * 1e3
        yield out

    async def _run(self, running: Running, plan: Plan, out: Outcome, t0: float,
                   handoff: bool) -> AsyncIterator[list[int]]:
        if handoff:
            # D is chosen first (or pinned: the warm-up's pair, which waits for room on
            # its D like any request): P addresses (and signs) the handoff to it.
            running.set_claim(await self.pool.pick_decode(
                longest_stage2(plan), plan.beam, plan.deadline, prompt_ids=plan.prompt_ids,
                shortest=shortest_stage2(plan), adapter=plan.adapter,
                only=[plan.pinned[1]] if plan.pinned else None,
                warming_ok=plan.pinned is not None))
        out.decode = running.d.address if running.d is not None else None
        handoff_msg = None
        async for item in self._stage1_resuming(running, plan, out, export=handoff,
                                                may_finish_on_d=True):
            if isinstance(item, list):
                yield item
            else:
                handoff_msg = item
        # Stage 1 finished on D: D holds the parent, stage 2 reads its cache.
        on_d = running.stage1_on_d
        while self._stopped_by_move(running, plan, out, handoff_msg):
            if running.move_to is not None:  # another P, which may be moved from again
                source_handoff, handoff_msg = handoff_msg, None
                async for item in self.move_to_p(running, source_handoff, plan, out):
                    if isinstance(item, list):
                        yield item
                    else:
                        handoff_msg = item
                continue
            running.enter(Stage.ON_D)
            try:
                async for rest in self.stages.finish_stage1_on(
                        running.d, running.claim, handoff_msg, plan, out,
                        running.move_reason):
                    yield rest
                on_d = True
            except (RouterError, grpc.aio.AioRpcError) as e:
                if not self._move_resumable(e):
                    raise
                handoff_msg = None
                async for item in self._resume_after_failed_move(running, plan, out, e):
                    if isinstance(item, list):
                        yield item
                    else:
                        handoff_msg = item
            break
        running.enter(Stage.ON_D)
        out.stage1_ms = (time.perf_counter() - t0) * 1e3
        request = self.stages.stage2_request(plan, out)
        if handoff and not on_d:
            if handoff_msg is None:
                raise grpc_error(grpc.StatusCode.INTERNAL, "prefill engine exported no handoff")
            request.handoff.CopyFrom(handoff_msg)
            logger.debug("%s: stage 1 done in %.0f ms (%d tokens); stage 2 to %s, P's "
                         "lease ends in %.2fs", plan.request_id, out.stage1_ms,
                         len(out.thinking_ids), running.d.address,
                         handoff_msg.lease_expires_at - time.time())
        elif not handoff:
            running.d = running.p
        running.search = search_of(plan, running.d, request, self.pool.decode)
        try:
            claim = await self.stage2_or_recompute(running.d, running.claim, request, plan,
                                                   out, handoff and not on_d,
                                                   search=running.search)
        except (RouterError, grpc.aio.AioRpcError) as e:
            if handoff and not on_d and code_of(e) in REFUSED_BEFORE_READ:
                await self._release_export(running.p, handoff_msg, plan, e)
            raise
        running.set_claim(claim)
        await self._follow_moves(running, plan, out, self.config.recompute)

    async def _follow_moves(self, running: Running, plan: Plan, out: Outcome,
                            recompute: bool) -> None:
        """While a move stopped ``running``'s search (``out.stage2``: D's answer), it
        goes on at the destination: D's claim is released at the stop, the
        destination's held once the resume returns (``go_on`` holds it until then)."""
        searches = self.desk.searches
        while searches.stopped(running.search, out):
            running.enter(Stage.ON_D)
            running.set_claim(None)  # D stopped it: its room there goes back now
            running.set_claim(await searches.go_on(running.search, plan, out, recompute))
        running.search = None

    async def continuation_stage2(self, p: Endpoint | None, claim: Claim,
                                  request: engine_pb2.Stage2Request, plan: Plan,
                                  out: Outcome, *, recompute: bool) -> None:
        """A continuation's stage 2 on ``claim``'s D, importing the parent ``p`` holds:
        in the desk's table while it runs, so Router.Move and Drain move its beam search
        to another D as they move a two-stage request's. Owns ``claim`` (and the claims
        of the Ds it runs on after a move or a recompute): all released here."""
        running = Running(plan, p, None, out=out)
        running.enter(Stage.ON_D)
        running.set_claim(claim)
        out.decode = claim.endpoint.address
        try:
            with self.desk.track(running):
                running.search = search_of(plan, claim.endpoint, request, self.pool.decode)
                running.set_claim(await self.stage2_or_recompute(
                    claim.endpoint, claim, request, plan, out, True, recompute=recompute,
                    search=running.search))
                await self._follow_moves(running, plan, out, recompute)
        finally:
            if running.claim is not None:
                running.claim.release()

    async def _stage1_resuming(self, running: Running, plan: Plan, out: Outcome, *,
                               export: bool, resume_at: int | None = None,
                               may_finish_on_d: bool = False) -> _Stage1Items:
        """Stage 1 on ``running.p``; when that P fails mid-stream (UNAVAILABLE) and the
        request's tokens are positional, it resumes on another P in rotation from the
        prompt and the tokens streamed so far (their KV recomputed there, the move
        flagged "resume: ..."). The last streamed token is sampled again and must match:
        the new P's stream goes on from the next one. ``resume_at``: the first P starts
        that way too (a move whose destination failed). With no other P taking work and
        ``may_finish_on_d`` (``running.d`` is claimed for this request's stage 2), stage
        1 is finished on that D from the tokens streamed so far (computed there,
        ``running.stage1_on_d``), as a move to D would, without a handoff."""
        while True:
            try:
                async for item in self.stages.stage1(running.p, running.d, plan, out,
                                                     export=export, resume_at=resume_at,
                                                     request_id=running.s1_id):
                    yield item
                return
            except grpc.aio.AioRpcError as e:
                d = running.d if may_finish_on_d else None
                if not self._resumable(e, plan, on_d=d is not None):
                    raise
                failed, t = running.p, len(out.thinking_ids)
                reason = f"resume: {e.code().name}: {e.details()}"
                if d is not None and not any(ep.takes_work for ep in self.pool.prefill
                                             if ep is not failed):
                    logger.warning("%s: P %s failed after %d stage-1 tokens (%s) and no "
                                   "other P takes work; finishing stage 1 on D %s",
                                   plan.request_id, failed.address, t, e.details(),
                                   d.address)
                    running.enter(Stage.ON_D)  # from here the request runs on D
                    async for rest in self.stages.finish_stage1_on(d, running.claim, None,
                                                                   plan, out, reason):
                        yield rest
                    running.stage1_on_d = True
                    return
                logger.warning("%s: P %s failed after %d stage-1 tokens (%s); resuming on "
                               "another P", plan.request_id, failed.address, t, e.details())
                running.p = await self.pool.pick_prefill(plan.deadline, exclude=failed,
                                                         adapter=plan.adapter)
                resume_at = max(0, t - 1)
                running.s1_id = f"{plan.request_id}-s1r{len(out.moves)}"
                out.prefill = running.p.address
                out.moves.append(Move(
                    from_endpoint=failed.address, to_endpoint=running.p.address, at_token=t,
                    num_imported_tokens=0,
                    num_computed_tokens=len(plan.prompt_ids) + resume_at, reason=reason))

    @staticmethod
    def _stopped_by_move(running: Running, plan: Plan, out: Outcome,
                         handoff_msg: common_pb2.Handoff | None) -> bool:
        """Whether stage 1, just ended on its P, was ended by a move's stop (and goes on
        at the move's destination); settles the move's ask either way. A stopped stage 1
        ends "length" short of its max_tokens, with a handoff of the tokens so far."""
        stopped = (running.move_asked and handoff_msg is not None
                   and out.stage1_finish_reason == "length"
                   and len(out.thinking_ids) < plan.stage1.max_tokens)
        if running.move_asked:
            running.settle_move(stopped)
        return stopped

    async def move_to_p(self, running: Running, handoff: common_pb2.Handoff, plan: Plan,
                        out: Outcome) -> _Stage1Items:
        """Stage 1, stopped on its P by a move to another P (``running.move_to``), goes on
        there: that P imports the tokens so far from ``handoff`` (checked up front by its
        scheduler, as D checks an import), samples on with the same (positional)
        sampling and exports to the request's D at the end. Yields its tokens, then its
        handoff. Movable again once the destination streams. When the destination fails
        (gone, or refused the import), stage 1 resumes on a P from every token so far,
        as after a failed move to D, with the same D."""
        source, dest, t = running.p, running.move_to, len(out.thinking_ids)
        assert dest is not None, "move_to_p without a destination P"
        move = Move(from_endpoint=source.address, to_endpoint=dest.address, at_token=t,
                    reason=running.move_reason)
        out.moves.append(move)  # listed from the start: a failure stays in the record
        running.p, running.move_to = dest, None
        running.s1_id = f"{plan.request_id}-s1m{len(out.moves)}"
        out.prefill = dest.address
        streaming = False
        try:
            async for item in self.stages.stage1(dest, running.d, plan, out, export=True,
                                                 request_id=running.s1_id,
                                                 import_from=handoff, move=move):
                if not streaming:  # the destination streams: movable again from here
                    running.move_reason, streaming = "", True
                yield item
        except (RouterError, grpc.aio.AioRpcError) as e:
            if not self._move_resumable(e):
                raise
            async for item in self._resume_after_failed_move(running, plan, out, e,
                                                             failed=dest, new_d=False):
                yield item
            return
        logger.info("%s: moved at token %d from %s to %s (%d imported, paused %.1f ms, "
                    "%d sampled there)", plan.request_id, t, source.address, dest.address,
                    move.num_imported_tokens, move.pause_ms, len(out.thinking_ids) - t)

    async def _resume_after_failed_move(self, running: Running, plan: Plan, out: Outcome,
                                        e: Exception, failed: Endpoint | None = None,
                                        new_d: bool = True) -> _Stage1Items:
        """The engine a stage 1 was moving to (``failed``; by default its D) failed: gone,
        or refused the import. The request resumes on a P from its prompt and every
        token streamed so far (the source's and the destination's), the last sampled
        again and checked, exporting to its D; ``new_d``: a D chosen again (the failed
        one's claim released). Listed as a move "resume: <status>" from ``failed``."""
        failed, t = failed or running.d, len(out.thinking_ids)
        code, details = code_of(e), details_of(e)
        logger.warning("%s: moving stage 1 to %s failed after %d tokens (%s: %s); resuming "
                       "on a P", plan.request_id, failed.address, t, code.name, details)
        if new_d:
            running.set_claim(None)
            running.set_claim(await self.pool.pick_decode(
                longest_stage2(plan), plan.beam, plan.deadline, fresh=True,
                shortest=shortest_stage2(plan), adapter=plan.adapter))
            out.decode = running.d.address
        running.p = await self.pool.pick_prefill(plan.deadline,
                                                 exclude=None if new_d else failed,
                                                 adapter=plan.adapter)
        # Stage 1 again, not movable again (move_reason stays set): a second stop would
        # end it short with no move to finish it.
        running.enter(Stage.ON_P)
        running.s1_id = f"{plan.request_id}-s1r{len(out.moves)}"
        out.prefill = running.p.address
        resume_at = max(0, t - 1)
        out.moves.append(Move(
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
        return self.config.recompute and code_of(e) in (
            grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.FAILED_PRECONDITION)

    def _resumable(self, e: grpc.aio.AioRpcError, plan: Plan, on_d: bool = False) -> bool:
        """P failed and stage 1 can go on elsewhere with the same tokens: P is gone
        (UNAVAILABLE), the policy is "recompute", the tokens are positional (or greedy)
        and there is another P, or a D to finish on (``on_d``)."""
        stage1 = plan.stage1
        return (e.code() == grpc.StatusCode.UNAVAILABLE and self.config.recompute
                and (stage1.positional or stage1.temperature == 0)
                and (len(self.pool.prefill) > 1 or on_d) and not plan.pinned
                and plan.blend is None)  # recomputed elsewhere, its tokens would change

    async def _release_export(self, p: Endpoint, handoff: common_pb2.Handoff, plan: Plan,
                              refusal: Exception) -> None:
        """D refused the handoff before reading it: P's blocks go back now, not at the
        lease's end. Best effort: the lease still ends them if P cannot be told."""
        try:
            await self.stages.release(p, [handoff.request_id], handoff.engine_id)
            logger.info("%s: D refused the handoff (%s); P %s released its export",
                        plan.request_id, code_of(refusal).name, p.address)
        except (RouterError, grpc.aio.AioRpcError) as e:
            logger.warning("%s: could not tell P %s to release its export (%s); its lease "
                           "ends it", plan.request_id, p.address, code_of(e).name)

    # ---- stage 2 ----------------------------------------------------------------------
    async def stage2_or_recompute(self, ep: Endpoint, claim: Claim | None,
                                  request: engine_pb2.Stage2Request, plan: Plan,
                                  out: Outcome, handoff: bool, *,
                                  recompute: bool | None = None,
                                  search: Search | None = None) -> Claim | None:
        """Stage 2 on ``ep`` (``claim``: its room there); a handoff D cannot complete is
        recomputed from the parent's token ids on a live D (``recompute``; by default
        the router's policy). Returns the claim of the D that ran it (the caller
        releases it); a claim taken here for a recompute that fails is released here.
        ``search``: the request's, told where a recompute runs (a move stops it there)."""
        if recompute is None:
            recompute = self.config.recompute
        try:
            out.stage2 = await self.stages.stage2(ep, claim, request, plan, out)
            return claim
        except (RouterError, grpc.aio.AioRpcError) as e:
            code = code_of(e)
            # UNAVAILABLE: D is gone or its READ failed; FAILED_PRECONDITION: P's lease
            # ended before D could read (D was busy, or the transfer stalled).
            if not (handoff and recompute and code in (grpc.StatusCode.UNAVAILABLE,
                                                       grpc.StatusCode.FAILED_PRECONDITION)):
                raise
            # The parent's KV is out of reach; its token ids are not. P's blocks go back
            # when the lease ends (or at once, if D told P before it failed).
            reason = details_of(e) or code.name
            logger.warning("%s: handoff to %s failed (%s); recomputing stage 2 from the "
                           "parent's token ids", plan.request_id, ep.address, reason)
            out.failed_decode, out.handoff_failure = ep.address, reason
        request.ClearField("handoff")
        request.request_id = f"{plan.request_id}-s2r"
        if claim is not None:
            claim.release()
        return await stage2_recomputed(self.pool, self.stages, request, plan, out, search)

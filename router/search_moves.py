"""Moving a running stage 2 (issue 59): a request's beam search on a D stopped after its
next beam step and resumed on another D, with the beams of the search left unmoved.

Two sides over one :class:`Search` per request in stage 2 (``Running.search``):

- the desk's (:meth:`SearchMoves.move`, for ``MoveDesk.move`` and ``Drain``): take a
  claim on the destination D′ (room for the search's peak, as a normal stage 2), ask D
  to stop the search (Stop naming D′'s handoff target: D's export of the prompt's KV is
  addressed, and signed, for D′), and answer once the request's run knows whether D
  stopped it (OK) or the search ended first (FAILED_PRECONDITION, nothing moved);
- the run's (:meth:`SearchMoves.stopped` then :meth:`SearchMoves.go_on`, for
  ``router.executor``): D's Stage2 answered ``stopped``; the run resumes it on D′
  (Stage2Request.resume), holding D′'s claim instead of D's. The resumed search can be
  moved again.

Who owns the destination's claim: the desk from taking it until the run reads D's
answer (the desk releases it only when its Stop failed); then the run (adopted when
stopped, released when the search ended first; released by ``MoveDesk.track`` when the
request ends meanwhile).

When D′ fails the resume (gone, no room, the export's lease over, a refused import), the
stage 2 is recomputed from its prompt's token ids on a D with room (D itself included),
flagged as recomputed (``failed_decode``: D′), under the router's "recompute" policy;
the simplest correct choice: a fresh beam search over the same prompt gives the same
beams, and nothing of the stopped search is needed. D's export then ends with its lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvhandoff.types import BeamParams
from kvhandoff.v1 import engine_pb2
from router.endpoint import Claim, Endpoint
from router.errors import RouterError, code_of, details_of, grpc_error
from router.plan import Outcome, Plan
from router.pool import EnginePool
from router.requests import Move, Moved
from router.stages import StageCalls, stage2_recomputed
from wire import common as convert

logger = logging.getLogger(__name__)

#: The longest a move waits for room on another D before answering FAILED_PRECONDITION.
MOVE_ROOM_WAIT_S = 2.0
#: The longest a move waits for D's answer after the Stop: a search still in its step 0
#: stops after its first beam step (``decode_engine.search_stops``), so step 0 (its
#: import) and one beam step.
STOP_ANSWER_S = 45.0
#: How often the Stop is sent again meanwhile (D ignores one that reached it before the
#: search did).
STOP_RESEND_S = 0.05
#: Statuses of a failed resume that a recompute does not follow (the request's own end).
_NOT_RECOMPUTED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


@dataclass(eq=False)
class Search:
    """A request's stage 2 running on an engine, as a move sees it. Written by the run
    (``d``, ``request_id`` when it goes elsewhere) and by the desk (``reason``,
    ``dest``, ``taken`` when a move is asked)."""

    #: The engine running it, and the stage-2 request id there (what D's Stop names).
    d: Endpoint
    request_id: str
    #: Its prompt's length, beam and adapter (the room a destination needs).
    prompt_len: int
    beam: BeamParams
    adapter: str = ""
    #: Why it cannot move at all ("": it can).
    not_movable: str = ""
    #: "move" or "drain" once a move was asked (until it runs at the destination).
    reason: str = ""
    #: The destination's claim while the desk or the run holds it for the move.
    dest: Claim | None = None
    #: Settled by the run with D's answer: True stopped (it moves), False ended.
    taken: asyncio.Future | None = None
    #: Set by the run when D answered with the search's end (not stopped): a move asked
    #: after that, or while it waited for room, has nothing to stop.
    ended: bool = False

    def why_not_movable(self) -> str:
        return self.not_movable or ("is already being moved" if self.reason else "")

    def settle(self, taken: bool) -> None:
        if self.taken is not None and not self.taken.done():
            self.taken.set_result(taken)

    def abandon(self, error: BaseException) -> None:
        """The request ended (``error``) while a move was asked: the desk hears of it and
        the destination's claim goes back."""
        if self.taken is not None and not self.taken.done():
            self.taken.set_exception(error)
        if self.dest is not None:
            self.dest.release()
            self.dest = None


def search_of(plan: Plan, ep: Endpoint, request: engine_pb2.Stage2Request,
              decode: list[Endpoint]) -> Search:
    """The Search of ``request`` (stage 2 of ``plan``) about to run on ``ep``; it says
    why it cannot move when it is sampled, not on a D (colocated, a parent's P), or on
    an address standing for several engines that cannot tell which one runs it (a Stop
    would reach any of them: ``Endpoint.finds_runs``)."""
    why = ""
    if not any(ep is d for d in decode):
        why = "runs its stage 2 on a prefill engine (colocated): no D to move it from"
    elif request.HasField("sampling"):
        why = "samples its stage 2: only a beam search moves between Ds"
    elif not ep.finds_runs:
        why = (f"runs its stage 2 on {ep.address}, which stands for several engines "
               "(Serve): the one running it cannot be told to stop it")
    return Search(ep, request.request_id, len(request.prompt_token_ids), plan.beam,
                  plan.adapter, not_movable=why)


class SearchMoves:
    def __init__(self, pool: EnginePool, stages: StageCalls):
        self.pool, self.stages = pool, stages

    # ---- the desk's side --------------------------------------------------------------
    async def move(self, search: Search, request_id: str, reason: str, to: str) -> Moved:
        """Router.Move of a request in stage 2 (``search``, movable): to the D at ``to``
        or ("") the router's choice of another D with room. Answers once D stopped it
        (from, to), or FAILED_PRECONDITION when it ended first (nothing moved)."""
        source = search.d
        claim = await self._room(search, request_id, to)
        if search.ended:  # it ended while the move waited for room: nothing to stop
            claim.release()
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r}: its beam search ended on "
                             f"{source.address} before the stop took effect (nothing "
                             "moved)")
        search.reason, search.dest = reason, claim
        taken = search.taken = asyncio.get_running_loop().create_future()
        # Read even when this call gave up waiting (no "never retrieved" at exit).
        taken.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await self.stages.stop(source, search.request_id, claim.endpoint.handoff_target)
        except BaseException:
            search.reason, search.taken = "", None
            if search.dest is claim:
                search.dest = None
            claim.release()
            raise
        moving = await self._answer(search, taken, source, request_id,
                                    claim.endpoint.handoff_target)
        if not moving:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r}: its beam search ended on "
                             f"{source.address} before the stop took effect (nothing "
                             "moved)")
        logger.info("%s: moving its beam search from %s to %s (%s)", request_id,
                    source.address, claim.endpoint.address, reason)
        return Moved(from_endpoint=source.address, to_endpoint=claim.endpoint.address)

    async def _answer(self, search: Search, taken: asyncio.Future, source: Endpoint,
                      request_id: str, target: str) -> bool:
        """D's answer as the run settles it. D ignores a Stop naming a search it does
        not run yet (the run's Stage2 call may still be on its way): the Stop is sent
        again every :data:`STOP_RESEND_S` while the same search runs there unanswered
        (a repeat of a Stop D already holds changes nothing)."""
        stage2_id, deadline = search.request_id, time.monotonic() + STOP_ANSWER_S
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(taken), STOP_RESEND_S)
            except TimeoutError:
                pass
            if search.ended:
                return False
            if time.monotonic() >= deadline:
                raise grpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"request {request_id!r}: {source.address} did not stop "
                                 f"its search within {STOP_ANSWER_S:g} s (it still may: "
                                 "the move goes on)")
            if search.d is source and search.request_id == stage2_id:
                try:
                    await self.stages.stop(source, stage2_id, target)
                except (RouterError, grpc.aio.AioRpcError) as e:
                    logger.warning("%s: Stop sent again to %s failed (%s)", request_id,
                                   source.address, code_of(e).name)

    async def _room(self, search: Search, request_id: str, to: str) -> Claim:
        """A claim on the destination: the D at ``to``, or another D with room. Where
        the search's address stands for several engines (Serve's Decode), that address
        is a destination too: the resume sent there goes to another of its engines
        (``Endpoint.finds_runs``)."""
        here = search.d
        others = [ep for ep in self.pool.decode if ep is not here or not here.one_engine]
        if to:
            dest = self.pool.find(to)
            why = ""
            if dest is None:
                raise grpc_error(grpc.StatusCode.NOT_FOUND,
                                 f"request {request_id!r} cannot move to {to}: unknown "
                                 f"engine (this router's: {self.pool.known()})")
            if dest is here and here.one_engine:
                why = "its beam search already runs there"
            elif not any(dest is d for d in others):
                why = "a beam search moves to another decode engine"
            elif not dest.takes_work:
                why = "it is " + ("drained" if dest.draining else "out of rotation")
            if why:
                raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"request {request_id!r} cannot move to {to}: {why}")
            others = [dest]
        if not any(ep.takes_work for ep in others):
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r}: no other decode engine takes work "
                             "to move its beam search to")
        try:
            return await self.pool.pick_decode(
                search.prompt_len, search.beam, time.monotonic() + MOVE_ROOM_WAIT_S,
                only=others, adapter=search.adapter)
        except (RouterError, TimeoutError) as e:
            why = str(e) or f"none within {MOVE_ROOM_WAIT_S:g} s"
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r}: no other decode engine has room for "
                             f"its beam search ({why})") from None

    # ---- the run's side ---------------------------------------------------------------
    @staticmethod
    def stopped(search: Search | None, out: Outcome) -> bool:
        """Whether the stage 2 just answered (``out.stage2``) was stopped by a move;
        settles the move's ask either way (a search that ended gives back the
        destination's claim)."""
        stopped = out.stage2 is not None and out.stage2.HasField("stopped")
        if search is None:
            if stopped:
                raise grpc_error(grpc.StatusCode.INTERNAL,
                                 "a stage 2 no move asked for answered stopped")
            return False
        search.settle(stopped)
        search.ended = not stopped
        if not stopped and search.dest is not None:
            search.dest.release()
            search.dest = None
        return stopped

    async def go_on(self, search: Search, plan: Plan, out: Outcome,
                    recompute: bool) -> Claim:
        """The search D stopped (``out.stage2.stopped``) goes on at the move's
        destination (its claim, or a D picked now when the desk gave up waiting), listed
        in ``out.moves``; a destination that fails it is followed by a recompute (module
        docstring) when ``recompute``. Returns the claim of the D that ran it (the
        caller holds it instead of D's); ``out.stage2`` is that D's answer (stopped
        again, when moved again)."""
        stopped = out.stage2.stopped
        source, claim = search.d, search.dest
        search.dest, search.taken = None, None
        move = Move(from_endpoint=source.address, at_token=len(out.thinking_ids),
                    reason=search.reason or "move", at_beam_step=stopped.steps_done)
        out.moves.append(move)  # listed from the start: a failure stays in the record
        search.reason = ""
        request = engine_pb2.Stage2Request(
            request_id=f"{plan.request_id}-s2m{len(out.moves)}",
            prompt_token_ids=stopped.prompt_token_ids, beam=convert.beam_to_pb(plan.beam),
            adapter=plan.adapter, resume=stopped)
        try:
            if claim is None:
                claim = await self.pool.pick_decode(search.prompt_len, plan.beam,
                                                    plan.deadline, fresh=True,
                                                    adapter=plan.adapter)
            dest = claim.endpoint
            move.to_endpoint = out.decode = dest.address
            search.d, search.request_id = dest, request.request_id
            try:
                out.stage2 = await self.stages.stage2(dest, claim, request, plan, out)
            except (RouterError, grpc.aio.AioRpcError) as e:
                if not recompute or code_of(e) in _NOT_RECOMPUTED:
                    raise
                return await self._recompute(search, claim, request, plan, out, e)
        except BaseException:
            if claim is not None:
                claim.release()
            raise
        resp = out.stage2
        move.num_imported_tokens = resp.num_imported_tokens
        move.num_computed_tokens = resp.num_computed_tokens_first_step
        move.num_bytes_moved, move.pause_ms = resp.num_imported_bytes, resp.first_step_ms
        move.from_engine_id, move.to_engine_id = stopped.export.engine_id, resp.engine_id
        logger.info("%s: beam search moved at step %d from %s to %s (%d imported)",
                    plan.request_id, stopped.steps_done, source.address, dest.address,
                    resp.num_imported_tokens)
        return claim

    async def _recompute(self, search: Search, failed: Claim,
                         request: engine_pb2.Stage2Request, plan: Plan, out: Outcome,
                         e: Exception) -> Claim:
        """The resume failed on ``failed``'s D: stage 2 again from its prompt's token ids
        on a D with room, flagged as recomputed; returns that D's claim."""
        reason = details_of(e) or code_of(e).name
        logger.warning("%s: resuming its moved beam search on %s failed (%s); recomputing "
                       "stage 2 from its token ids", plan.request_id,
                       failed.endpoint.address, reason)
        out.failed_decode, out.handoff_failure = failed.endpoint.address, reason
        failed.release()
        request = engine_pb2.Stage2Request(
            request_id=f"{plan.request_id}-s2r{len(out.moves)}",
            prompt_token_ids=request.prompt_token_ids, beam=request.beam,
            adapter=request.adapter)
        return await stage2_recomputed(self.pool, self.stages, request, plan, out, search)

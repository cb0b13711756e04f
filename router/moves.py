"""The move desk: the table of requests running now, and what moves them while they run
(``Router.Move``: stage 1 stopped on its P after its next token and continued on its D or
on another P; a stage 2's beam search stopped on its D after its next beam step and
resumed on another D (``router.search_moves``); ``Router.Drain``: every movable request
off an engine, the rest finished in place). The desk asks P (or D) to stop; the
request's own run (``router.executor``) then carries it to its destination, reading
:class:`Running`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from kvhandoff.types import Path
from router.endpoint import Claim, Endpoint
from router.errors import RouterError, grpc_error
from router.plan import Outcome, Plan
from router.pool import EnginePool
from router.requests import Drained, Moved
from router.rotation import LocalRotation, Rotation
from router.search_moves import Search, SearchMoves
from router.stages import StageCalls

logger = logging.getLogger(__name__)


class Stage(enum.Enum):
    """Where a running request's next tokens come from."""

    #: Stage 1 on a P (``Running.p``): the stage a move or a drain takes it from.
    ON_P = 1
    #: On its D (``Running.d``): stage 1 finished there after a move, or stage 2 (its
    #: beam search moved to another D stays here: ``Running.d`` is then that D).
    ON_D = 2
    #: It ended (``Running.done`` is set, ``Running.error`` says how).
    ENDED = 3


#: A request's allowed transitions, the only place they are written. A request on its D
#: goes back to a P when finishing stage 1 there failed (resumed on a P); a resume on a
#: P stays on a P; a stage 2 moved to another D stays on a D; nothing follows the end.
_NEXT: dict[Stage, frozenset[Stage]] = {
    Stage.ON_P: frozenset({Stage.ON_P, Stage.ON_D, Stage.ENDED}),
    Stage.ON_D: frozenset({Stage.ON_D, Stage.ON_P, Stage.ENDED}),
    Stage.ENDED: frozenset(),
}


@dataclass(eq=False)
class Running:
    """A two-stage request from its start to its end. Written by its run; the desk reads
    it and writes only the move fields (``move_reason``, ``move_to``; a stage 2's:
    ``search``'s)."""

    plan: Plan
    #: The P running stage 1 (another one after a resume or a move).
    p: Endpoint
    #: Its D, and its room there (None before it has one, or when it needs none).
    d: Endpoint | None
    claim: Claim | None = None
    #: Stage 1's request id on ``p`` (what P's Stop names).
    s1_id: str = ""
    #: What the run has so far (``stage1_engine_id``: the engine behind ``p`` that
    #: runs stage 1, which P's Stop names).
    out: Outcome | None = None
    #: Read freely; changed only through :meth:`enter`.
    stage: Stage = Stage.ON_P
    #: "move" or "drain" once a move was asked for (until the destination streams).
    move_reason: str = ""
    #: The P a move asked for goes to (None: the request's D).
    move_to: Endpoint | None = None
    #: Made by the desk with each move it asks for; the run settles it once stage 1
    #: has ended on the P it was stopped on: True when it goes on at the destination,
    #: False when it ended there before the stop took effect (finished, or out of
    #: tokens). The desk answers Router.Move from it.
    move_taken: asyncio.Future | None = None
    #: Stage 1 was finished on ``d`` (P died with no other P to resume on): D's prefix
    #: cache holds the parent, stage 2 needs no handoff.
    stage1_on_d: bool = False
    #: Its stage 2 while it runs (None before and after): what a move of it stops.
    search: Search | None = None
    #: Set when the request ended; ``error`` then says how it ended.
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    error: BaseException | None = None

    def enter(self, stage: Stage) -> None:
        """Change ``stage``; an illegal transition (``_NEXT``) is a bug in the run."""
        if stage not in _NEXT[self.stage]:
            raise AssertionError(f"request {self.plan.request_id!r}: {self.stage.name} -> "
                                 f"{stage.name} is not a request's transition")
        self.stage = stage

    @property
    def move_asked(self) -> bool:
        return bool(self.move_reason)

    def settle_move(self, taken: bool) -> None:
        """The run, once stage 1 ended after a move was asked for: whether it moves."""
        if self.move_taken is not None and not self.move_taken.done():
            self.move_taken.set_result(taken)

    def uses(self, ep: Endpoint) -> bool:
        """Whether it runs on ``ep`` now: its P in stage 1; in stage 2 the D its search
        runs on (after a move, the destination from the resume's call on: a drained D
        is free of it then, though ``d`` follows only once the search ends there)."""
        if self.stage is Stage.ON_P:
            return ep is self.p
        return ep is (self.search.d if self.search is not None else self.d)

    def set_claim(self, claim: Claim | None) -> None:
        """Hold ``claim`` (on its D) instead of the one held before, which is released."""
        if self.claim is not None and self.claim is not claim:
            self.claim.release()
        self.claim = claim
        self.d = claim.endpoint if claim is not None else self.d

    def why_not_movable(self) -> str:
        """Why it cannot move ("" when it can): stage 1 to its D (or another P), stage 2
        to another D."""
        if self.stage is Stage.ON_D:
            if self.search is None:
                return "is past stage 1 and not in its stage 2's beam search yet"
            return self.search.why_not_movable()
        if self.stage is not Stage.ON_P:
            return "has ended"
        if self.d is None:
            return ("has no D yet" if self.plan.path == Path.HANDOFF
                    else "runs colocated: no D to move it to")
        stage1 = self.plan.stage1
        if not (stage1.positional or stage1.temperature == 0):  # greedy is positional too
            return ("samples with vLLM's own sampling: moved, its tokens would change (use "
                    "positional sampling)")
        if self.plan.blend is not None:
            return ("is an approximate composition: its KV is copied from chunks held on "
                    "its P, and elsewhere it would be computed (other tokens)")
        if self.move_asked:
            return "is already being moved"
        if not self.d.takes_work:
            return (f"cannot move: its D {self.d.address} is "
                    f"{'drained' if self.d.draining else 'out of rotation'}")
        return ""


class MoveDesk:
    def __init__(self, pool: EnginePool, stages: StageCalls,
                 rotation: Rotation | None = None):
        self.pool, self.stages = pool, stages
        #: Which engines are drained (``router.rotation``).
        self.rotation: Rotation = rotation if rotation is not None else LocalRotation()
        self._running: dict[str, Running] = {}
        #: Moves of stage 2s (beam searches between Ds).
        self.searches = SearchMoves(pool, stages)

    def __len__(self) -> int:
        return len(self._running)

    @contextlib.contextmanager
    def track(self, running: Running) -> Iterator[None]:
        """``running`` is in the table while the block runs (unless its id is taken: a
        request that reuses a running one's id is not movable by it); on the way out its
        ``error`` and ``done`` are set."""
        rid = running.plan.request_id
        tracked = self._running.setdefault(rid, running) is running
        try:
            yield
        except BaseException as e:
            running.error = e
            raise
        finally:
            if tracked:
                del self._running[rid]
            running.enter(Stage.ENDED)
            ended = grpc_error(grpc.StatusCode.ABORTED, f"request {rid!r} ended while it "
                               f"was being moved ({running.error!r})")
            if running.move_taken is not None and not running.move_taken.done():
                # It ended before stage 1 came back from the stop (failed or cancelled).
                running.move_taken.set_exception(ended)
            if running.search is not None:
                running.search.abandon(ended)
            running.done.set()

    async def move(self, request_id: str, reason: str = "move",
                   to: str = "") -> Moved:
        """Router.Move: ask P to stop ``request_id``'s stage 1 after its next token; its
        run then goes on at the destination: the D it is planned for, or the P at
        address ``to``. Answers once stage 1 has ended on P: OK when it goes on at the
        destination, FAILED_PRECONDITION when it ended on P before the stop reached it
        (nothing is moved; the request goes on as if never asked). A request in its
        stage 2 moves its beam search to the D at ``to`` or another D with room
        (``SearchMoves.move``)."""
        running = self._running.get(request_id)
        if running is None:
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"request {request_id!r} is not running here")
        why_not = running.why_not_movable()
        if why_not:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r} {why_not}")
        if running.stage is Stage.ON_D and running.search is not None:
            return await self.searches.move(running.search, request_id, reason, to)
        dest = None
        if to and to != running.d.address:
            dest = next((ep for ep in self.pool.prefill if ep.address == to), None)
            why_not = self._why_not_to(dest, running, to)
            if why_not:
                code = (grpc.StatusCode.NOT_FOUND if why_not.startswith("unknown")
                        else grpc.StatusCode.FAILED_PRECONDITION)
                raise grpc_error(code, f"request {request_id!r} cannot move to {to}: "
                                       f"{why_not}")
        # Read where it runs before the await: the move may complete (running.p becomes
        # the destination) before stop() returns.
        source = running.p
        running.move_reason, running.move_to = reason, dest
        taken = running.move_taken = asyncio.get_running_loop().create_future()
        # Read even when this call gave up waiting (no "never retrieved" at exit).
        taken.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await self.stages.stop(source, running.s1_id,
                                   dest.handoff_target if dest is not None else "",
                                   running.out.stage1_engine_id if running.out else "")
        except BaseException:
            running.move_reason, running.move_to, running.move_taken = "", None, None
            raise
        try:
            # One engine step after the stop, unless P stalls.
            moving = await asyncio.wait_for(asyncio.shield(taken),
                                            self.stages.call_timeout_s)
        except TimeoutError:
            raise grpc_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"request {request_id!r}: {source.address} did not end its "
                             f"stage 1 within {self.stages.call_timeout_s:g} s of the "
                             "stop (it still will: the move goes on)") from None
        if not moving:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"request {request_id!r}: stage 1 ended on {source.address} "
                             "before the stop reached it (nothing moved)")
        to_address = (dest or running.d).address
        logger.info("%s: moving stage 1 from %s to %s (%s)", request_id, source.address,
                    to_address, reason)
        return Moved(from_endpoint=source.address, to_endpoint=to_address)

    @staticmethod
    def _search_or_stage1_here(r: Running, ep: Endpoint) -> bool:
        """Whether ``r`` runs its stage 1, or its beam search, on ``ep`` now."""
        return (r.stage is Stage.ON_P and r.p is ep
                or r.stage is Stage.ON_D and r.search is not None and r.search.d is ep)

    def _why_not_to(self, dest: Endpoint | None, running: Running, to: str) -> str:
        """Why ``running`` cannot move to the P at ``to`` ("" when it can)."""
        if dest is None:
            if self.pool.find(to) is not None:
                return "stage 1 moves to another prefill engine or to the request's own D"
            return f"unknown engine (this router's: {self.pool.known()})"
        if dest is running.p:
            return "stage 1 already runs there"
        if not dest.takes_work:
            return "it is " + ("drained" if self.rotation.is_drained(dest)
                               else "out of rotation")
        return ""

    async def drain(self, address: str, timeout_s: float = 300.0,
                    undo: bool = False) -> Drained:
        """Router.Drain: no new work goes to the engine at ``address``; its running stage
        1s that can move go to their D, its running beam searches (a D's) to other Ds
        with room (reason "drain"), and so do the searches of requests whose stage 1 was
        running on a P for this D, as each starts here (its import is addressed to this
        D); the rest finish where they are.
        Returns once none of this router's requests use the engine (parents and
        continuations included), or after ``timeout_s``. ``undo``: back into rotation."""
        ep = self.pool.find(address)
        if ep is None:
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"engine {address!r} is not one of this router's "
                             f"({self.pool.known()})")
        t0 = time.monotonic()
        if undo:
            self.rotation.undo(ep)
            logger.info("%s takes new work again (drain undone)", address)
            self.pool.room_changed()
            return Drained(endpoint=address, empty=True)
        self.rotation.drain(ep)
        affected = [r for r in self._running.values() if r.uses(ep) or r.d is ep]
        logger.info("draining %s: %d running requests use it", address, len(affected))
        moved, in_place = 0, 0
        # Stage 1s on a P whose beam search will start on this D: moved once it runs.
        coming = [r for r in affected if r.stage is Stage.ON_P and r.d is ep and r.p is not ep]
        # Beam searches: moved all at once (each move waits for D's next beam step, one
        # step for all of them); stage 1s one after another (P's next token).
        moving: list[asyncio.Task] = []
        for r in affected:
            if r in coming:
                continue
            if self._search_or_stage1_here(r, ep) and not r.why_not_movable():
                if r.stage is Stage.ON_D:
                    moving.append(asyncio.create_task(
                        self.move(r.plan.request_id, reason="drain")))
                    continue
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
                not r.done.is_set() and (r.uses(ep) or (r.stage is Stage.ON_P and r.d is ep))
                for r in affected)

        deadline, told = t0 + timeout_s, t0
        while busy() and time.monotonic() < deadline:
            if time.monotonic() - told >= 5.0:
                told = time.monotonic()
                waiting = [r for r in affected if not r.done.is_set()]
                logger.info("draining %s: %d calls in flight, waiting for %s", address,
                            ep.outstanding, ", ".join(
                                f"{r.plan.request_id} ({r.stage.name})" for r in waiting[:8]))
            for r in [r for r in coming if r.done.is_set() or r.stage is Stage.ENDED
                      or (r.stage is Stage.ON_D and r.search is not None)]:
                coming.remove(r)
                if self._search_or_stage1_here(r, ep) and not r.why_not_movable():
                    moving.append(asyncio.create_task(
                        self.move(r.plan.request_id, reason="drain")))
                else:
                    in_place += 1  # ended, or its stage 2 cannot move (sampled, ...)
            await asyncio.sleep(0.02)
        in_place += len(coming)
        for result in await asyncio.gather(*moving, return_exceptions=True):
            if isinstance(result, BaseException):
                logger.warning("drain of %s: a beam search not moved (%s)", address, result)
                in_place += 1
            else:
                moved += 1
        failed = sum(1 for r in affected if r.done.is_set() and r.error is not None)
        summary = Drained(
            endpoint=address, moved=moved, finished_in_place=in_place, failed=failed,
            empty=not busy(), seconds=time.monotonic() - t0)
        logger.info("drained %s in %.2f s: %d moved, %d finished in place, %d failed%s",
                    address, summary.seconds, moved, in_place, failed,
                    "" if summary.empty else " (NOT empty at the timeout)")
        return summary

"""The router's plain engine calls, one stage each: stage 1 on a P (:meth:`stage1`),
stage 1 finished on a D after a move (:meth:`finish_stage1_on`), stage 2 on a D
(:meth:`stage2`), and the small calls around them (Stop, Release). No choice of engine
and no failover here: the caller (``router.executor``) decides both. Each call counts
itself in the engine's ``outstanding`` while it runs and adds its wait to
``Outcome.engine_ms``."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

import grpc

from connector.blend_spec import Blend
from kvhandoff.model import ModelTokens
from kvhandoff.types import continuation_prompt
from kvhandoff.v1 import common_pb2, engine_pb2
from router.endpoint import Claim, Endpoint
from router.errors import grpc_error
from router.plan import Outcome, Plan
from router.requests import Move
from wire import common as convert

if TYPE_CHECKING:
    from router.pool import EnginePool


class RunsOn(Protocol):
    """Told where a request's stage 2 runs (``router.search_moves.Search``)."""

    d: Endpoint
    request_id: str

logger = logging.getLogger(__name__)


def time_left(plan: Plan) -> float | None:
    """Seconds to ``plan``'s deadline (None: none); TimeoutError once it has passed."""
    if plan.deadline is None:
        return None
    left = plan.deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError()
    return left


def _cancel(call) -> None:
    """Cancels an engine stream the router stops reading before its end (the client
    cancelled, a deadline, an error, a move): the engine aborts the request now. Left to
    itself gRPC cancels such a call only when the call object is collected, which a
    reference cycle (an exception's traceback holds the frame that holds the call) can
    put off for seconds while the engine runs on. A no-op on a finished call."""
    if call is not None and hasattr(call, "cancel"):
        call.cancel()


def _blend_to_pb(blend: Blend) -> engine_pb2.Blend:
    return engine_pb2.Blend(
        parts=[engine_pb2.BlendPart(source=p.source, source_start=p.source_start,
                                    length=p.length, position=p.position)
               for p in blend.parts], num_loaded=blend.num_loaded)


class StageCalls:
    def __init__(self, tokens: ModelTokens, call_timeout_s: float):
        self.tokens = tokens
        #: The bound on Stop and Release (they answer at once).
        self.call_timeout_s = call_timeout_s

    async def stage1(self, p: Endpoint, d: Endpoint | None, plan: Plan, out: Outcome, *,
                     export: bool, hold: bool = False, hold_s: float = 0.0,
                     pin: bool = False,
                     resume_at: int | None = None, request_id: str = "",
                     import_from: common_pb2.Handoff | None = None,
                     move: Move | None = None
                     ) -> AsyncIterator[list[int] | common_pb2.Handoff]:
        """Stage 1 on P: yields token batches, then P's handoff (with ``export``,
        addressed to ``d``; with ``hold`` P keeps the blocks for the whole lease, or
        ``hold_s``: a parent). ``hold`` without ``export``: P holds the parent for
        continuations on P (``out.held_until``), with ``pin`` until released (a chunk).
        ``resume_at``: P starts after the first
        ``resume_at`` tokens of ``out.thinking_ids`` (their KV recomputed); the tokens it
        samples again must equal those already there, and only the ones after them are
        yielded. ``import_from``: P goes on after every token of ``out.thinking_ids``,
        importing them from another P's export (a move; ``move`` gets its counts and
        pause)."""
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
            target_engine_id=d.handoff_target if d is not None else "",
            fault=plan.export_fault if export or hold else "", adapter=plan.adapter,
            pin=pin)
        if import_from is not None:
            request.handoff.CopyFrom(import_from)
        if plan.blend is not None and resume_at is None and import_from is None:
            request.blend.CopyFrom(_blend_to_pb(plan.blend))
        p.outstanding += 1
        call = None
        try:
            call = p.stub.Stage1(request, timeout=time_left(plan))
            waiting_since = time.perf_counter()
            async for event in call:
                out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
                if event.engine_id:
                    out.stage1_engine_id = event.engine_id
                    out.prefill_engine_id = out.prefill_engine_id or event.engine_id
                new, logprobs = list(event.new_token_ids), convert.logprobs_from_pb(event.logprobs)
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
                    if resume_at is None and import_from is None:
                        out.cached_prompt_tokens = max(
                            0, len(prompt) - event.num_computed_tokens)
                        out.num_blended_tokens = event.num_blended_tokens
                        if event.blend_refused:
                            logger.warning("%s: P %s copied no chunk (%s): its prompt was "
                                           "computed", plan.request_id, p.address,
                                           event.blend_refused)
                    if move is not None:
                        move.num_imported_tokens = event.num_imported_tokens
                        move.num_computed_tokens = event.num_computed_tokens
                        move.num_bytes_moved = event.num_imported_bytes
                    if event.HasField("handoff"):
                        yield event.handoff
                waiting_since = time.perf_counter()
            out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
        finally:
            _cancel(call)
            p.outstanding -= 1

    async def finish_stage1_on(self, d: Endpoint, claim: Claim | None,
                               handoff: common_pb2.Handoff | None, plan: Plan, out: Outcome,
                               reason: str) -> AsyncIterator[list[int]]:
        """Stage 1, stopped on P by a move, finished on ``d`` (``claim``: the request's
        room there): D imports what P has and samples the rest with the same
        (positional) sampling; yields the new tokens as D streams them. Without
        ``handoff`` (P is gone) D computes the tokens so far but the last, which it
        samples again and which must equal what was streamed (P may have died after its
        last token: D then only confirms it and the stop it made)."""
        t = len(out.thinking_ids)
        replay = min(1, t) if handoff is None else 0
        start = t - replay
        params = plan.stage1
        rest = dataclasses.replace(params, max_tokens=params.max_tokens - start,
                                   min_tokens=max(0, params.min_tokens - start))
        request = engine_pb2.Stage2Request(
            request_id=f"{plan.request_id}-s1m", prompt_token_ids=plan.prompt_ids
            + out.thinking_ids[:start], sampling=convert.stage1_to_pb(rest),
            adapter=plan.adapter)
        if handoff is not None:
            request.handoff.CopyFrom(handoff)
            request.fault = plan.import_fault
        first_at, resp = None, None
        # Listed from the start: a move whose destination fails stays in the record.
        move = Move(from_endpoint=out.prefill, to_endpoint=d.address, at_token=t,
                    reason=reason)
        out.moves.append(move)
        if claim is not None:
            claim.mark_sent()
        d.outstanding += 1
        waiting_since = time.perf_counter()
        stream = None
        try:
            stream = d.stub.Stage2Stream(request, timeout=time_left(plan))
            async for event in stream:
                new = list(event.new_token_ids)
                if replay and new:
                    if new[0] != out.thinking_ids[start]:
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
            _cancel(stream)
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

    def stage2_request(self, plan: Plan, out: Outcome, *, held_parent: str = "",
                       handoff: common_pb2.Handoff | None = None
                       ) -> engine_pb2.Stage2Request:
        """Stage 2's request: parent + suffix, from token ids (never re-tokenised); beam
        search, or sampling when the plan says so (a continuation). ``handoff``: the
        parent's blocks to import (a continuation on its D); ``held_parent``: the name
        P holds the parent under (a continuation on that P, copying from it)."""
        parent = plan.prompt_ids + out.thinking_ids
        stage2_prompt = continuation_prompt(parent, plan.suffix_ids, self.tokens.think_end_id)
        out.suffix_ids = stage2_prompt[len(parent):]
        request = engine_pb2.Stage2Request(
            request_id=f"{plan.request_id}-s2", prompt_token_ids=stage2_prompt,
            beam=convert.beam_to_pb(plan.beam), adapter=plan.adapter,
            held_parent=held_parent, handoff=handoff,
            sampling=(convert.stage1_to_pb(plan.stage2_sampling)
                      if plan.stage2_sampling is not None else None))
        return request

    async def stage2(self, ep: Endpoint, claim: Claim | None,
                     request: engine_pb2.Stage2Request, plan: Plan,
                     out: Outcome) -> engine_pb2.Stage2Response:
        """Stage 2 on ``ep`` (a D, or the P holding a parent), ``claim`` marked sent."""
        if claim is not None:
            claim.mark_sent()
        # Into an import only (a recompute, with its handoff cleared, has none).
        request.fault = plan.import_fault if request.HasField("handoff") else ""
        ep.outstanding += 1
        waiting_since = time.perf_counter()
        try:
            return await ep.stub.Stage2(request, timeout=time_left(plan))
        finally:
            out.engine_ms += (time.perf_counter() - waiting_since) * 1e3
            ep.outstanding -= 1

    async def stop(self, p: Endpoint, request_id: str, target_engine_id: str = "",
                   engine_id: str = "") -> None:
        """Ask P to stop ``request_id`` after its next token (its handoff retargeted to
        ``target_engine_id`` when given). ``engine_id``: the engine behind ``p`` that
        runs it, where ``p`` stands for several (Serve)."""
        await p.stub.Stop(engine_pb2.StopRequest(request_ids=[request_id],
                                                 target_engine_id=target_engine_id,
                                                 engine_id=engine_id),
                          timeout=self.call_timeout_s)

    async def release(self, ep: Endpoint, request_ids: list[str], engine_id: str = "",
                      prefixes: list[str] | None = None) -> None:
        """End P's holds on these requests' blocks now, and on every parent held there
        whose name starts with one of ``prefixes`` (``engine_id``: as in :meth:`stop`)."""
        await ep.stub.Release(engine_pb2.ReleaseRequest(request_ids=request_ids,
                                                        engine_id=engine_id,
                                                        prefixes=prefixes or []),
                              timeout=self.call_timeout_s)


async def stage2_recomputed(pool: EnginePool, stages: StageCalls,
                            request: engine_pb2.Stage2Request, plan: Plan, out: Outcome,
                            search: RunsOn | None = None) -> Claim:
    """Stage 2 of ``request`` (the prompt's token ids, nothing imported: the recompute of
    a handoff or a move that failed) on a D with room, picked on fresh snapshots;
    ``out.decode`` names it and ``search`` is told where it runs (a move stops it
    there). Returns that D's claim, which the caller releases; released here if the
    stage fails."""
    claim = await pool.pick_decode(len(request.prompt_token_ids), plan.beam, plan.deadline,
                                   fresh=True, adapter=plan.adapter)
    out.decode = claim.endpoint.address
    if search is not None:
        search.d, search.request_id = claim.endpoint, request.request_id
    try:
        out.stage2 = await stages.stage2(claim.endpoint, claim, request, plan, out)
    except BaseException:
        claim.release()
        raise
    return claim

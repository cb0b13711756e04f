"""Parents and their continuations: stage 1 alone (:meth:`Continuations.run_parent`),
then stage 2 as a continuation naming it (:meth:`Continuations.run_continuation`), and
beam search over a whole prompt (:meth:`Continuations.run_prompt_beams`, the text round
trip continuations are compared with).

A continuation builds stage 2's prompt from the parent's token ids (never re-tokenised)
and runs it on the D the handoff is addressed to, which imports the parent's blocks (only
those it does not already hold in its prefix cache). On one engine (``PATH_COLOCATED``, or
a router without decode engines) P holds the parent itself and the continuation runs on
that P, copying from the held blocks what its prefix cache lacks: ``len(suffix) + 1``
tokens computed, however much else went through P's cache meanwhile. A continuation runs
beam search, or samples one sequence with its own parameters. Parent gone from P (lease
over, not held, its D out of rotation, D's READ failed): recomputed from the token ids,
flagged with the reason, unless the client asked for ``strict``. Unknown id: NOT_FOUND.
Still running: the continuation waits for it, within its deadline. A model this router
does not serve: INVALID_ARGUMENT, at the front door as for any request. A parent that
would exceed P's share for held parents runs without a hold (its continuations are
recomputed, flagged), after idle holds were ended early to make room.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from pathlib import PurePath

import grpc

from kvhandoff.model import ModelTokens
from kvhandoff.types import (
    BeamParams,
    InvalidRequest,
    Path,
    Stage1Params,
    continuation_prompt,
    validate_prompt,
    validate_token_ids,
)
from kvhandoff.v1 import engine_pb2
from router import placement
from router.config import RouterConfig
from router.endpoint import Endpoint
from router.errors import adapter_named, grpc_error
from router.executor import Executor
from router.parents import ParentRecord, ParentState, ParentStore
from router.plan import (
    Outcome,
    ParentLink,
    Plan,
    approximation,
    check_request_id,
    fault_of,
    sampling_of,
    suffix_ids_of,
    to_result,
)
from router.pool import EnginePool
from router.requests import ContinueCall, Released, Result
from router.stages import StageCalls

logger = logging.getLogger(__name__)


class Continuations:
    def __init__(self, config: RouterConfig, tokens: ModelTokens, pool: EnginePool,
                 registry: ParentStore, stages: StageCalls, executor: Executor):
        self.config, self.tokens, self.pool = config, tokens, pool
        self.registry, self.stages, self.executor = registry, stages, executor
        self._ids = itertools.count()

    async def run_parent(self, plan: Plan) -> AsyncIterator[list[int] | ParentRecord]:
        """Stage 1 of ``plan`` as a parent: yields token batches as P samples them, then
        the finished :class:`ParentRecord` (registered before stage 1 starts, so a
        continuation can wait for it). ``plan.path`` COLOCATED: P holds it for
        continuations on P; else P exports it to a D and holds the export."""
        t0 = time.perf_counter()
        p = await self.pool.pick_prefill(plan.deadline, prompt_ids=plan.prompt_ids,
                                         adapter=plan.adapter, prefer=plan.prefer_prefill)
        local = plan.path == Path.COLOCATED
        record = ParentRecord(plan.request_id, self.config.model_name, list(plan.prompt_ids),
                              adapter=plan.adapter, prefill=p.address, prefill_ep=p,
                              local=local, stage1=plan.stage1,
                              model_fingerprint=p.capacity.model_fingerprint
                              if p.capacity is not None else "")
        registry = self.registry
        registry.add(record)
        try:
            cap = p.capacity
            releases: dict[tuple[int, str], tuple[Endpoint, str, list[str]]] = {}
            if cap is not None:
                record.num_blocks = math.ceil(
                    (len(plan.prompt_ids) + plan.stage1.max_tokens) / cap.block_size)
                # Chosen, marked and counted now, with this parent's reservation below
                # and no await between: concurrent parents cannot take the room first.
                releases = self._end_holds_for(record.num_blocks, cap.num_total_blocks)
                record.not_held_reason = registry.may_hold(record.num_blocks,
                                                           cap.num_total_blocks)
            d = None if local else self._parent_target(plan.prompt_ids, plan.adapter)
            if not local and d is None and not record.not_held_reason:
                record.not_held_reason = "no decode engine in rotation to address it to"
            hold = not record.not_held_reason
            if not hold:
                logger.info("parent %s not held: %s", record.parent_id, record.not_held_reason)
            if hold:
                record.decode = d
                # Counted now (estimate), corrected when stage 1 says how many.
                registry.hold(record, time.time() + 3600.0)
            await self._send_releases(list(releases.values()))
            export = hold and not local
            out = Outcome(plan, p.address, d.address if export else None)
            record.thinking_logprobs = out.thinking_logprobs  # grows as P samples
            handoff = None
            async for item in self.stages.stage1(p, d if export else None, plan, out,
                                                 export=export, hold=hold,
                                                 hold_s=self.config.parent_hold_s):
                if isinstance(item, list):
                    yield item
                else:
                    handoff = item
            record.thinking_ids = out.thinking_ids
            record.prefill_engine_id = out.stage1_engine_id  # where it ended: the holder
            record.finish_reason = out.stage1_finish_reason
            record.approximation = approximation(out)
            record.stage1_ms = (time.perf_counter() - t0) * 1e3
            if hold:
                registry.unhold(record)
                if export and handoff is None:
                    record.not_held_reason = "P exported no handoff"
                elif local and not out.held_until:
                    record.not_held_reason = "P did not hold it (its beam fork is off)"
                elif export:
                    record.handoff = handoff
                    record.model_fingerprint = handoff.model_fingerprint
                    record.num_blocks = handoff.num_blocks
                    record.held_until = handoff.lease_expires_at
                else:
                    record.num_blocks = math.ceil(
                        (len(record.prompt_ids) + len(record.thinking_ids) - 1)
                        / cap.block_size) if cap is not None else record.num_blocks
                    record.held_until = out.held_until
                if record.held_until:
                    registry.hold(record, record.held_until)
            record.enter(ParentState.HELD if record.held_until and not record.not_held_reason
                         else ParentState.NOT_HELD)
        except BaseException as e:
            record.enter(ParentState.FAILED, str(e) or type(e).__name__)
            # P's blocks (if it exported before failing) come back at its lease end.
            registry.unhold(record)
            registry.discard(record.parent_id)
            raise
        yield record

    def _end_holds_for(self, num_blocks: int, p_total_blocks: int
                       ) -> dict[int, tuple[Endpoint, list[str]]]:
        """End the holds of idle parents (least recently used first) when a new parent
        of ``num_blocks`` would not fit in the share: they are marked not held and their
        blocks uncounted now (a continuation starting meanwhile recomputes, never reads
        blocks being freed); returns what to tell each P (``_send_releases``)."""
        records = self.registry.to_release(num_blocks, p_total_blocks)
        by_prefill: dict[tuple[int, str], tuple[Endpoint, str, list[str]]] = {}
        for r in records:
            r.enter(ParentState.NOT_HELD, "released early: P's share for held parents was "
                                          "needed")
            self.registry.unhold(r)
            self.registry.evictions["released"] += 1
            by_prefill.setdefault((id(r.prefill_ep), r.prefill_engine_id),
                                  (r.prefill_ep, r.prefill_engine_id, []))[2].append(r.held_name)
        if records:
            logger.info("releasing %d held parents early for a new one: %s", len(records),
                        ", ".join(r.parent_id for r in records))
        return by_prefill

    async def _send_releases(self, releases: list[tuple[Endpoint, str, list[str]]]) -> None:
        """Tell each P (an endpoint and the engine behind it) which holds end now; a
        failed Release leaves their blocks to their lease end (already uncounted: the
        share may exceed by that, briefly)."""
        for ep, engine_id, names in releases:
            try:
                await self.stages.release(ep, names, engine_id)
            except Exception as e:  # their blocks come back at their leases' end
                logger.warning("Release on %s failed (%s): %d held parents kept until "
                               "their leases end", ep.address, e, len(names))

    def _parent_target(self, prompt_ids: list[int], adapter: str) -> Endpoint | None:
        """The D a parent's handoff is addressed to (its continuations run there while
        P holds the parent): the best of those in rotation that serve its ``adapter``
        by ``EnginePool.decode_ranker`` (with ``--placement cache``, the prompt it holds
        against its queue: it reads only the rest)."""
        serves = placement.serves_adapter(adapter)
        live = [ep for ep in self.pool.decode if ep.takes_work and serves(ep)]
        d = max(live, key=self.pool.decode_ranker(live, prompt_ids, adapter), default=None)
        if d is not None:
            self.pool.observer.placed("decode", d.address,
                                      self.pool.cached_blocks(d, prompt_ids, adapter))
        return d

    async def _parent_of(self, req: ContinueCall,
                         deadline: float | None) -> ParentRecord:
        """The finished parent ``req`` names (waiting for its stage 1, within
        ``deadline``), or the status that says why there is none."""
        counts = self.registry.continuations
        if not req.parent_id:
            raise InvalidRequest("parent_id", "is empty")
        record = self.registry.get(req.parent_id)
        if record is None:
            counts["not_found"] += 1
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"parent {req.parent_id!r} is unknown: never served here, or "
                             f"forgotten (parents live {self.config.parent_ttl_s:g} s after "
                             f"their last use, at most {self.config.max_parents})")
        if req.model and record.model not in {req.model, PurePath(req.model).name}:
            counts["refused"] += 1
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {req.parent_id!r} ran under model {record.model!r}, "
                             f"not {req.model!r}")
        if req.adapter and req.adapter != record.adapter:
            # Its KV (held, or recomputed) is the parent's adapter's: design doc 6.5.
            counts["refused"] += 1
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {req.parent_id!r} ran under "
                             f"{adapter_named(record.adapter)}, not adapter "
                             f"{req.adapter!r}: a continuation inherits its parent's adapter")
        if req.base_only and record.adapter:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {record.parent_id!r} ran under adapter "
                             f"{record.adapter!r}: continue it as model {record.adapter!r} "
                             "(or leave model out to inherit it)")
        if not record.done.is_set():
            logger.info("continuation of %s waits for its parent's stage 1", req.parent_id)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(record.done.wait(), timeout)  # TimeoutError: DEADLINE
        if record.state is ParentState.FAILED:
            counts["refused"] += 1
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {req.parent_id!r} failed: {record.error}")
        return record

    async def release_parent(self, parent_id: str) -> Released:
        """Router.ReleaseParent: forget a finished, idle parent and end P's hold on its
        blocks now (see the proto for the statuses)."""
        record = self.registry.get(parent_id) if parent_id else None
        if record is None:
            raise grpc_error(grpc.StatusCode.NOT_FOUND, f"parent {parent_id!r} is unknown "
                             "here (never served, released, or forgotten)")
        if not record.done.is_set() or record.in_use:
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {parent_id!r} is in use: "
                             + ("its stage 1 still runs" if not record.done.is_set()
                                else f"{record.in_use} continuations of it run now"))
        hold_ended = record.held and record.prefill_ep is not None
        # Marked and forgotten before the await: a continuation arriving meanwhile gets
        # NOT_FOUND, never blocks being freed.
        record.enter(ParentState.NOT_HELD, "released by the client")
        self.registry.unhold(record)
        self.registry.discard(parent_id)
        self.registry.evictions["client"] += 1
        if hold_ended:
            await self._send_releases([(record.prefill_ep, record.prefill_engine_id,
                                        [record.held_name])])
        logger.info("parent %s released by the client%s", parent_id,
                    " (P's hold ended)" if hold_ended else "")
        return Released(parent_id, hold_ended)

    async def run_continuation(self, req: ContinueCall, deadline: float | None) -> Result:
        """Stage 2 of ``req``'s parent (see the module docstring)."""
        received_at = time.perf_counter()
        if req.timeout_ms:
            t = time.monotonic() + req.timeout_ms / 1e3
            deadline = t if deadline is None else min(deadline, t)
        record = await self._parent_of(req, deadline)
        plan = self._continuation_plan(req, record, deadline)
        t0 = time.perf_counter()
        out = Outcome(plan, record.prefill, None, thinking_ids=list(record.thinking_ids),
                      stage1_finish_reason=record.finish_reason)
        why_not = record.why_not_importable()
        # P holds it (stage 2 on that P copies from the held blocks), or its D imports it.
        on_p, on_d = not why_not and record.local, not why_not and not record.local
        request = self.stages.stage2_request(
            plan, out, held_parent=record.held_name if on_p else "",
            handoff=record.handoff if on_d else None)
        if on_d:  # its continuations share a D where one address stands for several
            request.affinity = record.parent_id
        # In use from here: never released early while this continuation may read it.
        record.in_use += 1
        try:
            if on_p:
                out.decode = record.prefill
                out.stage2 = await self.stages.stage2(record.prefill_ep, None, request, plan,
                                                      out)
            elif on_d:
                claim = await self.pool.pick_decode(len(request.prompt_token_ids), plan.beam,
                                                    plan.deadline, only=[record.decode])
                # Movable while it runs (Router.Move, Drain); the claims are its own.
                await self.executor.continuation_stage2(
                    record.prefill_ep, claim, request, plan, out, recompute=not req.strict)
            elif req.strict:
                self.registry.continuations["refused"] += 1
                raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"parent {req.parent_id!r} cannot be imported: {why_not} "
                                 "(strict: not recomputed)")
            else:
                logger.info("continuation of %s recomputed: %s", req.parent_id, why_not)
                out.failed_decode, out.handoff_failure = "", f"parent not held: {why_not}"
                await self._stage2_anywhere(request, plan, out)
        finally:
            record.in_use -= 1
        out.total_ms = (time.perf_counter() - t0) * 1e3
        result = to_result(out, self.tokens.tokenizer, received_at)
        outcome = "recomputed" if result.stats.recomputed else "imported"
        self.registry.continuations[outcome] += 1
        return result

    async def run_prompt_beams(self, prompt_ids: list[int], beam: BeamParams,
                               request_id: str, deadline: float | None, adapter: str = ""
                               ) -> Result:
        """Beam search over a whole prompt on a D (under ``adapter``), nothing imported:
        what a client gets that sends stage 2 as a brand-new text request."""
        received_at = time.perf_counter()
        cap = next((ep.capacity for ep in self.pool.decode if ep.capacity), None)
        if cap is not None:
            validate_prompt(prompt_ids, vocab_size=cap.vocab_size,
                            max_model_len=cap.max_model_len, num_new_tokens=beam.max_tokens)
        elif not prompt_ids:
            raise InvalidRequest("prompt", "is empty")
        plan = Plan(request_id or f"b{next(self._ids)}", list(prompt_ids), [],
                    Stage1Params(max_tokens=1), beam, Path.HANDOFF, deadline,
                    adapter=adapter)
        t0 = time.perf_counter()
        out = Outcome(plan, "", None)
        await self._stage2_anywhere(self.stages.stage2_request(plan, out), plan, out)
        out.total_ms = (time.perf_counter() - t0) * 1e3
        return to_result(out, self.tokens.tokenizer, received_at)

    async def _stage2_anywhere(self, request: engine_pb2.Stage2Request, plan: Plan,
                               out: Outcome) -> None:
        """Stage 2 from token ids (nothing imported) on the D with the most room (on a
        P, for a router without decode engines)."""
        if not self.pool.decode:
            p = await self.pool.pick_prefill(plan.deadline, adapter=plan.adapter)
            out.decode = p.address
            out.stage2 = await self.stages.stage2(p, None, request, plan, out)
            return
        claim = await self.pool.pick_decode(len(request.prompt_token_ids), plan.beam,
                                            plan.deadline, adapter=plan.adapter)
        out.decode = claim.endpoint.address
        try:
            out.stage2 = await self.stages.stage2(claim.endpoint, claim, request, plan, out)
        finally:
            claim.release()

    def _continuation_plan(self, req: ContinueCall, record: ParentRecord,
                           deadline: float | None) -> Plan:
        suffix = suffix_ids_of(req.suffix, self.tokens)
        beam = req.beam
        cap = next((ep.capacity for ep in self.pool.endpoints if ep.capacity), None)
        sampling = None
        if req.sampling is not None:
            sampling = sampling_of(req.sampling, self.config.positional_sampling)
            # What D's blocks are claimed for: one sequence of that many tokens.
            beam = BeamParams(beam_width=1, max_tokens=sampling.max_tokens)
            if cap is not None:
                validate_token_ids(list(sampling.stop_token_ids), vocab_size=cap.vocab_size,
                                   field_name="sampling.stop_token_ids")
        if cap is not None:
            validate_token_ids(suffix, vocab_size=cap.vocab_size, field_name="suffix")
            validate_prompt(continuation_prompt(record.prompt_ids + record.thinking_ids, suffix,
                                                self.tokens.think_end_id),
                            vocab_size=cap.vocab_size, max_model_len=cap.max_model_len,
                            num_new_tokens=beam.max_tokens)
        request_id = check_request_id(req.request_id
                                      or f"{record.parent_id}-c{next(self._ids)}")
        return Plan(request_id, list(record.prompt_ids), suffix, Stage1Params(max_tokens=1),
                    beam, Path.COLOCATED if record.local else Path.HANDOFF,
                    deadline, stage2_sampling=sampling, fault=fault_of(req.fault),
                    adapter=record.adapter, parent=ParentLink(
                        record.parent_id, record.stage1, record.approximation))


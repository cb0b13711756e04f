"""Parents and their continuations: stage 1 alone (``run_parent``), then stage 2 as a
continuation naming it (``run_continuation``).

A parent is a stage 1 the router served with ``StartParent``. P exports it with ``hold``:
its KV blocks stay on P until P's lease ends, however many continuations read them. The
router keeps the parent's token ids and its handoff in a bounded registry
(:class:`ParentRegistry`): at most ``max_parents`` records (least recently used evicted
first), each forgotten ``parent_ttl_s`` after its last use, and held blocks limited to
``parent_pool_share`` of P's pool (counted until each lease ends, evicted or not), so held
parents never starve new stage 1s. A parent that would exceed the share runs without a hold
(its continuations are recomputed, flagged).

A continuation builds stage 2's prompt from the parent's token ids (never re-tokenised) and
runs it on the D the handoff is addressed to, which imports the parent's blocks (only those
it does not already hold in its prefix cache). On one engine (``PATH_COLOCATED``, or a
router without decode engines) P holds the parent itself and the continuation runs on
that P, copying from the held blocks what its prefix cache lacks: ``len(suffix) + 1``
tokens computed, however much else went through P's cache meanwhile. A continuation runs
beam search, or samples one sequence with its own parameters. Parent gone from P (lease over, not held, its
D out of rotation, D's READ failed): recomputed from the token ids, flagged with the reason,
unless the client asked for ``strict``. Unknown id: NOT_FOUND. Still running: the
continuation waits for it, within its deadline. Another model: FAILED_PRECONDITION.
Mixed into ``router.core.Router``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from kvhandoff.types import (
    BeamParams,
    InvalidRequest,
    Stage1Params,
    continuation_prompt,
    validate_prompt,
    validate_token_ids,
)
from kvhandoff.v1 import common_pb2, engine_pb2, router_pb2
from router.plan import Outcome, Plan, grpc_error, sampling_of, suffix_ids_of
from server import convert

if TYPE_CHECKING:
    from router.capacity import Endpoint
    from router.core import RouterConfig

logger = logging.getLogger(__name__)

#: A held parent is imported only while P's lease has at least this long to run: D
#: refuses a READ within its lease safety margin (2 s by default), so closer to the end
#: the continuation is recomputed at once instead of failing over.
LEASE_MARGIN_S = 2.5


@dataclass
class ParentRecord:
    """One parent: what a continuation needs of it. Owned by the registry."""

    parent_id: str
    model: str
    prompt_ids: list[int]
    prefill: str = ""
    #: The D its handoff is addressed to (signed for), when held for a D.
    decode: Endpoint | None = None
    #: The P that ran stage 1 (and holds the parent itself, when ``local``).
    prefill_ep: Endpoint | None = None
    #: Held on P for continuations on P (the one-engine path), not exported.
    local: bool = False
    #: When P's hold on the blocks ends (Unix time); 0 until known.
    held_until: float = 0.0
    thinking_ids: list[int] = field(default_factory=list)
    #: Its stage-1 sampling as run (the seed the router picked, if it did).
    stage1: Stage1Params | None = None
    #: Per stage-1 token, when asked for (filled as P samples them).
    thinking_logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    handoff: common_pb2.Handoff | None = None
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

    @property
    def held(self) -> bool:
        return (not self.not_held_reason and self.held_until > 0
                and time.time() < self.held_until - LEASE_MARGIN_S)


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


def parent_to_pb(record: ParentRecord, tokenizer) -> router_pb2.Parent:
    return router_pb2.Parent(
        parent_id=record.parent_id, prompt_token_ids=record.prompt_ids,
        thinking_token_ids=record.thinking_ids,
        thinking_text=tokenizer.decode(record.thinking_ids, skip_special_tokens=False),
        finish_reason=record.finish_reason, held=record.held,
        not_held_reason=record.not_held_reason, prefill_endpoint=record.prefill,
        lease_expires_at=record.held_until if record.held else 0.0,
        stage1_ms=record.stage1_ms, model=record.model,
        stage1_seed=record.stage1.seed or 0 if record.stage1 else 0,
        stage1_positional=bool(record.stage1 and record.stage1.positional),
        thinking_logprobs=record.thinking_logprobs)


class ParentsMixin:
    """StartParent and Continue of a :class:`~router.core.Router`."""

    config: RouterConfig
    parents: ParentRegistry
    decode: list[Endpoint]
    prefill: list[Endpoint]
    # Also uses Router's tokens, _ids, _pick_prefill, _pick_decode, _release, _stage1,
    # _stage2_or_recompute and _timeout.

    @property
    def model_names(self) -> set[str]:
        """Names a request's ``model`` may give: the model directory or its last part."""
        return {self.config.model, Path(self.config.model).name}

    def check_model(self, model: str) -> None:
        if model and model not in self.model_names:
            raise InvalidRequest("model", f"{model!r} is not served here (this router "
                                          f"serves {Path(self.config.model).name!r})")

    async def run_parent(self, plan: Plan) -> AsyncIterator[list[int] | ParentRecord]:
        """Stage 1 of ``plan`` as a parent: yields token batches as P samples them, then
        the finished :class:`ParentRecord` (registered before stage 1 starts, so a
        continuation can wait for it). ``plan.path`` COLOCATED: P holds it for
        continuations on P; else P exports it to a D and holds the export."""
        t0 = time.perf_counter()
        p = await self._pick_prefill(plan)
        local = plan.path == common_pb2.PATH_COLOCATED
        record = ParentRecord(plan.request_id, Path(self.config.model).name,
                              list(plan.prompt_ids), prefill=p.address, prefill_ep=p,
                              local=local, stage1=plan.stage1)
        self.parents.add(record)
        try:
            cap = p.capacity
            releases: list[tuple[Endpoint, list[str]]] = []
            if cap is not None:
                record.num_blocks = math.ceil(
                    (len(plan.prompt_ids) + plan.stage1.max_tokens) / cap.block_size)
                # Chosen, marked and counted now, with this parent's reservation below
                # and no await between: concurrent parents cannot take the room first.
                releases = self._release_for(record.num_blocks, cap.num_total_blocks)
                record.not_held_reason = self.parents.may_hold(record.num_blocks,
                                                               cap.num_total_blocks)
            d = None if local else self._parent_target()
            if not local and d is None and not record.not_held_reason:
                record.not_held_reason = "no decode engine in rotation to address it to"
            hold = not record.not_held_reason
            if not hold:
                logger.info("parent %s not held: %s", record.parent_id, record.not_held_reason)
            if hold:
                record.decode = d
                # Counted now (estimate), corrected when stage 1 says how many.
                self.parents.hold(record, time.time() + 3600.0)
            await self._send_releases(releases)
            export = hold and not local
            out = Outcome(plan, p.address, d.address if export else None)
            record.thinking_logprobs = out.thinking_logprobs  # grows as P samples
            handoff = None
            async for item in self._stage1(p, d if export else None, plan, out,
                                           export=export, hold=hold,
                                           hold_s=self.config.parent_hold_s):
                if isinstance(item, list):
                    yield item
                else:
                    handoff = item
            record.thinking_ids = out.thinking_ids
            record.finish_reason = out.stage1_finish_reason
            record.stage1_ms = (time.perf_counter() - t0) * 1e3
            if hold:
                self.parents.unhold(record)
                if export and handoff is None:
                    record.not_held_reason = "P exported no handoff"
                elif local and not out.held_until:
                    record.not_held_reason = "P did not hold it (its beam fork is off)"
                elif export:
                    record.handoff = handoff
                    record.num_blocks = handoff.num_blocks
                    record.held_until = handoff.lease_expires_at
                else:
                    record.num_blocks = math.ceil(
                        (len(record.prompt_ids) + len(record.thinking_ids) - 1)
                        / cap.block_size) if cap is not None else record.num_blocks
                    record.held_until = out.held_until
                if record.held_until:
                    self.parents.hold(record, record.held_until)
        except BaseException as e:
            record.error = str(e) or type(e).__name__
            # P's blocks (if it exported before failing) come back at its lease end.
            self.parents.unhold(record)
            self.parents.discard(record.parent_id)
            raise
        finally:
            record.done.set()
        yield record

    def _release_for(self, num_blocks: int, p_total_blocks: int
                     ) -> list[tuple[Endpoint, list[str]]]:
        """End the holds of idle parents (least recently used first) when a new parent
        of ``num_blocks`` would not fit in the share: they are marked not held and their
        blocks uncounted now (a continuation starting meanwhile recomputes, never reads
        blocks being freed); returns what to tell each P (``_send_releases``)."""
        records = self.parents.to_release(num_blocks, p_total_blocks)
        if not records:
            return []
        by_prefill: dict[int, tuple[Endpoint, list[str]]] = {}
        for r in records:
            r.not_held_reason = "released early: P's share for held parents was needed"
            self.parents.unhold(r)
            self.parents.evictions["released"] += 1
            name = f"{r.parent_id}-s1" if r.local else r.handoff.request_id
            by_prefill.setdefault(id(r.prefill_ep), (r.prefill_ep, []))[1].append(name)
        logger.info("releasing %d held parents early for a new one: %s", len(records),
                    ", ".join(r.parent_id for r in records))
        return list(by_prefill.values())

    async def _send_releases(self, releases: list[tuple[Endpoint, list[str]]]) -> None:
        """Tell each P which holds end now; a failed Release leaves their blocks to
        their lease end (already uncounted: the share may exceed by that, briefly)."""
        for ep, names in releases:
            try:
                await ep.stub.Release(engine_pb2.ReleaseRequest(request_ids=names),
                                      timeout=self.config.capacity_timeout_s)
            except Exception as e:  # their blocks come back at their leases' end
                logger.warning("Release on %s failed (%s): %d held parents kept until "
                               "their leases end", ep.address, e, len(names))

    def _parent_target(self) -> Endpoint | None:
        """The D a parent's handoff is addressed to: the one in rotation with the most
        room (its continuations run there while P holds the parent)."""
        live = [ep for ep in self.decode if ep.takes_work]
        return max(live, key=lambda ep: (ep.num_unclaimed_blocks, -ep.outstanding),
                   default=None)

    async def run_continuation(self, req: router_pb2.ContinueRequest,
                               deadline: float | None) -> router_pb2.GenerateResponse:
        """Stage 2 of ``req``'s parent (see the module docstring)."""
        from router.plan import to_response

        received_at = time.perf_counter()
        self.check_model(req.model)
        if not req.parent_id:
            raise InvalidRequest("parent_id", "is empty")
        record = self.parents.get(req.parent_id)
        if record is None:
            self.parents.continuations["not_found"] += 1
            raise grpc_error(grpc.StatusCode.NOT_FOUND,
                             f"parent {req.parent_id!r} is unknown: never served here, or "
                             f"forgotten (parents live {self.config.parent_ttl_s:g} s after "
                             f"their last use, at most {self.config.max_parents})")
        if req.model and record.model not in {req.model, Path(req.model).name}:
            self.parents.continuations["refused"] += 1
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {req.parent_id!r} ran under model {record.model!r}, "
                             f"not {req.model!r}")
        if req.timeout_ms:
            t = time.monotonic() + req.timeout_ms / 1e3
            deadline = t if deadline is None else min(deadline, t)
        if not record.done.is_set():
            logger.info("continuation of %s waits for its parent's stage 1", req.parent_id)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.wait_for(record.done.wait(), timeout)  # TimeoutError: DEADLINE
        if record.error:
            self.parents.continuations["refused"] += 1
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"parent {req.parent_id!r} failed: {record.error}")
        plan = self._continuation_plan(req, record, deadline)
        t0 = time.perf_counter()
        parent = record.prompt_ids + record.thinking_ids
        out = Outcome(plan, record.prefill, None, thinking_ids=list(record.thinking_ids),
                      stage1_finish_reason=record.finish_reason)
        request = self._stage2_request(plan, out)
        key = object()
        d = None
        # In use from here: never released early while this continuation may read it.
        record.in_use += 1
        why_not = self._why_not_importable(record)
        try:
            if not why_not and record.local:
                # P holds it: stage 2 on that P copies from the held blocks.
                request.held_parent = f"{record.parent_id}-s1"
                out.decode = record.prefill
                out.stage2 = await self._stage2(record.prefill_ep, request, plan, out, key)
            elif not why_not:
                d = await self._pick_decode(len(request.prompt_token_ids), plan, key,
                                            only=[record.decode])
                request.handoff.CopyFrom(record.handoff)
                d = await self._stage2_or_recompute(d, request, plan, out, key, True,
                                                    recompute=not req.strict)
            elif req.strict:
                self.parents.continuations["refused"] += 1
                raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"parent {req.parent_id!r} cannot be imported: {why_not} "
                                 "(strict: not recomputed)")
            else:
                logger.info("continuation of %s recomputed: %s", req.parent_id, why_not)
                out.failed_decode, out.handoff_failure = "", f"parent not held: {why_not}"
                await self._stage2_anywhere(request, plan, out, key)
        finally:
            record.in_use -= 1
            self._release(d, key)
        out.total_ms = (time.perf_counter() - t0) * 1e3
        resp = to_response(out, self.tokens.tokenizer, received_at)
        resp.parent_id = record.parent_id
        if record.stage1 is not None:
            resp.stage1_seed = record.stage1.seed or 0
            resp.stage1_positional = record.stage1.positional
        resp.stats.num_parent_tokens = len(parent)
        self.parents.continuations["recomputed" if resp.stats.recomputed else "imported"] += 1
        return resp

    async def run_prompt_beams(self, prompt_ids: list[int], beam, request_id: str,
                               deadline: float | None) -> router_pb2.GenerateResponse:
        """Beam search over a whole prompt on a D, nothing imported: what a client gets
        that sends stage 2 as a brand-new text request (the text round trip the bench
        compares continuations with)."""
        from router.plan import to_response

        received_at = time.perf_counter()
        cap = next((ep.capacity for ep in self.decode if ep.capacity), None)
        if cap is not None:
            validate_prompt(prompt_ids, vocab_size=cap.vocab_size,
                            max_model_len=cap.max_model_len, num_new_tokens=beam.max_tokens)
        elif not prompt_ids:
            raise InvalidRequest("prompt", "is empty")
        plan = Plan(request_id or f"b{next(self._ids)}", list(prompt_ids), [],
                    Stage1Params(max_tokens=1), beam, common_pb2.PATH_HANDOFF, deadline)
        t0 = time.perf_counter()
        out = Outcome(plan, "", None)
        await self._stage2_anywhere(self._stage2_request(plan, out), plan, out, object())
        out.total_ms = (time.perf_counter() - t0) * 1e3
        return to_response(out, self.tokens.tokenizer, received_at)

    async def _stage2_anywhere(self, request, plan: Plan, out: Outcome, key: object) -> None:
        """Stage 2 from token ids (nothing imported) on the D with the most room (on a
        P, for a router without decode engines); its claim under ``key`` ends with it."""
        if not self.decode:
            p = await self._pick_prefill(plan)
            out.decode = p.address
            out.stage2 = await self._stage2(p, request, plan, out, key)
            return
        d = await self._pick_decode(len(request.prompt_token_ids), plan, key)
        out.decode = d.address
        try:
            out.stage2 = await self._stage2(d, request, plan, out, key)
        finally:
            self._release(d, key)

    def _why_not_importable(self, record: ParentRecord) -> str:
        if record.not_held_reason:
            return record.not_held_reason
        if not record.held:
            return "P's lease on its blocks has ended"
        if record.local:
            if record.prefill_ep is None or not record.prefill_ep.takes_work:
                return "the prefill engine holding it is out of rotation or drained"
            return ""
        if record.decode is None or not record.decode.takes_work:
            return "the decode engine it is addressed to is out of rotation or drained"
        return ""

    def _continuation_plan(self, req: router_pb2.ContinueRequest, record: ParentRecord,
                           deadline: float | None) -> Plan:
        suffix = suffix_ids_of(req, self.tokens)
        beam = convert.beam_from_pb(req.beam)
        cap = next((ep.capacity for ep in (*self.decode, *self.prefill) if ep.capacity), None)
        sampling = None
        if req.HasField("sampling"):
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
        request_id = req.request_id or f"{record.parent_id}-c{next(self._ids)}"
        if len(request_id) > 128:
            raise InvalidRequest("request_id", "longer than 128 characters")
        return Plan(request_id, list(record.prompt_ids), suffix, Stage1Params(max_tokens=1),
                    beam, common_pb2.PATH_COLOCATED if record.local else common_pb2.PATH_HANDOFF,
                    deadline, stage2_sampling=sampling)


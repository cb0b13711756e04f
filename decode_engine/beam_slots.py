"""The scheduler side of beam search inside the engine: beam groups and their slots.

Stage 2's first step (the import, one request) is a group of one slot: the processor
picks the W best first tokens from its row; then W requests ("slots") decode the
group's beams, one engine step per beam step, until the search ends
(``decode_engine.beam``). Slot ``i`` starts as ``parent + [first token i]``
(``max_tokens`` = T - 1) and forks the first step's kept request (``connector.beam_fork``:
the shared full blocks are prefix hits, the partial last one is copied). A one-slot
group neither waits nor copies, and its blocks stay in the prefix cache. The logits
processor (``decode_engine.beam_processor``) picks each step's beams and forces the slots'
tokens; this part, owned by the engine's scheduler (``connector.admission``), does the
rest:

- **Made here.** The front end sends slot 0 (the "leader") alone; its parameters list
  the others (their last prompt token and score), which this part makes as vLLM
  ``Request``s with vLLM's block hasher and adds to the scheduler. Their outputs go to a
  client that never asked for them and drops them; a leader that ends before its group
  started (its client aborted) ends them too. A leader sent with its search's step 0
  (``SlotSpec.after``) waits for step 0's result and is filled in from it first
  (``decode_engine.slot_fill``).
- **Together.** A group's slots wait (the connector skips them) until all arrived and
  the step has room for all of them (running slots, token budget, and the blocks their
  first step takes from the free count); then they go to the front of the queue and
  start in one step. A group not scheduled whole ends with an error; it never runs
  split; one bigger than the pool ends at once.
- **Forks are block copies.** After a step whose new beam ``j`` continues the beam of
  slot ``p != j``, slot ``j``'s own blocks (from the one holding the parent's last token
  on) become copies of slot ``p``'s (gathered before scattered, before the next
  forward: the connector worker's, or vLLM's ``kv_cache_block_copies`` where the
  connector does not copy blocks). No request is created per step.
- **Out of the prefix cache.** A slot's own blocks change under it, so vLLM's hashes of
  them (made from the slot's own token list) would be wrong: they are evicted from the
  prefix cache in the step that made them. A copy only ever writes a block its slot
  alone holds (checked; a shared one ends the group).
- **Results.** The beams of the last step reach the scheduler in the worker metadata
  and go out on the final output of slot 0 (``kv_transfer_params[KEY][SLOT_KEY]``),
  with each step's processor time and blocks copied (``"steps"``). A
  step missing or out of order, or an error from the processor, ends every slot of the
  group with ``FINISHED_ERROR`` and the reason.

- **Stopped to move.** A group the engine's stop names (``decode_engine.search_stops``)
  ends at its next step with its state as its result (``GroupResult.stopped``), slot 0
  an export of the search's prompt; a group resumed elsewhere starts with slots whose
  last ``SlotSpec.tail`` prompt tokens are their beams' own (``decode_engine.slot_clone``).

Who owns the blocks: each slot's are vLLM's request blocks, freed when it finishes (a
stopped group's slot 0: when the engine it moves to has READ them, or at its lease's
end); the shared prefix blocks are prefix-cache hits, held by every slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from connector.handoff import is_made_slot
from connector.params import BEAM_KEY, KEY, SLOT_KEY, WAIT_KEY, Refusal
from connector.step_meta import BeamStepMeta
from decode_engine.beam_group import (
    START_TIMEOUT_S,
    Group,
    fork_copies,
    has_room,
    mid_prompt,
    shared_from_free,
)
from decode_engine.search_stops import SearchStops
from decode_engine.slot_clone import block_hasher, clone_slot, unshare_own_blocks
from decode_engine.slot_fill import Step0s, fill_leader, why_not_ready
from decode_engine.slot_spec import GroupResult, SlotSpec

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)



def slot_of(request: Request) -> SlotSpec | None:
    """The request's slot parameters (None: not a beam slot; checked by the processor's
    ``validate_params`` when the request came in)."""
    params = request.sampling_params
    return SlotSpec.read(params.extra_args if params is not None else None)


class SlotGroups:
    """The beam groups on one engine (module docstring). ``fail`` ends a request with
    ``FINISHED_ERROR`` and tells its client why (the admission scheduler's);
    ``block_hasher``: vLLM's (over blocks of ``hash_block_size`` tokens, by default the
    block size), for the slots made here."""

    def __init__(self, block_size: int, fail: Callable[[Request, str, str], None],
                 block_hasher: Callable[[Request], list[Any]] | None = None,
                 hash_block_size: int | None = None):
        self._block_size = block_size
        self._fail = fail
        self._block_hasher = block_hasher
        self._hash_block_size = hash_block_size or block_size
        self._groups: dict[str, Group] = {}
        self._slot_of: dict[str, tuple[str, int]] = {}  # request id -> (group, slot)
        #: Searches asked to stop to move (``decode_engine.search_stops``).
        self.stops = SearchStops()
        #: Step 0s that ended, for leaders sent with them (``decode_engine.slot_fill``).
        self.step0s = Step0s()

    @classmethod
    def for_scheduler(cls, scheduler: Any) -> SlotGroups:
        """The groups of an ``AdmissionScheduler`` (one of its ``hooks``): its block
        size, its ``reject``, vLLM's block hasher as its engine core builds it."""
        return cls(scheduler.block_size, scheduler.reject, block_hasher(scheduler),
                   hash_block_size=scheduler.hash_block_size)

    def stopping(self) -> list[str]:
        """The groups to stop to move, for this step's orders."""
        return self.stops.stopping(self._groups)

    def hides(self, request_id: str) -> bool:
        """Slots made here have no client (``CLONE_SEP``)."""
        return is_made_slot(request_id)

    def add(self, request: Request) -> list[Request]:
        """A new request: a slot joins its group and waits for the others. A leader
        (slot 0 naming ``clones``) comes alone from the front end: the group's other
        slots are made here, returned for the scheduler to add."""
        spec = slot_of(request)
        if spec is None:
            return []
        self._join(request, spec)
        unshare_own_blocks(request, spec, self._hash_block_size)
        return self._clones(request, spec)

    def _clones(self, leader: Request, spec: SlotSpec) -> list[Request]:
        return [clone_slot(leader, spec, i, tail, cum, self._block_hasher,
                           self._hash_block_size)
                for i, (tail, cum) in enumerate(spec.clones, start=1)]

    def _join(self, request: Request, spec: SlotSpec) -> None:
        name, slot, members = spec.group, spec.slot, spec.members
        group = self._groups.get(name)
        if group is None:
            # A slot's own blocks start at the one holding its first own prompt token
            # (its last one but in a resumed search: ``SlotSpec.tail``), never a
            # prefix-cache hit (vLLM computes at least its last token; the others are
            # its beam's alone).
            first = request.num_prompt_tokens - spec.tail
            forked = bool(((request.kv_transfer_params or {}).get(BEAM_KEY) or {})
                          .get("fork_from"))
            group = self._groups[name] = Group(
                members=members, first_block=first // self._block_size,
                tokens_each=spec.tail if forked else first % self._block_size + spec.tail,
                own_blocks=-(-request.num_prompt_tokens // self._block_size)
                - first // self._block_size, shared_tokens=first)
        group.slots[slot] = request.request_id
        self._slot_of[request.request_id] = (name, slot)
        if spec.after:
            group.after = spec.after  # filled in from step 0's result (slot_fill)
        if group.error:
            group.reported = False  # a slot late for a failed group ends with it
        if members == 1:
            return  # one slot (a search's step 0): nothing to wait for, nothing to copy
        params = request.kv_transfer_params = dict(request.kv_transfer_params or {})
        params[BEAM_KEY] = {**(params.get(BEAM_KEY) or {}), WAIT_KEY: True}

    def before_schedule(self, scheduler: Scheduler) -> None:
        """Start the groups whose slots all arrived and fit this step; a group still
        incomplete after ``START_TIMEOUT_S`` ends (its client went away mid-send)."""
        now = time.monotonic()
        self._fill_leaders(scheduler, now)
        self.stops.match(self._groups, scheduler.requests)
        claimed_seqs = claimed_tokens = claimed_blocks = 0  # by the groups started here
        pool = scheduler.kv_cache_manager.block_pool
        for group in self._groups.values():
            if group.started or group.error or group.members == 1 or group.after:
                continue
            if now - group.arrived_at > START_TIMEOUT_S:
                if len(group.slots) < group.members:
                    group.error = (f"{len(group.slots)} of its {group.members} slots "
                                   f"arrived within {START_TIMEOUT_S:.0f}s")
                else:
                    group.reason = "beam_room"
                    group.error = (f"no room for its {group.members} slots within "
                                   f"{START_TIMEOUT_S:.0f}s (sequences, token budget or "
                                   "blocks: the running requests kept them); retry later")
                continue
            if len(group.slots) < group.members:
                continue
            members = [scheduler.requests.get(rid) for rid in group.ids()]
            tokens = group.members * group.tokens_each
            if any(m is None or m.status != RequestStatus.WAITING for m in members):
                continue
            # Each slot's own blocks at its first step, and the shared ones it takes from
            # the free count: those not cached, and cached ones no request holds.
            blocks = group.members * group.own_blocks + shared_from_free(
                pool, members[0], group.first_block)
            if blocks > pool.num_gpu_blocks - 1:
                group.error = (f"its {group.members} slots need {blocks} blocks at their "
                               f"first step; the pool holds {pool.num_gpu_blocks - 1}")
                continue
            if (not has_room(scheduler, group.members + claimed_seqs,
                               tokens + claimed_tokens)
                    or blocks + claimed_blocks > pool.get_num_free_blocks()):
                continue
            claimed_seqs += group.members
            claimed_tokens += tokens
            claimed_blocks += blocks
            for member in members:
                member.kv_transfer_params[BEAM_KEY][WAIT_KEY] = False
            # First in the queue, slot 0 first: nothing ahead takes their budget.
            scheduler.waiting.remove_requests(members)
            for member in reversed(members):
                scheduler.waiting.prepend_request(member)

    def _fill_leaders(self, scheduler: Scheduler, now: float) -> None:
        """Leaders sent with their step 0 (``decode_engine.slot_fill``): filled in, and
        their groups' other slots made, once step 0 decided; ended if it ended without
        beams, or never came within ``START_TIMEOUT_S``."""
        for group in list(self._groups.values()):
            if group.after is None or group.error:
                continue
            step0, ended = self.step0s.find(group.after, self._groups)
            if step0 is None:
                if now - group.arrived_at > START_TIMEOUT_S:
                    group.error = (f"its step 0 {group.after} did not come within "
                                   f"{START_TIMEOUT_S:.0f}s")
                continue
            group.error = why_not_ready(step0, ended)
            if group.error or step0.result is None:
                continue  # ended, or step 0 still runs
            leader = scheduler.requests.get(group.slots.get(0, ""))
            spec = slot_of(leader) if leader is not None else None
            filled = (fill_leader(leader, spec, GroupResult.read(step0.result),
                                  self._hash_block_size)
                      if leader is not None and spec is not None else None)
            if filled is None:
                group.error = ("its step 0 left no live beam" if spec is not None
                               else "its leader ended before step 0 decided")
                continue
            self.step0s.claim(group.after)
            group.after, group.arrived_at = None, now
            if not step0.kept:  # admitted without fork: the slots compute their block
                group.tokens_each = group.shared_tokens % self._block_size + filled.tail
            for clone in self._clones(leader, filled):
                scheduler.add_request(clone)

    def after_schedule(self, scheduler: Scheduler, output: SchedulerOutput
                       ) -> list[KVCacheBlockCopy]:
        """Check every group runs whole; keep slot blocks out of the prefix cache; the
        copies of the last step's parents into their children's slots, to run before
        this step's forward (the caller hands them to the worker, all gathered before
        any is written: a permutation with repeats is safe)."""
        scheduled = output.num_scheduled_tokens
        pool = scheduler.kv_cache_manager.block_pool
        copies: list[KVCacheBlockCopy] = []
        for name, group in self._groups.items():
            ids = group.ids()
            running = [rid in scheduled for rid in ids]
            if not any(running) or group.error:
                continue
            if not group.started:
                group.started = True
                group.first_computed = sum(scheduled.get(rid, 0) for rid in ids)
                logger.debug("Beam group %s starts: %d slots", name, group.members)
            if not all(running):
                # The processor fails the step too; the slots must not run split.
                group.error = (f"{sum(running)} of its {len(ids)} slots scheduled in "
                               f"beam step {group.step + 1}")
                continue
            if group.members == 1:
                continue  # its blocks never change under it: they may stay cached
            blocks = [scheduler.kv_cache_manager.get_block_ids(rid)[0][group.first_block:]
                      if on else [] for rid, on in zip(ids, running)]
            hashed = {b for own in blocks for b in own if pool.blocks[b].block_hash is not None}
            if hashed:
                pool.evict_blocks(hashed)
            if group.parents is not None:
                mine = fork_copies(group, blocks, pool)
                group.copied.append(len(mine))
                copies.extend(mine)
                group.parents = None
            elif group.step:
                group.copied.append(0)
        return copies

    def on_step_output(self, scheduler_output: SchedulerOutput,
                       model_runner_output: ModelRunnerOutput,
                       requests: dict[str, Request]) -> None:
        """Before vLLM reads a step's output: what the processor decided for each group
        that ran in it. A group whose search ended before its last step (no live beam
        left) has its slots' ``max_tokens`` capped at this step's token, so vLLM
        finishes them with this output, by length, as at the last step."""
        connector_output = model_runner_output.kv_connector_output
        meta = connector_output.kv_connector_worker_meta if connector_output else None
        records = meta.groups if isinstance(meta, BeamStepMeta) else {}
        scheduled = scheduler_output.num_scheduled_tokens
        for name, group in self._groups.items():
            if group.error or not group.started or not any(r in scheduled for r in group.ids()):
                continue
            record = records.get(name)
            if group.members == 1 and not (record or {}).get("error") and mid_prompt(
                    requests.get(group.ids()[0])):
                continue  # a partial (chunked) prefill step: its sample is discarded
            if record is None:
                group.error = f"no decision for beam step {group.step + 1}"
            elif record.get("error"):
                group.error = str(record["error"])
            elif int(record["step"]) != group.step + 1:
                group.error = (f"beam step {record['step']} arrived after step "
                               f"{group.step}")
            else:
                group.step += 1
                if group.members == 1:  # a step 0: kept for its slots to fork from?
                    beam = (getattr(requests.get(group.ids()[0]), "kv_transfer_params",
                                    None) or {}).get(BEAM_KEY) or {}
                    group.kept = bool(beam.get("keep"))
                group.select_ms.append(float(record.get("select_ms", 0.0)))
                parents = [int(p) for p in record["parents"]]
                if parents != list(range(len(parents))):
                    group.parents = parents
                if "result" in record:
                    group.result = record["result"]
                    if record.get("stopped"):
                        self.stops.export(group, requests.get(group.ids()[0]))
                    for rid in group.ids():
                        request = requests.get(rid)
                        if request is not None:
                            request.max_tokens = min(request.max_tokens,
                                                     request.num_output_tokens + 1)

    def after_output(self, scheduler: Scheduler, outputs: dict[int, EngineCoreOutputs]
                     ) -> None:
        """After vLLM read a step's output: slot 0's final output carries the beams; a
        failed group's slots end with its error; finished groups are forgotten."""
        for eco in outputs.values():
            for out in eco.outputs:
                where = self._slot_of.get(out.request_id)
                if out.finish_reason is None or where is None:
                    continue
                group = self._groups[where[0]]
                params = dict(out.kv_transfer_params or {})
                if group.result is not None and not group.error:
                    if where[1] == 0:
                        steps = {"select_ms": group.select_ms, "copied_blocks": group.copied,
                                 "first_computed": group.first_computed}
                        params[KEY] = {**(params.get(KEY) or {}),
                                       SLOT_KEY: GroupResult.read(group.result)
                                       .with_steps(steps).to_wire()}
                elif not group.error and out.finish_reason in (FinishReason.ERROR,
                                                               FinishReason.ABORT):
                    pass  # it ended before its group decided anything: its own reason
                else:
                    # A slot ending without the group's beams says why, whichever step.
                    out.finish_reason = FinishReason.ERROR
                    params = Refusal(group.reason, "beam search failed: "
                                     f"{group.error or 'no beams'}").attach(params)
                out.kv_transfer_params = params or None
        for name, group in self._groups.items():
            if group.error and not group.reported:
                group.reported = True
                logger.warning("Beam group %s ends: %s", name, group.error)
                for rid in group.ids():
                    request = scheduler.requests.get(rid)
                    if request is not None and not request.is_finished():
                        # Its output comes from the admission scheduler's _reject.
                        self._fail(request, group.reason, f"beam search failed: {group.error}")
        gone = [rid for rid in self._slot_of if rid not in scheduler.requests]
        for rid in gone:
            name, _ = self._slot_of.pop(rid)
            group = self._groups.get(name)
            if group is None:
                continue
            left = [r for r in group.ids() if r in scheduler.requests]
            if not left:
                del self._groups[name]
                if group.members == 1:
                    self.step0s.ended(name, group)  # for a leader still on its way
            elif group.result is None and not group.error:
                # A slot ended before its group (its client aborted the leader): the
                # others have no one to answer; they end too.
                group.error = f"slot {rid} ended before its group"
                group.reported = True
                logger.info("Beam group %s: %s ended; ending its %d other slots", name,
                            rid, len(left))
                scheduler.finish_requests(left, RequestStatus.FINISHED_ABORTED)

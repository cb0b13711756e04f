"""DecodeEngine: stage 2 (beam search, or sampling) on D, starting from an imported parent.

Step 0 is a single request over ``parent + suffix`` that carries the handoff: D's
scheduler admits it (valid, fits), the connector READs the parent's KV from P, and D
computes only ``len(suffix) + 1`` tokens. Later steps hit D's prefix cache. A sampled
stage 2 (a continuation with its own sampling parameters) is one request that imports the
same way and samples from there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from connector.handoff import ImportRequest
from connector.params import BEAM_KEY, KEY, ImportReport, Refusal
from decode_engine.beam import StoppedSearch, beam_search, error_message, resume_search
from engine import VllmEngine
from kvhandoff.budget import blocks_needed, live_slots, stage2_reservation
from kvhandoff.types import (
    Beam,
    BeamParams,
    InvalidRequest,
    Stage1Params,
    Stage2Result,
    StageError,
    check_beam_width,
    validate_prompt,
    validate_token_ids,
)

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def reserving(engine: VllmEngine, blocks: int, *, room: int | None = None,
              least: int = 0) -> Iterator[None]:
    """Count ``blocks`` (a stage 2's ``stage2_reservation``) as reserved on ``engine``
    while the body runs: D's admission and the router leave them free for it. One the
    whole pool cannot hold reserves nothing: D's admission refuses it whatever else runs
    (and tells P to release the parent), so it must not crowd out others meanwhile.
    An import gives ``room``, what D's admission checks it against (the pool less the
    reservations made before it, which its handoff carries), and ``least``, the fewest
    blocks it can be admitted at (beam fork off): one whose ``least`` exceeds its room
    is refused and reserves nothing; one that fits is admitted at no more than its room
    and reserves no more. So the reservations never sum past the pool, and an import on
    its way to a refusal does not get the ones after it refused too (seen once under a
    burst: "160 reserved of 135")."""
    if blocks > engine.num_total_blocks or (room is not None and least > room):
        blocks = 0
    elif room is not None:
        blocks = min(blocks, room)
    engine.num_reserved_blocks += blocks
    try:
        yield
    finally:
        engine.num_reserved_blocks -= blocks


async def run_beam_stage(
    engine: VllmEngine,
    prompt_token_ids: list[int],
    beam: BeamParams,
    request_id: str,
    first_step_extra_args: dict[str, Any] | None = None,
    held_parent: str | None = None,
    adapter: str = "",
    cache_salt: str | None = None,
    moved: StoppedSearch | None = None,
    stop_at: int = 0,
    room: int | None = None,
) -> Stage2Result:
    """Stage 2 on ``engine`` (under ``adapter``, "": none; every step under
    ``cache_salt``, if any); shared by the handoff path (D) and the colocated path
    (``held_parent``: the stage-1 request id of a parent held on ``engine``, whose blocks
    the first step copies from). ``moved``: a search stopped on another engine, resumed
    here (its prompt is ``prompt_token_ids``; step 0 imports its export); ``stop_at``:
    stop it to move once that many beam steps ran (``decode_engine.beam.beam_search``):
    the result is then ``stopped``. ``room``: an import's, as :func:`reserving` takes it."""
    validate_prompt(
        prompt_token_ids,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        num_new_tokens=beam.max_tokens,
    )
    check_beam_width(beam.beam_width, engine.max_beam_width,
                     "this engine (max_logprobs/2, max_num_seqs, vocabulary/2)")
    # The slots a constrained search makes: no more than its catalog lets live at once.
    slots = check_catalog(engine, beam)
    # Reserved from now until it ends at the peak its beams can reach: what the router
    # and D's admission count against the pool, so beam steps never run out of blocks.
    reserved = stage2_reservation(len(prompt_token_ids), engine.block_size, slots,
                                  beam.max_tokens, engine.config.beam_fork,
                                  engine.num_total_blocks,
                                  from_parent=beam.catalog is not None)
    least = blocks_needed(len(prompt_token_ids), engine.block_size, slots, beam.max_tokens,
                          from_parent=beam.catalog is not None)
    t0 = time.perf_counter()
    generate = functools.partial(engine.generate, adapter=adapter, cache_salt=cache_salt)
    with reserving(engine, reserved, room=room, least=least):
        if moved is not None:
            outcome = await resume_search(
                generate, moved, beam, eos_token_id=engine.eos_token_id,
                request_id=request_id, first_step_extra_args=first_step_extra_args,
                fork=engine.config.beam_fork, stop_at=stop_at)
        else:
            outcome = await beam_search(
                generate,
                prompt_token_ids,
                beam,
                eos_token_id=engine.eos_token_id,
                request_id=request_id,
                first_step_extra_args=first_step_extra_args,
                fork=engine.config.beam_fork,
                held_parent=held_parent or None,
                max_live=slots,
                stop_at=stop_at,
            )
    first = outcome.first_output
    imported = ImportReport.read(first.kv_transfer_params if first else None)
    return Stage2Result(
        beams=outcome.beams,
        num_prompt_tokens=len(prompt_token_ids),
        num_imported_tokens=imported.num_imported_tokens,
        num_imported_bytes=imported.num_imported_bytes,
        num_imported_blocks=imported.num_imported_blocks,
        num_computed_tokens_first_step=outcome.step_computed_tokens[0],
        num_computed_tokens_total=sum(outcome.step_computed_tokens),
        first_step_s=outcome.first_step_s,
        elapsed_s=time.perf_counter() - t0,
        step_computed_tokens=outcome.step_computed_tokens,
        num_recomputed_beam_tokens=outcome.recomputed_tokens,
        beam_steps=outcome.slot_steps,
        num_beams_short=0 if outcome.stopped else beam.beam_width - len(outcome.beams),
        num_dropped_beams=outcome.num_dropped,
        stopped=outcome.stopped,
    )


def check_catalog(engine: VllmEngine, beam: BeamParams) -> int:
    """A constrained search names a catalog this engine loaded, and grows its beams long
    enough for an item (checked before any import is read); returns the slots the search
    makes (W, or fewer where the catalog cannot keep W beams alive)."""
    if beam.catalog is None:
        return beam.beam_width
    catalog = engine.catalogs.get(beam.catalog)
    if catalog is None:
        raise StageError("stage2", "catalog",
                         f"no catalog {beam.catalog!r} on this engine (it has "
                         f"{sorted(engine.catalogs) or 'none'})")
    if beam.max_tokens < catalog.min_item_len:
        raise InvalidRequest("beam.max_tokens",
                             f"{beam.max_tokens} is shorter than the shortest item of "
                             f"catalog {beam.catalog!r} ({catalog.min_item_len} tokens)")
    return live_slots(beam.beam_width, catalog.nodes_at_depth(), beam.max_tokens)


async def run_sample_stage(
    engine: VllmEngine,
    prompt_token_ids: list[int],
    params: Stage1Params,
    request_id: str,
    first_step_extra_args: dict[str, Any] | None = None,
    held_parent: str | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    adapter: str = "",
    cache_salt: str | None = None,
    room: int | None = None,
) -> Stage2Result:
    """A sampled stage 2 on ``engine`` (under ``adapter``, "": none): one sequence of
    ``params`` over ``parent + suffix``, returned as one beam (tokens, the sum of their
    logprobs, why it ended); ``on_tokens`` is called with each batch of new tokens as
    they are sampled.
    ``first_step_extra_args`` carry an import (D); ``held_parent`` names a parent held on
    ``engine`` to copy from (the one-engine path). With a seed the tokens equal the same
    request's on any engine (vLLM's sampling, or positional sampling)."""
    from engine.sampling import sampling_params

    validate_prompt(prompt_token_ids, vocab_size=engine.vocab_size,
                    max_model_len=engine.max_model_len, num_new_tokens=params.max_tokens)
    validate_token_ids(params.stop_token_ids, vocab_size=engine.vocab_size,
                       field_name="sampling.stop_token_ids")
    extra = dict(first_step_extra_args or {})
    if held_parent and engine.config.beam_fork:
        extra["kv_transfer_params"] = {
            **(extra.get("kv_transfer_params") or {}),
            BEAM_KEY: {"id": f"{request_id}-c", "fork_from": held_parent, "fork_children": 1}}
    sampling = sampling_params(params, extra, logprobs=0)
    reserved = stage2_reservation(len(prompt_token_ids), engine.block_size, 1,
                                  params.max_tokens, engine.config.beam_fork,
                                  engine.num_total_blocks)
    least = blocks_needed(len(prompt_token_ids), engine.block_size, 1, params.max_tokens)
    t0 = time.perf_counter()
    first_step_s, first, last = 0.0, None, None
    token_ids: list[int] = []
    with reserving(engine, reserved, room=room, least=least):
        async for out in engine.stream(prompt_token_ids, sampling, request_id, adapter,
                                       cache_salt):
            if first is None:
                first, first_step_s = out, time.perf_counter() - t0
            token_ids.extend(out.outputs[0].token_ids)
            if on_tokens is not None and out.outputs[0].token_ids:
                on_tokens(list(out.outputs[0].token_ids))
            last = out
    assert first is not None and last is not None and last.finished, \
        f"{request_id}: no final output"
    reason = last.outputs[0].finish_reason
    if reason not in ("stop", "length"):
        # An import refused at admission or failed says why (connector.admission).
        raise StageError("stage2",
                         Refusal.read(last.kv_transfer_params).reason or reason or "unknown",
                         error_message(last))
    imported = ImportReport.read(last.kv_transfer_params)
    computed_first = len(prompt_token_ids) - (first.num_cached_tokens or 0)
    return Stage2Result(
        beams=[Beam(token_ids=token_ids,
                    cum_logprob=float(last.outputs[0].cumulative_logprob or 0.0),
                    finish_reason=reason)],
        num_prompt_tokens=len(prompt_token_ids),
        num_imported_tokens=imported.num_imported_tokens,
        num_imported_bytes=imported.num_imported_bytes,
        num_imported_blocks=imported.num_imported_blocks,
        num_computed_tokens_first_step=computed_first,
        num_computed_tokens_total=computed_first + max(len(token_ids) - 1, 0),
        first_step_s=first_step_s,
        elapsed_s=time.perf_counter() - t0,
        step_computed_tokens=[computed_first],
    )


class DecodeEngine(VllmEngine):
    """The decode/beam engine (D)."""

    async def stop_searches(self, request_ids: list[str], target: str = "") -> None:
        """Stop running beam searches (stage 2s, by request id) after their next beam
        step, to move them (``decode_engine.search_stops``): each one's stage 2 then
        returns ``stopped``, its prompt's KV exported under a lease, the export
        addressed to ``target`` when given. A search in its step 0 stops after its
        first step of slots; unknown or finished ids are ignored."""
        from vllm import SamplingParams

        from connector.params import RETARGET_KEY, STOP_KEY

        transfer = {STOP_KEY: request_ids, RETARGET_KEY: target}
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params": transfer})
        await self.generate([self.eos_token_id or 0], params,
                            f"stop-{uuid.uuid4().hex[:12]}")

    async def run_stage2(
        self,
        prompt_token_ids: list[int],
        beam: BeamParams,
        request_id: str,
        *,
        handoff: ImportRequest,
        sampling: Stage1Params | None = None,
        on_tokens: Callable[[list[int]], None] | None = None,
        adapter: str = "",
        moved: StoppedSearch | None = None,
        stop_at: int = 0,
    ) -> Stage2Result:
        """Stage 2 importing P's export (``handoff``, built for ``beam``; with
        ``sampling``, a sampled stage 2 whose ``beam`` is its shape: width 1, its
        max_tokens), under ``adapter`` ("": none; D's admission refuses an export
        computed under another). Even a handoff that looks wrong goes to D's scheduler: it is the one
        authority, and refusing there also tells P to release the parent's blocks.
        ``moved``: a search stopped on another D, resumed here (``handoff``: the import
        of its export; ``prompt_token_ids``: its prompt); ``stop_at``: see
        :func:`run_beam_stage`."""
        assert (handoff.beam_width, handoff.beam_max_tokens) == (beam.beam_width, beam.max_tokens), \
            f"{request_id}: the import request was built for other beams"
        # A stage 2 carrying an injected fault runs under a cache salt of its own: it
        # finds nothing in D's prefix cache (the whole parent is imported, so the fault
        # has blocks to corrupt even right after its positive twin ran the same prompt
        # and seed) and leaves nothing another request can find (its corrupted blocks
        # hash under the salt).
        # An approximate composition's KV (connector.blend) is salted on P: the import
        # goes under the same salt, which D's admission checks.
        fields = handoff.export.get(KEY)
        salt = (str(fields.get("cache_salt") or "") or None) if isinstance(fields, dict) else None
        if handoff.fault is not None:
            self.check_fault(handoff.fault)
            salt = f"kvhandoff-fault:{request_id}"
        # The stage 2s already running here: admission leaves their peaks free. It
        # counts the slots the search makes (a catalog may keep fewer than W alive).
        slots = beam.beam_width if sampling is not None else check_catalog(self, beam)
        reserved = self.num_reserved_blocks
        params = replace(handoff, beam_width=slots, reserved_blocks=reserved).to_params()
        # The room admission checks it in: what it may reserve (``reserving``).
        room = self.num_total_blocks - reserved
        if sampling is not None:
            result = await run_sample_stage(
                self, prompt_token_ids, sampling, request_id,
                first_step_extra_args={"kv_transfer_params": params}, on_tokens=on_tokens,
                adapter=adapter, cache_salt=salt, room=room)
        else:
            result = await run_beam_stage(
                self, prompt_token_ids, beam, request_id,
                first_step_extra_args={"kv_transfer_params": params}, adapter=adapter,
                cache_salt=salt, moved=moved, stop_at=stop_at, room=room,
            )
        if result.stopped is not None:
            # The stopped search's export reaches this engine's worker with the next
            # step's metadata: once it ran, a READ of it is counted (not one that comes
            # first, which vLLM's worker would drop, the blocks held to the lease).
            await self.run_one_step()
        expected = int(params.get(KEY, {}).get("num_computed_tokens", 0))
        if result.num_prompt_tokens - result.num_computed_tokens_first_step < expected:
            # The import did not cover the parent (e.g. a load failure recomputed it).
            logger.warning(
                "%s: D computed %d tokens for the import step, expected %d",
                request_id, result.num_computed_tokens_first_step,
                result.num_prompt_tokens - expected,
            )
        return result

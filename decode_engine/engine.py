"""DecodeEngine: stage 2 (beam search) on D, starting from an imported parent.

Step 0 is a single request over ``parent + suffix`` that carries the handoff: D's
scheduler admits it (valid, fits), the connector READs the parent's KV from P, and D
computes only ``len(suffix) + 1`` tokens. Later steps hit D's prefix cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from connector.handoff import KEY, ImportRequest
from decode_engine.beam import beam_search
from engine import VllmEngine
from kvhandoff.budget import stage2_reservation
from kvhandoff.types import BeamParams, Stage2Result, check_beam_width, validate_prompt

logger = logging.getLogger(__name__)


async def run_beam_stage(
    engine: VllmEngine,
    prompt_token_ids: list[int],
    beam: BeamParams,
    request_id: str,
    first_step_extra_args: dict[str, Any] | None = None,
) -> Stage2Result:
    """Stage 2 on ``engine``; shared by the handoff path (D) and the colocated path."""
    validate_prompt(
        prompt_token_ids,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        num_new_tokens=beam.max_tokens,
    )
    check_beam_width(beam.beam_width, engine.config.max_beam_width,
                     "this engine (max_logprobs/2)")
    # Reserved from now until it ends at the peak its beams can reach: what the router
    # and D's admission count against the pool, so beam steps never run out of blocks.
    reserved = stage2_reservation(len(prompt_token_ids), engine.block_size, beam.beam_width,
                                  beam.max_tokens, engine.config.beam_fork,
                                  engine.num_total_blocks)
    engine.num_reserved_blocks += reserved
    t0 = time.perf_counter()
    try:
        outcome = await beam_search(
            engine.generate,
            prompt_token_ids,
            beam,
            eos_token_id=engine.eos_token_id,
            request_id=request_id,
            first_step_extra_args=first_step_extra_args,
            fork=engine.config.beam_fork,
        )
    finally:
        engine.num_reserved_blocks -= reserved
    first = outcome.first_output
    imported = ((first.kv_transfer_params or {}).get(KEY) or {}) if first else {}
    return Stage2Result(
        beams=outcome.beams,
        num_prompt_tokens=len(prompt_token_ids),
        num_imported_tokens=int(imported.get("num_imported_tokens", 0)),
        num_imported_bytes=int(imported.get("num_imported_bytes", 0)),
        num_imported_blocks=int(imported.get("num_imported_blocks", 0)),
        num_computed_tokens_first_step=outcome.step_computed_tokens[0],
        num_computed_tokens_total=sum(outcome.step_computed_tokens),
        first_step_s=outcome.first_step_s,
        elapsed_s=time.perf_counter() - t0,
        step_computed_tokens=outcome.step_computed_tokens,
        num_recomputed_beam_tokens=outcome.recomputed_tokens,
    )


class DecodeEngine(VllmEngine):
    """The decode/beam engine (D)."""

    async def run_stage2(
        self,
        prompt_token_ids: list[int],
        beam: BeamParams,
        request_id: str,
        *,
        handoff: ImportRequest,
    ) -> Stage2Result:
        """Stage 2 importing P's export (``handoff``, built for ``beam``). Even a handoff
        that looks wrong goes to D's scheduler: it is the one authority, and refusing
        there also tells P to release the parent's blocks."""
        assert (handoff.beam_width, handoff.beam_max_tokens) == (beam.beam_width, beam.max_tokens), \
            f"{request_id}: the import request was built for other beams"
        if handoff.fault is not None:
            self.check_fault(handoff.fault)
        # The stage 2s already running here: admission leaves their peaks free.
        params = replace(handoff, reserved_blocks=self.num_reserved_blocks).to_params()
        result = await run_beam_stage(
            self, prompt_token_ids, beam, request_id,
            first_step_extra_args={"kv_transfer_params": params},
        )
        expected = int(params.get(KEY, {}).get("num_computed_tokens", 0))
        if result.num_prompt_tokens - result.num_computed_tokens_first_step < expected:
            # The import did not cover the parent (e.g. a load failure recomputed it).
            logger.warning(
                "%s: D computed %d tokens for the import step, expected %d",
                request_id, result.num_computed_tokens_first_step,
                result.num_prompt_tokens - expected,
            )
        return result

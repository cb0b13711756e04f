"""PrefillEngine: stage 1 (sampling until ``</think>``, EOS or max_tokens) on P.

With ``export=True`` the request carries ``{"do_remote_decode": True}``: when it ends by a
stop token, EOS or length, P keeps its KV blocks under a lease and returns the handoff in
``Stage1Result.handoff_params`` for a decode engine to import.
"""

from __future__ import annotations

import logging
import time

from kvhandoff.engine import VllmEngine
from kvhandoff.types import Stage1Params, Stage1Result, StageError, validate_prompt

logger = logging.getLogger(__name__)


class PrefillEngine(VllmEngine):
    """The prefill/sampling engine (P). Also serves the colocated path."""

    async def run_stage1(
        self,
        prompt_token_ids: list[int],
        params: Stage1Params,
        request_id: str,
        *,
        export: bool,
    ) -> Stage1Result:
        from vllm import SamplingParams

        validate_prompt(
            prompt_token_ids,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_new_tokens=params.max_tokens,
        )
        sampling = SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else 0,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            detokenize=False,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}} if export else None,
        )
        t0 = time.perf_counter()
        out = await self.generate(prompt_token_ids, sampling, request_id)
        completion = out.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise StageError("stage1", completion.finish_reason or "unknown",
                             f"stage 1 ended with finish_reason={completion.finish_reason}")
        handoff_params = out.kv_transfer_params if export else None
        if export and not handoff_params:
            raise StageError("stage1", "export", "P finished stage 1 but exported no handoff")
        return Stage1Result(
            token_ids=list(completion.token_ids),
            finish_reason=completion.finish_reason,
            handoff_params=handoff_params,
            elapsed_s=time.perf_counter() - t0,
        )

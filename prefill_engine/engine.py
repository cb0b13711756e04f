"""PrefillEngine: stage 1 (sampling until ``</think>``, EOS or max_tokens) on P.

With ``export=True`` the request carries ``{"do_remote_decode": True}``: when it ends by a
stop token, EOS or length, P keeps its KV blocks under a lease and returns the handoff in
``Stage1Result.handoff_params`` for a decode engine to import, addressed to ``target``
(signed for it when a handoff secret is configured).

With ``hold`` and no export, P keeps the blocks here for continuations that run on this
engine (the one-engine path): a kept request of ``connector.beam_fork`` named by the
stage-1 request id, released when the hold ends (``Stage1Result.held_until``).

With ``handoff`` (a stage 1 moved here from another P), the request first imports the
tokens so far from that P's export, checked up front by P's scheduler as D checks an
import (``connector.admission``), then samples on and exports again.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from connector.blend_spec import Blend
from connector.handoff import ImportRequest
from connector.params import (
    BEAM_KEY,
    BLEND_KEY,
    FAULT_KEY,
    HOLD_KEY,
    REEXPORT_KEY,
    RELEASE_KEY,
    RELEASE_PREFIX_KEY,
    RETARGET_KEY,
    STOP_KEY,
    TARGET_KEY,
    BlendReport,
    HoldReport,
    ImportReport,
    Refusal,
)
from engine import VllmEngine
from kvhandoff.types import (
    InvalidRequest,
    Stage1Params,
    Stage1Result,
    StageError,
    TokenLogprob,
    validate_prompt,
    validate_token_ids,
)

if TYPE_CHECKING:
    from vllm import SamplingParams

logger = logging.getLogger(__name__)

#: ``hold`` for a request whose blocks stay held until released (a named chunk): no
#: lease ends it.
PINNED = math.inf


def stage1_sampling(params: Stage1Params,
                    transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    """vLLM sampling parameters of a stage 1 (any engine: P, or a colocated reference)."""
    from engine.sampling import sampling_params

    return sampling_params(
        params, {"kv_transfer_params": transfer_params} if transfer_params else None)


def _logprobs_of(token_ids: list[int], logprobs: Any, num_top: int | None
                 ) -> list[TokenLogprob]:
    """vLLM's per-token logprob dicts (token id -> Logprob with its rank) of a delta, as
    :class:`TokenLogprob` with the ``num_top`` most likely alternatives."""
    if num_top is None or not logprobs:
        return []
    out = []
    for token_id, entries in zip(token_ids, logprobs):
        top = sorted(((t, lp) for t, lp in entries.items() if lp.rank is not None
                      and lp.rank <= num_top), key=lambda e: e[1].rank)
        out.append(TokenLogprob(token_id, float(entries[token_id].logprob),
                                tuple((t, float(lp.logprob)) for t, lp in top[:num_top])))
    return out


class PrefillEngine(VllmEngine):
    """The prefill/sampling engine (P). Also serves the colocated path."""

    def _sampling(self, prompt_token_ids: list[int], params: Stage1Params, export: bool,
                  target: str | None, fault: str | None = None,
                  hold: bool | float = False, request_id: str = "",
                  handoff: ImportRequest | None = None,
                  blend: Blend | None = None) -> SamplingParams:
        validate_prompt(
            prompt_token_ids,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_new_tokens=params.max_tokens,
        )
        validate_token_ids(params.stop_token_ids, vocab_size=self.vocab_size,
                           field_name="stage1.stop_token_ids")
        if blend is not None and ((hold and not export) or handoff is not None):
            raise InvalidRequest("blend", "an approximate composition is neither held here "
                                          "nor moved (its KV is salted: an export or none)")
        if not export and hold:
            lease = float(self.config.lease_s)
            hold_s = (lease if hold is True else PINNED if hold == PINNED
                      else min(float(hold), lease))
            if not self.config.beam_fork:
                logger.info("%s not held here: this engine runs without beam fork",
                            request_id)
                return stage1_sampling(params)
            held: dict[str, Any] = {BEAM_KEY: {"id": request_id, "keep": True,
                                               "hold_s": hold_s}}
            if fault is not None:  # "stale": the held blocks are overwritten
                self.check_fault(fault)
                held[FAULT_KEY] = fault
            return stage1_sampling(params, held)
        if handoff is not None:
            if not export:
                raise InvalidRequest("export", "a stage 1 that imports a handoff exports "
                                     "again: set export")
            # Imports first (do_remote_prefill), exports once the READ is queued.
            transfer = {**handoff.to_params(), REEXPORT_KEY: True, TARGET_KEY: target or ""}
        elif not export:
            return stage1_sampling(params, {BLEND_KEY: blend.to_params()} if blend else None)
        else:
            transfer = {"do_remote_decode": True, TARGET_KEY: target or ""}
        if hold:
            transfer[HOLD_KEY] = True if hold is True else float(hold)
        if blend is not None:
            transfer[BLEND_KEY] = blend.to_params()
        if fault is not None:
            self.check_fault(fault)
            transfer[FAULT_KEY] = fault
        return stage1_sampling(params, transfer)

    async def stream_stage1(
        self,
        prompt_token_ids: list[int],
        params: Stage1Params,
        request_id: str,
        *,
        export: bool,
        target: str | None = None,
        fault: str | None = None,
        hold: bool | float = False,
        handoff: ImportRequest | None = None,
        adapter: str = "",
        blend: Blend | None = None,
    ) -> AsyncIterator[tuple[list[int], list[TokenLogprob], Stage1Result | None]]:
        """Yield ``(new_token_ids, their logprobs, None)`` as tokens are sampled (logprobs
        when ``params.logprobs`` asks), then ``([], [], result)`` once stage 1 has
        finished. With ``export``, the handoff is
        addressed to (and, with a secret, signed for) the decode engine ``target``; with
        ``hold`` too, P keeps the exported blocks for the whole lease (or ``hold``
        seconds, at most the lease) however often they are read (a parent for
        continuations), else until the first READ. ``hold`` without ``export``: the
        parent is held here for continuations on this engine (``Stage2`` with
        ``held_parent=request_id``), for the lease (or ``hold`` seconds), or until
        ``release`` with ``hold=PINNED`` (a named chunk: its full blocks stay in the
        prefix cache for every request that starts with its tokens).
        ``handoff``: another P's export of this request's tokens so far (a move), built
        for one sequence of ``params.max_tokens``; imported before sampling (with
        ``export``).
        ``fault``: a P-side fault of ``connector.faults`` (negative controls only).
        ``adapter``: the LoRA adapter to sample under ("": none); an export carries its
        name and digest (``connector.adapters``).
        ``blend``: an approximate composition (``connector.blend``, with ``export``): the
        prompt's first tokens copied from chunks pinned here, under the composition's
        cache salt, which the handoff carries to D."""
        sampling = self._sampling(prompt_token_ids, params, export, target, fault, hold,
                                  request_id, handoff, blend)
        salt = None
        if blend is not None:
            # A faulted composition hashes apart from its healthy twin (and every other
            # request): it finds none of the twin's blocks and leaves none behind.
            salt = blend.cache_salt() + (f":fault:{request_id}" if fault else "")
        t0 = time.perf_counter()
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        first = last = None
        async for out in self.stream(prompt_token_ids, sampling, request_id, adapter,
                                     salt):
            first, last = first or out, out
            new = list(out.outputs[0].token_ids)
            if new:
                token_ids.extend(new)
                new_logprobs = _logprobs_of(new, out.outputs[0].logprobs, params.logprobs)
                logprobs.extend(new_logprobs)
                yield new, new_logprobs, None
        assert last is not None and last.finished, f"{request_id}: no final output"
        reason = last.outputs[0].finish_reason
        if reason not in ("stop", "length"):
            # An import refused at admission or failed says why (connector.admission).
            refusal = Refusal.read(last.kv_transfer_params)
            raise StageError("stage1", refusal.reason or reason or "unknown",
                             refusal.error or f"stage 1 ended with finish_reason={reason}")
        handoff_params = last.kv_transfer_params if export else None
        if export and not handoff_params:
            raise StageError("stage1", "export", "P finished stage 1 but exported no handoff")
        held_until = 0.0
        if hold and not export:
            held_until = HoldReport.read(last.kv_transfer_params).held_until
        imported = ImportReport.read(last.kv_transfer_params, exporting=True)
        blended = BlendReport.read(last.kv_transfer_params)
        yield [], [], Stage1Result(
            token_ids=token_ids,
            finish_reason=reason,
            handoff_params=handoff_params,
            elapsed_s=time.perf_counter() - t0,
            held_until=held_until,
            logprobs=logprobs,
            num_imported_tokens=imported.num_imported_tokens,
            num_imported_bytes=imported.num_imported_bytes,
            num_computed_tokens=len(prompt_token_ids) - (first.num_cached_tokens or 0),
            num_blended_tokens=blended.num_blended_tokens,
            blend_refused=blended.refused,
        )

    async def release(self, names: list[str], prefixes: list[str] | None = None) -> None:
        """End holds early (see ``connector.params.RELEASE_KEY``): a one-token request
        carries the names to the connector's scheduler side; their blocks are freed
        within a step or two of its return. ``prefixes``: also every parent held here
        whose name starts with one. The caller promises no READ of them is in flight or
        will come."""
        from vllm import SamplingParams

        transfer = {RELEASE_KEY: names, RELEASE_PREFIX_KEY: list(prefixes or ())}
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params": transfer})
        await self.generate([self.eos_token_id or 0], params,
                            f"release-{uuid.uuid4().hex[:12]}")
        logger.info("released %d held parents early%s", len(names),
                    f" and those named {prefixes}*" if prefixes else "")

    async def stop(self, request_ids: list[str], target: str = "") -> None:
        """Stop running stage 1s after their next token (a move): each ends as if it had
        asked for that many tokens, with its handoff when it was started with
        ``export``, addressed to ``target`` when given (another P) instead of the engine
        it named. Unknown or finished ids are ignored."""
        from vllm import SamplingParams

        transfer = {STOP_KEY: request_ids, RETARGET_KEY: target}
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                extra_args={"kv_transfer_params": transfer})
        await self.generate([self.eos_token_id or 0], params, f"stop-{uuid.uuid4().hex[:12]}")

    async def run_stage1(self, *args: Any, **kwargs: Any) -> Stage1Result:
        """:meth:`stream_stage1` (the same arguments) run to its end: its result."""
        result = None
        async for _, _, final in self.stream_stage1(*args, **kwargs):
            result = final or result
        assert result is not None
        return result

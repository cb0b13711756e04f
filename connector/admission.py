"""AdmissionScheduler: an engine admits a handoff import only if it is valid and fits.

vLLM's scheduler plus an up-front check of every import; the base of D's scheduler
(``decode_engine.scheduler``: stage 2 imports P's parent) and of P's
(``prefill_engine.scheduler``: a stage 1 moved from another P imports the tokens so
far). It runs in the engine-core process. Before vLLM schedules anything, every newly
arrived import request is checked once, before any transfer starts:

- the handoff parses and speaks our protocol version; with a shared secret, it is signed
  by its exporter and addressed to this engine (or its handoff group)
  (``connector.signing``);
- it comes from the same model, matches the prompt's first N tokens (digest) and its
  lease has time left;
- it was computed under the adapter this request runs under, with the same weights
  (``connector.adapters``), and its blocks hashed under this request's cache salt (an
  approximate composition's KV, ``connector.blend``, goes only where it is salted);
- the pool can hold the parent's blocks, the suffix and the beam fan-out (one sequence
  and its remaining tokens for a moved stage 1).

A request that fails a check is finished at admission with ``FINISHED_ERROR`` and the
reason in ``kv_transfer_params["kvhandoff"]["error"]``. Finishing it while
``do_remote_prefill`` is still set makes the stock connector notify the exporter, so it
releases its blocks now rather than at lease expiry. Stock vLLM would instead leave a
request it cannot allocate WAITING forever, holding the queue and the exporter's lease.

The block budget it admits against is :mod:`kvhandoff.budget`, shared with the router,
D's server and the Ray Serve deployments.

A subclass adds what it runs beside vLLM's scheduling as :class:`StepHook` objects
(``hooks``: factories of the scheduler), called at each point of a step; beam search
inside the engine is one (``decode_engine.beam_slots``). This module knows none of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from connector.adapters import adapter_of, check_import_adapter, digests_of
from connector.faults import ANY_ADAPTER_FAULT
from connector.field_checks import DEFAULT_MAX_LEASE_S, check_geometry
from connector.handoff import DEFAULT_LEASE_SAFETY_MARGIN_S, ImportRequest, can_reach_p, validate_import
from connector.params import BEAM_KEY, Refusal
from connector.signing import load_secret, verify
from connector.step_orders import ContinuationMetadata
from kvhandoff.budget import blocks_needed
from kvhandoff.heap import Trimmer, start_from_env
from kvhandoff.model import model_fingerprint
from kvhandoff.types import HandoffError

logger = logging.getLogger(__name__)

_ADMITTED = "_kvhandoff_admitted"
#: Rejections before the signature was verified.
_UNVERIFIED = frozenset({"missing", "malformed", "protocol", "unsigned", "signature", "target"})
#: Rejections after which P is never contacted, signed or not: the handoff's fields do
#: not hold together (``connector.field_checks``), so neither does its address.
_UNREACHABLE = frozenset({"missing", "malformed"})


class StepHook(Protocol):
    """Work a scheduler runs beside vLLM's at each point of a step (the engine-core
    process, one thread). Requests it makes are its own; block copies it returns run in
    this step's worker, before the forward."""

    def add(self, request: Request) -> list[Request]:
        """A new request; returns requests it makes from it, for the scheduler to add."""

    def before_schedule(self, scheduler: Scheduler) -> None: ...

    def after_schedule(self, scheduler: Scheduler, output: Any) -> list[Any]:
        """This step's schedule; returns the block copies it needs (vLLM's
        ``KVCacheBlockCopy``)."""

    def on_step_output(self, scheduler_output: Any, model_runner_output: Any,
                       requests: dict[str, Request]) -> None: ...

    def after_output(self, scheduler: Scheduler, outputs: dict[int, EngineCoreOutputs]
                     ) -> None: ...

    def hides(self, request_id: str) -> bool:
        """Whether the request's outputs stay in the engine (a request it made)."""


class AdmissionScheduler(Scheduler):
    """vLLM's scheduler with an up-front admission check for handoff imports."""

    #: Names the pool in a refusal ("decode pool too small: ...").
    pool_name = "this engine's"
    #: Made once per scheduler, in order (module docstring).
    hooks: tuple[Callable[[AdmissionScheduler], StepHook], ...] = ()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)

        self._model_fingerprint = model_fingerprint(self.vllm_config.model_config.model)
        config = self.vllm_config.kv_transfer_config
        self._lease_margin_s = float(
            config.get_from_extra_config(
                "lease_safety_margin_s", DEFAULT_LEASE_SAFETY_MARGIN_S
            )
            if config
            else DEFAULT_LEASE_SAFETY_MARGIN_S
        )
        self._max_lease_s = float(
            config.get_from_extra_config("max_lease_s", DEFAULT_MAX_LEASE_S)
            if config else DEFAULT_MAX_LEASE_S)
        self._beam_fork = bool(config.get_from_extra_config("beam_fork", True)) if config else False
        self._secret = load_secret(
            config.get_from_extra_config("handoff_secret_file", None) if config else None
        )
        group = config.get_from_extra_config("handoff_group", None) if config else None
        self._handoff_ids = {config.engine_id if config else "", *([group] if group else [])}
        self._adapter_digests = digests_of(self.vllm_config)
        # Negative controls only (connector.faults): off unless the engine was started so.
        self._fault_injection = bool(config.get_from_extra_config("fault_injection", False)
                                     if config else False)
        self._rejected: list[tuple[Request, str, str]] = []
        # Admitted imports whose request has not finished yet.
        self._importing: set[str] = set()
        self._hooks = [make(self) for make in self.hooks]
        # The engine core's heap (kvhandoff.heap): free pages given back every few
        # seconds of work; snapshots only when asked (a diagnostic).
        self._trimmer = Trimmer()
        start_from_env(f"{self.pool_name}-core")

    @property
    def num_total_blocks(self) -> int:
        # One block is vLLM's null block and never holds KV.
        return self.kv_cache_config.num_blocks - 1

    def add_request(self, request: Request) -> None:
        made = [m for hook in self._hooks for m in hook.add(request)]
        super().add_request(request)
        for other in made:  # e.g. a beam group's other slots, made from its leader
            self.add_request(other)

    def schedule(self, *args: Any, **kwargs: Any):
        self._trimmer.maybe_trim()
        self._admit_new_imports()
        for hook in self._hooks:
            hook.before_schedule(self)
        output = super().schedule(*args, **kwargs)
        copies = [c for hook in self._hooks for c in hook.after_schedule(self, output)]
        if copies:
            self._send_copies(output, copies)
        return output

    def _send_copies(self, output: Any, copies: list[Any]) -> None:
        """The hooks' block copies for this step's worker. With beam fork on, the
        connector's worker runs them with its fork copies (``connector.beam_fork``: one
        gather and one scatter per KV tensor); else vLLM's ``kv_cache_block_copies``,
        which on CPU copies through a byte view and cost ~0.8 ms a step for 25 blocks
        (docs/decisions.md, "Slot copies on the connector's worker")."""
        meta = output.kv_connector_metadata
        if self._beam_fork and isinstance(meta, ContinuationMetadata):
            meta.orders.fork_copies = [*meta.orders.fork_copies, *copies]
            # They feed this step's forward: vLLM runs the connector's loads before it
            # only in a step with a sync load (else after, off the critical path).
            output.has_sync_kv_loads = True
        else:
            output.kv_cache_block_copies = [*(output.kv_cache_block_copies or []), *copies]

    def _admit_new_imports(self) -> None:
        # Imports admitted in this pass have not allocated yet: count what they claimed.
        claimed = 0
        for request in list(self.waiting):
            params = request.kv_transfer_params
            if not params or not params.get("do_remote_prefill") or params.get(_ADMITTED):
                continue
            params[_ADMITTED] = True
            try:
                claimed += self._check_import(request, params, claimed)
            except HandoffError as e:
                self.reject(request, e.reason, str(e))
            else:
                self._importing.add(request.request_id)

    def _record_fault(self) -> None:
        """An injected fault took effect here: counted in the connector's stats."""
        stats = getattr(getattr(self.connector, "connector_scheduler", None), "stats", None)
        if stats is not None:
            stats.record_fault()

    def _check_import(self, request: Request, params: dict[str, Any], claimed: int) -> int:
        """Raise :class:`HandoffError` unless this engine takes the import; return its
        blocks."""
        handoff, wanted = ImportRequest.parse(params)
        if self._secret is not None:
            verify(params, self._secret, self._handoff_ids)
        check_geometry(handoff, params, num_groups=len(self.kv_cache_config.kv_cache_groups),
                       max_lease_s=self._max_lease_s)
        validate_import(
            handoff,
            request.prompt_token_ids or [],
            model_fingerprint=self._model_fingerprint,
            safety_margin_s=self._lease_margin_s,
        )
        try:
            check_import_adapter(handoff.adapter, handoff.adapter_digest,
                                 adapter_of(request), self._adapter_digests)
        except HandoffError:
            if not (self._fault_injection and wanted.fault == ANY_ADAPTER_FAULT):
                raise
            self._record_fault()  # the fault: the refusal skipped
        if handoff.cache_salt and handoff.cache_salt != request.cache_salt:
            raise HandoffError(
                "salt", f"the export's KV hashes under cache salt {handoff.cache_salt!r}, "
                        f"this request's under {request.cache_salt or ''!r}")
        beam_width, beam_max_tokens = wanted.beam_width, wanted.beam_max_tokens
        needed = blocks_needed(
            request.num_prompt_tokens, self.block_size, beam_width, beam_max_tokens,
            self._beam_fork, from_parent=wanted.beam_from_parent,
        )
        # Free now, and free once the stage 2s running here (D) reach their peaks.
        reserved = wanted.reserved_blocks
        free = min(self.kv_cache_manager.block_pool.get_num_free_blocks() - claimed,
                   self.num_total_blocks - reserved)
        beam = params.get(BEAM_KEY)
        if needed > free and beam is not None:
            plain = blocks_needed(
                request.num_prompt_tokens, self.block_size, beam_width, beam_max_tokens,
                from_parent=wanted.beam_from_parent,
            )
            if plain <= free:
                logger.info(
                    "Admitting %s without beam fork: %d blocks free, %d needed with it, "
                    "%d without", request.request_id, free, needed, plain
                )
                beam["keep"] = False
                beam["fork_disabled"] = True
                needed = plain
        if needed > free:
            raise HandoffError(
                "capacity",
                f"{self.pool_name} pool too small: needs {needed} blocks of {self.block_size} "
                f"tokens ({request.num_prompt_tokens}-token prompt, beam width "
                f"{beam_width}, {beam_max_tokens} beam tokens), {free} free of "
                f"{self.num_total_blocks} ({reserved} reserved by running stage 2s)",
            )
        logger.debug("Admitting %s: %d blocks of %d free, P's lease ends in %.2fs "
                     "(arrived %.2fs ago)", request.request_id, needed, free,
                     handoff.lease_remaining_s(), time.time() - request.arrival_time)
        return needed

    def reject(self, request: Request, reason: str, message: str) -> None:
        """End ``request`` with ``FINISHED_ERROR``; its client gets ``reason`` and
        ``message`` (an import refused at admission, or a failed beam group's slot)."""
        logger.warning("Ending %s: %s", request.request_id, message)
        self._rejected.append((request, reason, message))
        params = request.kv_transfer_params
        if (not can_reach_p(params) or reason in _UNREACHABLE
                or (self._secret is not None and reason in _UNVERIFIED)):
            # Nobody to notify (and vLLM's connector would index the missing fields), or
            # the address is unverified: D never connects where a forged handoff says.
            # P's blocks, if any, come back when the lease ends.
            params["do_remote_prefill"] = False
        # With do_remote_prefill still set, the connector tells P to free its blocks.
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any
                           ) -> dict[int, EngineCoreOutputs]:
        for hook in self._hooks:
            hook.on_step_output(scheduler_output, model_runner_output, self.requests)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for eco in outputs.values():
            for out in eco.outputs:
                if out.finish_reason is None or out.request_id not in self._importing:
                    continue
                self._importing.discard(out.request_id)
                if out.finish_reason == FinishReason.ERROR and not out.kv_transfer_params:
                    # vLLM fails a request whose KV load failed without saying why.
                    out.kv_transfer_params = Refusal(
                        "import_failed",
                        "KV import from P failed: the READ was refused (P's lease "
                        "was about to end, or a block id beyond P's pool as its "
                        "handshake gave it), failed in transport, or P did not "
                        "confirm it still held the export when the READ "
                        "completed; see D's log",
                    ).to_params()
        # Forget imports finished without an output (aborted by the client).
        self._importing.intersection_update(self.requests)
        for hook in self._hooks:
            hook.after_output(self, outputs)
        rejected, self._rejected = self._rejected, []
        for request, reason, message in rejected:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs(outputs=[])
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    kv_transfer_params=Refusal(reason, message).to_params(),
                )
            )
        for eco in outputs.values():
            # Requests the hooks made have no client: their outputs would cross to the
            # front end only to be dropped there (511 beam slots a step at W=512).
            shown = [out for out in eco.outputs
                     if not any(hook.hides(out.request_id) for hook in self._hooks)]
            if len(shown) < len(eco.outputs):
                eco.outputs = shown
        return outputs


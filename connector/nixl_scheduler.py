"""The connector's scheduler side (in the engine-core process):
:class:`ContinuationConnectorScheduler`, which exports a typed handoff on P and imports a
continuation on D (``connector.nixl_continuation`` says what each means). vLLM builds it
through :class:`connector.nixl_continuation.ContinuationConnector`; the worker side is
``connector.nixl_worker``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)

from connector.adapters import adapter_of, digests_of
from connector.beam_fork import BeamForkScheduler, beam_params
from connector.blend import BlendScheduler
from connector.blend_spec import UNROTATED_FAULT
from connector.exports import describe_export
from connector.faults import (
    FAULTS,
    fault_of,
    num_imported_with_fault,
)
from connector.handoff import PROTOCOL_VERSION, kv_bytes_per_block
from connector.liveness import LiveExports, side_channel_listener
from connector.logs import use_vllm_handlers
from connector.params import (
    BLEND_KEY,
    EXPORT_TOKENS_KEY,
    HOLD_KEY,
    KEY,
    RELEASE_KEY,
    RELEASE_PREFIX_KEY,
    RETARGET_KEY,
    STOP_KEY,
    TARGET_KEY,
    WAIT_KEY,
    HoldReport,
    ImportReport,
)
from connector.request_kind import RequestKind, RequestKinds
from connector.runs import MERGE_LONG, RunAllocator
from connector.runtime import IdlePacer, listener_failures
from connector.signing import load_secret, sign
from connector.stats import ContinuationStats
from connector.step_orders import ContinuationMetadata, StepOrders
from kvhandoff.model import model_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request
logger = logging.getLogger(__name__)
use_vllm_handlers("connector", "decode_engine")

@dataclass(slots=True)
class _ImportRecord:
    num_tokens: int
    num_blocks: int


class ContinuationConnectorScheduler(NixlPullConnectorScheduler):
    """Scheduler side: export a typed handoff on P, import a continuation on D."""

    #: vLLM's side-channel thread target; ``__init__`` binds one to this engine's exports.
    _nixl_handshake_listener = staticmethod(side_channel_listener(LiveExports(),
                                                                  listener_failures))

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, engine_id, kv_cache_config)

        self.model_fingerprint = model_fingerprint(vllm_config.model_config.model)
        self.kv_bytes_per_block = kv_bytes_per_block(kv_cache_config)
        self._imports: dict[str, _ImportRecord] = {}
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        self.stats = ContinuationStats()
        self._fork = BeamForkScheduler.from_config(
            extra, len(kv_cache_config.kv_cache_groups), self.block_size, self.stats)
        self._kinds = RequestKinds(self._fork.enabled)
        # Approximate compositions load from the held chunks (connector.blend).
        self._blend = BlendScheduler(
            self.block_size, self._fork.kept,
            BlendScheduler.availability(vllm_config) if self._fork.enabled
            else "this engine runs without beam fork (no chunks are held)")
        #: This engine's adapters' digests by name: P signs the one an export ran under.
        self._adapter_digests = digests_of(vllm_config)
        self._secret = load_secret(extra.get_from_extra_config("handoff_secret_file", None))
        # Negative controls (connector.faults): off unless the engine was started so.
        self._fault_injection = bool(extra.get_from_extra_config("fault_injection", False))
        self._import_faults: dict[str, str] = {}  # D: request id -> decode-worker fault
        # D: requests whose import count a scheduler-side fault changed (counted in the
        # stats once their blocks are allocated).
        self._miscounted: set[str] = set()
        self._scribble_block_ids: list[int] = []  # P: exported blocks to overwrite
        # P: exports held for their whole lease (HOLD_KEY), for the worker's next step.
        self._holds: list[str] = []
        # P: held exports to release now (the engine's Release), for the worker's next step.
        self._unholds: list[str] = []
        # P: requests to stop after their next token (the engine's stop) -> the engine
        # their handoffs go to ("": the one they named).
        self._stops: dict[str, str] = {}
        self._idle = IdlePacer(
            float(extra.get_from_extra_config("idle_after_ms", 50)) / 1e3,
            float(extra.get_from_extra_config("idle_pause_ms", 20)) / 1e3)
        # Allocations in runs (connector.runs) from use_block_pool on; off: kv_runs=False.
        self._kv_runs = bool(extra.get_from_extra_config("kv_runs", True))
        self._kv_cache_config = kv_cache_config
        self._runs: RunAllocator | None = None
        # P: held exports, answered on the side channel vLLM starts (connector.liveness).
        self._live = LiveExports()
        self._nixl_handshake_listener = side_channel_listener(self._live, listener_failures)

    def use_block_pool(self, block_pool: BlockPool) -> None:
        """Once, from vLLM's ``bind_gpu_block_pool``: imports and stage 1s allocate
        their blocks in runs from here on (one KV cache group only)."""
        if self._kv_runs and len(self._kv_cache_config.kv_cache_groups) == 1:
            self._runs = RunAllocator(block_pool)

    def _arrange_run(self, request: Request, num_computed_tokens: int, num_tokens: int,
                     gap: bool = False) -> None:
        """Right before vLLM allocates ``request``'s blocks: ``connector.runs``."""
        if self._runs is not None:
            arranged = self._runs.arrange_for(request, self.block_size, num_computed_tokens,
                                              num_tokens, gap)
            if arranged is not None:
                self.stats.record_runs(arranged.num_runs, arranged.num_out_of_order)

    def _fault(self, request: Request) -> str | None:
        """The fault ``request`` names, if this engine injects faults."""
        name = fault_of(request.kv_transfer_params)
        if name is None:
            return None
        if not self._fault_injection:
            logger.warning("Ignoring fault %r named by %s: this engine was not started with "
                           "fault injection", name, request.request_id)
            return None
        if name not in FAULTS:
            logger.warning("Ignoring unknown fault %r named by %s", name, request.request_id)
            return None
        return name

    # ---- NIXL side channel -------------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        """Each step, before vLLM frees exports that finished sending: not live now."""
        self._live.end(connector_output.finished_sending or ())
        super().update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """vLLM starts the side channel here; a failed bind fails the start."""
        super().set_xfer_handshake_metadata(metadata)
        failure = listener_failures.pop(self.side_channel_port, None)
        if failure is not None:
            self._nixl_handshake_listener_t = None
            raise RuntimeError(
                f"the NIXL side channel cannot listen on {self.side_channel_host}:"
                f"{self.side_channel_port} ({failure}); start the engine with another "
                "side-channel port") from failure


    def on_new_request(self, request: Request) -> None:
        """Each request as it arrives (before scheduling): its kind, and the releases
        and stops it asks for."""
        self._kinds.of(request)
        params = request.kv_transfer_params or {}
        if params.get(RELEASE_KEY):
            self._release_holds([str(r) for r in params[RELEASE_KEY]])
        if params.get(RELEASE_PREFIX_KEY):
            prefixes = tuple(str(p) for p in params[RELEASE_PREFIX_KEY])
            self._release_holds([name for name in self._fork.held_names()
                                 if name.startswith(prefixes)])
        if params.get(STOP_KEY):
            target = str(params.get(RETARGET_KEY) or "")
            self._stops.update((str(r), target) for r in params[STOP_KEY])
        super().on_new_request(request)

    def take_stops(self) -> dict[str, str]:
        """P's scheduler (``prefill_engine.scheduler``), each step: the requests to stop
        after their next token, asked for since the last step, each with the engine id
        to address its handoff to ("": the one it named)."""
        stops, self._stops = self._stops, {}
        return stops

    def _release_holds(self, names: list[str]) -> None:
        """End holds early (the engine's Release): parents held here are released with
        the beam fork's releases; exported ones go to the worker (``StepOrders.unhold``),
        which ends their lease now."""
        for name in names:
            if not self._fork.release_held(name):
                self._unholds.append(name)
        logger.debug("Releasing held parents early: %s", names)

    def build_connector_meta(self, scheduler_output: Any) -> ContinuationMetadata:
        """Once per scheduler step: the stock metadata (READs to post, exports to
        hold) plus this step's orders (``connector.step_orders``): beam-fork copies and
        releases, compositions' copies, holds and, with fault injection, the faults the
        worker applies. The lists handed over are owned by the worker from here."""
        self._pace_idle_step(scheduler_output)
        meta = super().build_connector_meta(scheduler_output)
        fork_copies, fork_release = self._fork.take_orders()
        faults = {r: f for r, f in self._import_faults.items() if r in meta.reqs_to_recv}
        for req_id in faults:
            del self._import_faults[req_id]
        orders = StepOrders(fork_copies=fork_copies, fork_release=fork_release,
                            blend=self._blend.take_copies(), faults=faults,
                            scribble=self._scribble_block_ids, hold=self._holds,
                            unhold=self._unholds)
        self._scribble_block_ids, self._holds, self._unholds = [], [], []
        return ContinuationMetadata(meta, orders)

    def _pace_idle_step(self, scheduler_output: Any) -> None:
        """A step that computes tokens or posts READs is busy (``IdlePacer``)."""
        self._idle.pace(scheduler_output.total_num_scheduled_tokens > 0
                        or bool(self._reqs_need_recv))

    # ---- D side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Before a waiting request is scheduled: how many prompt tokens past
        ``num_computed_tokens`` (local prefix hits) come from outside, and whether they
        arrive asynchronously (None: not yet, a beam step's siblings are on their way).
        D imports ``min(remote_num_tokens, len(prompt) - 1)``: the last prompt token is
        computed here to sample from it, the suffix never was on P. A beam child counts
        the tokens it copies from its kept source (synchronous)."""
        params = request.kv_transfer_params
        beam = beam_params(request)
        kind = self._kinds.of(request)
        if beam and beam.get(WAIT_KEY):
            return None, False  # a beam slot whose group has not started: asked again
        if kind is RequestKind.FORK_CHILD:
            return self._fork.match(request, beam, num_computed_tokens), False
        if kind is RequestKind.BLEND:
            # An approximate composition (connector.blend): loaded in this step.
            count = self._blend.match(request, params[BLEND_KEY], num_computed_tokens)
            if params.get("do_remote_decode"):
                self._arrange_run(request, num_computed_tokens,
                                  request.num_prompt_tokens + (request.max_tokens or 0))
            return count, False
        if kind is RequestKind.MOVED and params.get("_remote_blocks_processed"):
            # A moved stage 1 whose import was queued (it may be scheduled again after a
            # preemption): the stock P path would pull its "remote" blocks once more.
            return 0, False
        if not (params and params.get("do_remote_prefill")):
            matched = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if params and params.get("do_remote_decode") and matched == (0, False):
                # A stage 1 (it will be exported): its prompt and output in one run.
                self._arrange_run(request, num_computed_tokens,
                                  request.num_prompt_tokens + (request.max_tokens or 0))
            return matched
        num_importable = min(
            params.get("remote_num_tokens") or 0, request.num_prompt_tokens - 1
        )
        fault = self._fault(request)
        if fault is not None:
            faulted = num_imported_with_fault(
                fault, num_importable, request.num_prompt_tokens, self.block_size)
            if faulted != num_importable:
                self._miscounted.add(request.request_id)
            num_importable = faulted
        count = num_importable - num_computed_tokens
        if count > 0:
            self._arrange_run(request, num_computed_tokens, num_importable,
                              gap=fault == MERGE_LONG)
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        """After vLLM allocated ``blocks`` for a request with
        ``num_external_tokens`` to load: the blocks are the request's from here; the
        READ (or the beam-fork copy) into them is queued for the next step."""
        params = request.kv_transfer_params
        kind = self._kinds.of(request)
        if kind is RequestKind.FORK_CHILD:
            self._fork.scheduled(request, beam_params(request), blocks, num_external_tokens)
        elif kind is RequestKind.BLEND:
            self._blend.scheduled(request, blocks.get_block_ids()[0], num_external_tokens,
                                  rotate=self._fault(request) != UNROTATED_FAULT)
        if params and params.get("do_remote_prefill") and num_external_tokens > 0:
            local_block_ids = blocks.get_unhashed_block_ids_all_groups()
            self._imports[request.request_id] = _ImportRecord(
                num_tokens=num_external_tokens,
                num_blocks=len(local_block_ids[0]) if local_block_ids else 0,
            )
            fault = self._fault(request)
            if fault is not None and FAULTS[fault].side == "decode_worker":
                self._import_faults[request.request_id] = fault
            if request.request_id in self._miscounted:
                self._miscounted.discard(request.request_id)
                self.stats.record_fault()
        importing = bool(params and params.get("do_remote_prefill"))
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if importing and kind is RequestKind.MOVED:
            # The READ is queued (do_remote_prefill is now False): from here the request
            # is an exporting one, whose blocks are kept under a lease when it ends.
            params["do_remote_decode"] = True

    # ---- both sides --------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """When a request finishes, with its ``block_ids``. Returns (delay the free,
        params for the client). True means the connector owns the blocks until the
        worker reports them done: P holding an export until D has read it (or the lease
        ends), or a kept beam step until its children have copied from it. D attaches
        what it imported to the final output."""
        record = self._imports.pop(request.request_id, None)
        self._miscounted.discard(request.request_id)
        delay_free, params = super().request_finished(request, block_ids)
        exporting = delay_free and params is not None and bool(params.get("do_remote_prefill"))
        if exporting:
            if (request.kv_transfer_params or {}).get(EXPORT_TOKENS_KEY) is not None:
                # A search stopped to move exports from its last step on: the worker
                # registers its lease only for requests it saw in a batch as exports.
                self._reqs_in_batch.add(request.request_id)
            self._attach_handoff(request, params)
        blended = self._blend.finished(request)
        if blended is not None:
            params = blended.attach(params)
        if record is not None:
            # What this request imported (the client sees it on the final
            # RequestOutput.kv_transfer_params), beside the new handoff on an engine
            # that exports again (a moved stage 1).
            params = ImportReport(
                num_imported_tokens=record.num_tokens,
                num_imported_blocks=record.num_blocks,
                num_imported_bytes=record.num_blocks * self.kv_bytes_per_block,
                # D admitted the import only without beam fork (its pool is short).
                beam_fork_disabled=bool((beam_params(request) or {}).get("fork_disabled")),
            ).attach(params, exporting)
        self._fork.forget(request.request_id)
        self._kinds.forget(request.request_id)
        beam = beam_params(request)
        if beam and not delay_free and self._fork.keep(request, beam, block_ids):
            if self._fault(request) == "stale":  # a held parent or chunk overwritten
                self._scribble_block_ids.extend(block_ids[0])
            if beam.get("hold_s"):
                # A parent held here: the client learns until when (Unix time).
                params = HoldReport(time.time() + float(beam["hold_s"])).attach(params)
            return True, params
        return delay_free, params

    def _attach_handoff(self, request: Request, params: dict[str, Any]) -> None:
        """P side (or D's search stopped to move): describe the held blocks as a typed,
        versioned handoff (``connector.exports``)."""
        now = time.time()
        lease_s = float(self._kv_lease_duration)
        hold = (request.kv_transfer_params or {}).get(HOLD_KEY)
        if not isinstance(hold, bool) and isinstance(hold, int | float) and hold > 0:
            # A parent held for a shorter time than P's lease (the router's
            # --parent-hold-s): its blocks come back sooner.
            lease_s = min(lease_s, float(hold))
            self._reqs_need_send[request.request_id] = time.perf_counter() + lease_s
        # Stock NIXL stamps the deadline in this process's perf_counter; D's worker
        # rebases it with the clock offset measured at the handshake.
        params["remote_blocks_expiry_time"] = self._reqs_need_send[request.request_id]
        adapter = adapter_of(request)
        handoff = describe_export(
            request, params, block_size=self.block_size, exported_at=now,
            lease_expires_at=now + lease_s, fields=dict(
                protocol_version=PROTOCOL_VERSION, model_fingerprint=self.model_fingerprint,
                engine_id=self.engine_id, kv_bytes_per_block=self.kv_bytes_per_block,
                adapter=adapter, adapter_digest=self._adapter_digests.get(adapter, ""),
                num_pool_blocks=self._kv_cache_config.num_blocks))
        num_parent_tokens = handoff.num_parent_tokens
        self._live.add(request.request_id, params["remote_block_ids"])
        target = str((request.kv_transfer_params or {}).get(TARGET_KEY) or "")
        params[KEY] = {**handoff.to_dict(), "target_engine_id": target}
        if self._secret is not None:
            params[KEY]["signature"] = sign(params, self._secret)
        if self._fault(request) == "stale":
            self._scribble_block_ids.extend(params["remote_block_ids"][0])
        if (request.kv_transfer_params or {}).get(HOLD_KEY):
            self._holds.append(request.request_id)
        logger.debug(
            "Exported %s: %d parent tokens, %d blocks, lease %.1fs",
            request.request_id,
            num_parent_tokens,
            len(params["remote_block_ids"][0]),
            lease_s,
        )

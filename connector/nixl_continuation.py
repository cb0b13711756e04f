"""ContinuationConnector: vLLM's NIXL pull connector plus continuation semantics.

Loaded by vLLM through ``kv_connector_module_path="connector.nixl_continuation"``; it runs
inside each engine-core process (scheduler side) and each worker (worker side).

P side: a request sent with ``{"do_remote_decode": True}`` that ends by stop token, EOS or
length keeps its blocks (stock behaviour) and its returned params gain a typed
:class:`~connector.handoff.Handoff` under ``kvhandoff``: token count, token digest, lease.

D side: the stock connector claims the whole prompt as remote; a continuation prompt
(parent + suffix) would then import KV that P never computed. We import exactly
``min(remote_num_tokens, len(prompt) - 1)`` tokens. Reads are refused once the lease is
(nearly) over, and a READ that completes after the lease ended is discarded as a load
failure: the freed blocks may already hold another request's KV.

Split by job: beam fork (``connector.beam_fork``), the runtime adjustments to NIXL and
vLLM (``connector.runtime``), stats (``connector.stats``) and the harness's injected faults
(``connector.faults``, inert unless switched on).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from connector.beam_fork import BeamForkScheduler, BeamForkWorker, beam_params
from connector.faults import (
    FAULTS,
    corrupt_imported,
    fault_of,
    num_imported_with_fault,
    scribble,
)
from connector.handoff import (
    DEFAULT_LEASE_SAFETY_MARGIN_S,
    KEY,
    PROTOCOL_VERSION,
    Handoff,
    token_digest,
)
from connector.logs import use_vllm_handlers
from connector.runtime import (
    bound_shm_reader_waits,
    guarded_handshake_listener,
    listener_failures,
    nixl_agent_options,
)
from connector.signing import TARGET_KEY, load_secret, sign
from connector.stats import ContinuationStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
use_vllm_handlers("connector", "decode_engine")

#: A READ slower than this is logged as a warning (loopback READs take milliseconds).
SLOW_READ_S = 1.0

def kv_bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one logical block holds across all layers (K and V)."""
    return sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names)
        for g in kv_cache_config.kv_cache_groups
    )


@dataclass(slots=True)
class _ImportRecord:
    num_tokens: int
    num_blocks: int


class ContinuationConnectorScheduler(BeamForkScheduler, NixlPullConnectorScheduler):
    """Scheduler side: export a typed handoff on P, import a continuation on D."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        from kvhandoff.model import model_fingerprint

        self.model_fingerprint = model_fingerprint(vllm_config.model_config.model)
        self.kv_bytes_per_block = kv_bytes_per_block(kv_cache_config)
        self._imports: dict[str, _ImportRecord] = {}
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        self._init_beam_fork(extra, len(kv_cache_config.kv_cache_groups))
        self.stats = ContinuationStats()
        self._secret = load_secret(extra.get_from_extra_config("handoff_secret_file", None))
        # Negative controls (connector.faults): off unless the engine was started so.
        self._fault_injection = bool(extra.get_from_extra_config("fault_injection", False))
        self._import_faults: dict[str, str] = {}  # D: request id -> decode-worker fault
        self._scribble_block_ids: list[int] = []  # P: exported blocks to overwrite

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
    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        """Engine start-up, once: vLLM starts the side-channel listener here; a
        listener that could not bind fails the start with the reason."""
        super().set_xfer_handshake_metadata(metadata)
        failure = listener_failures.pop(self.side_channel_port, None)
        if failure is not None:
            self._nixl_handshake_listener_t = None
            raise RuntimeError(
                f"the NIXL side channel cannot listen on {self.side_channel_host}:"
                f"{self.side_channel_port} ({failure}); start the engine with another "
                "side-channel port") from failure

    #: vLLM starts this as its side-channel thread; ours reports a failed bind.
    _nixl_handshake_listener = staticmethod(guarded_handshake_listener)

    def on_new_request(self, request: Request) -> None:
        """Each request as it arrives (before scheduling): a beam step may release
        kept requests that got no children."""
        self._fork_on_new_request(beam_params(request))
        super().on_new_request(request)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """Once per scheduler step: the stock metadata (READs to post, exports to
        hold) plus beam-fork copies and releases and, with fault injection, the faults
        the worker applies. The lists handed over are owned by the worker from here."""
        meta = super().build_connector_meta(scheduler_output)
        self._attach_fork_meta(meta)
        meta.kvhandoff_faults = {r: f for r, f in self._import_faults.items()
                                 if r in meta.reqs_to_recv}
        for req_id in meta.kvhandoff_faults:
            del self._import_faults[req_id]
        meta.kvhandoff_scribble = self._scribble_block_ids
        self._scribble_block_ids = []
        return meta

    # ---- D side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Before a waiting request is scheduled: how many prompt tokens past
        ``num_computed_tokens`` (local prefix hits) come from outside, and whether they
        arrive asynchronously. D imports ``min(remote_num_tokens, len(prompt) - 1)``: the
        last prompt token is computed here to sample from it, the suffix never was on
        P. A beam child counts the tokens it copies from its kept source (synchronous)."""
        params = request.kv_transfer_params
        beam = beam_params(request)
        if self._is_fork_child(beam):
            return self._fork_match(request, beam, num_computed_tokens), False
        if not (params and params.get("do_remote_prefill")):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        num_importable = min(
            params.get("remote_num_tokens") or 0, request.num_prompt_tokens - 1
        )
        fault = self._fault(request)
        if fault is not None:
            num_importable = num_imported_with_fault(
                fault, num_importable, request.num_prompt_tokens, self.block_size)
        count = num_importable - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        """After vLLM allocated ``blocks`` for a request with
        ``num_external_tokens`` to load: the blocks are the request's from here; the
        READ (or the beam-fork copy) into them is queued for the next step."""
        params = request.kv_transfer_params
        beam = beam_params(request)
        if self._is_fork_child(beam):
            self._fork_scheduled(request, beam, blocks, num_external_tokens)
        if params and params.get("do_remote_prefill") and num_external_tokens > 0:
            local_block_ids = blocks.get_unhashed_block_ids_all_groups()
            self._imports[request.request_id] = _ImportRecord(
                num_tokens=num_external_tokens,
                num_blocks=len(local_block_ids[0]) if local_block_ids else 0,
            )
            fault = self._fault(request)
            if fault is not None and FAULTS[fault].side == "decode_worker":
                self._import_faults[request.request_id] = fault
        super().update_state_after_alloc(request, blocks, num_external_tokens)

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
        delay_free, params = super().request_finished(request, block_ids)
        if record is not None:
            # D side: report what this request imported (the client sees it on the
            # final RequestOutput.kv_transfer_params).
            params = dict(params or {})
            params[KEY] = {
                "num_imported_tokens": record.num_tokens,
                "num_imported_blocks": record.num_blocks,
                "num_imported_bytes": record.num_blocks * self.kv_bytes_per_block,
                # D admitted the import only without beam fork (its pool is short).
                "beam_fork_disabled": bool((beam_params(request) or {}).get("fork_disabled")),
            }
        elif delay_free and params is not None and params.get("do_remote_prefill"):
            self._attach_handoff(request, params)
        self._fork_pending.pop(request.request_id, None)
        beam = beam_params(request)
        if beam and not delay_free and self._keep(request, beam, block_ids):
            return True, params
        return delay_free, params

    def _attach_handoff(self, request: Request, params: dict[str, Any]) -> None:
        """P side: describe the held blocks as a typed, versioned handoff."""
        num_parent_tokens = request.num_tokens
        assert request.num_computed_tokens == num_parent_tokens - 1, (
            f"P exported {request.num_computed_tokens} computed tokens for a "
            f"{num_parent_tokens}-token parent: the lease would cover the wrong KV"
        )
        now = time.time()
        # Stock NIXL stamps the deadline in this process's perf_counter; D's worker
        # rebases it with the clock offset measured at the handshake.
        params["remote_blocks_expiry_time"] = self._reqs_need_send[request.request_id]
        handoff = Handoff(
            protocol_version=PROTOCOL_VERSION,
            model_fingerprint=self.model_fingerprint,
            engine_id=self.engine_id,
            request_id=request.request_id,
            num_parent_tokens=num_parent_tokens,
            num_computed_tokens=request.num_computed_tokens,
            token_digest=token_digest(request.all_token_ids),
            block_size=self.block_size,
            num_blocks=len(params["remote_block_ids"][0]),
            kv_bytes_per_block=self.kv_bytes_per_block,
            exported_at=now,
            lease_expires_at=now + self._kv_lease_duration,
        )
        target = str((request.kv_transfer_params or {}).get(TARGET_KEY) or "")
        params[KEY] = {**handoff.to_dict(), "target_engine_id": target}
        if self._secret is not None:
            params[KEY]["signature"] = sign(params, self._secret)
        if self._fault(request) == "stale":
            self._scribble_block_ids.extend(params["remote_block_ids"][0])
        logger.debug(
            "Exported %s: %d parent tokens, %d blocks, lease %ds",
            request.request_id,
            num_parent_tokens,
            len(params["remote_block_ids"][0]),
            self._kv_lease_duration,
        )


class ContinuationConnectorWorker(BeamForkWorker, NixlPullConnectorWorker):
    """Worker side: stock READs, fenced by the lease."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ):
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        with nixl_agent_options(
            progress_thread=bool(extra.get_from_extra_config("nixl_progress_thread", True)),
            progress_delay_us=int(
                extra.get_from_extra_config("nixl_progress_delay_us", 500)
            ),
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._lease_margin_s = float(
            extra.get_from_extra_config(
                "lease_safety_margin_s", DEFAULT_LEASE_SAFETY_MARGIN_S
            )
        )
        # req_id -> (local perf_counter time by which the READ must have completed,
        # when it was issued).
        self._read_deadlines: dict[str, tuple[float, float]] = {}
        # Same stats as NIXL's, with keys that aggregate with the scheduler side's.
        self.xfer_stats = ContinuationStats()
        self._init_beam_fork(extra, kv_cache_config.num_blocks)
        self._fault_injection = bool(extra.get_from_extra_config("fault_injection", False))
        self._import_faults: dict[str, str] = {}  # request id -> fault, until its READ is done

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if self._fork_enabled or self._fault_injection:
            self._register_kv_views(
                kv_caches, int(getattr(self, "_physical_blocks_per_logical_kv_block", 1)))

    def start_load_kv(self, metadata: Any) -> None:
        """Each step, before the forward pass: beam-fork copies, releases and injected
        faults from the scheduler, then the stock READs (posted, not awaited)."""
        self._fork_on_step(metadata)
        if self._fault_injection:
            self._import_faults.update(getattr(metadata, "kvhandoff_faults", None) or {})
            stale = getattr(metadata, "kvhandoff_scribble", None)
            if stale:
                logger.warning("Injected fault 'stale': overwriting %d exported blocks",
                               len(stale))
                scribble(self._kv_views, stale, self._kernel_blocks_per_block)
        super().start_load_kv(metadata)

    def get_transfer_results(self) -> Any:
        """Each step, after the forward pass: READs done (and failed), exports read, and
        the kept beam steps released (reported as sent, so the scheduler frees them)."""
        return self._report_fork_releases(super().get_transfer_results())

    def _inject_import_faults(self, done: set[str]) -> None:
        for req_id in done:
            fault = self._import_faults.pop(req_id, None)
            meta = self._recving_metadata.get(req_id)
            if fault is None or meta is None:
                continue
            logger.warning("Injected fault %r into %s's imported blocks", fault, req_id)
            corrupt_imported(fault, self._kv_views, list(meta.local_block_ids[0]),
                             self._kernel_blocks_per_block)

    def _local_deadline(self, meta: Any) -> float | None:
        remote = meta.remote
        offset = self._engine_clock_offset.get(remote.engine_id)
        if remote.blocks_expiry_time is None or offset is None:
            return None
        return remote.blocks_expiry_time - offset

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """Post one request's READ from P, unless P's lease (on P's clock, rebased at
        the handshake) ends within ``lease_safety_margin_s``: then it fails as expired."""
        assert meta.remote is not None
        deadline = None
        if meta.remote.engine_id in self._remote_agents:
            deadline = self._local_deadline(meta)
        if deadline is not None and any(meta.local_block_ids):
            remaining = deadline - time.perf_counter()
            if remaining < self._lease_margin_s:
                logger.warning(
                    "Refusing READ for %s: P's lease on its blocks ends in %.2fs "
                    "(margin %.2fs); its blocks may be reused",
                    req_id,
                    remaining,
                    self._lease_margin_s,
                )
                self.xfer_stats.record_kv_expired_req()
                self._handle_failed_transfer(
                    req_id, None, self._recv_failures, record_failed_transfer=False
                )
                return
            self._read_deadlines[req_id] = (deadline, time.perf_counter())
            logger.debug("READ for %s: %d blocks, P's lease ends in %.2fs", req_id,
                         len(meta.local_block_ids[0]), remaining)
        posted_at = time.perf_counter()
        super()._read_blocks_for_req(req_id, meta)
        posting = time.perf_counter() - posted_at
        if posting >= SLOW_READ_S:
            # The worker (and so the engine's step) was blocked in NIXL for that long.
            logger.warning("Posting the READ for %s took %.2fs (NIXL's transfer() blocked "
                           "this worker)", req_id, posting)

    def _pop_done_transfers(
        self, transfers: dict[str, list[int]]
    ) -> tuple[set[str], set[str]]:
        """READs that completed, and those that failed; a READ that completed after
        P's lease ended is failed too (the blocks may hold another request's KV)."""
        done, failed = super()._pop_done_transfers(transfers)
        if self._import_faults:
            self._inject_import_faults(done - failed)
        now = time.perf_counter()
        for req_id in done:
            fence = self._read_deadlines.pop(req_id, None)
            if fence is None:
                continue
            deadline, issued_at = fence
            took = now - issued_at
            if took >= SLOW_READ_S:
                logger.warning("READ for %s took %.2fs (P's lease ended %.2fs after it was "
                               "issued)", req_id, took, deadline - issued_at)
            else:
                logger.debug("READ for %s done in %.3fs", req_id, took)
            if now >= deadline and req_id not in failed:
                # P may have freed and reused the blocks while we read them.
                logger.error(
                    "Discarding READ for %s: it completed %.3fs after P's lease ended "
                    "(issued %.3fs before the lease end, took %.3fs)",
                    req_id,
                    now - deadline,
                    deadline - issued_at,
                    now - issued_at,
                )
                self.xfer_stats.record_kv_expired_req()
                failed.add(req_id)
        return done, failed


class ContinuationConnector(NixlPullConnector):
    """The connector class vLLM instantiates (see module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        # Skip NixlPullConnector.__init__ (it builds the stock halves), keep the base.
        super(NixlPullConnector, self).__init__(vllm_config, role, kv_cache_config)
        # Built in the engine core (scheduler role) and in each worker: both read.
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        bound_shm_reader_waits(int(extra.get_from_extra_config("shm_reader_recheck_ms", 20)))
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ContinuationConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ContinuationConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )

    def get_kv_connector_stats(self) -> ContinuationStats | None:
        scheduler = self.connector_scheduler
        if isinstance(scheduler, ContinuationConnectorScheduler):
            stats = scheduler.stats
            return None if stats.is_empty() else stats.clone_and_reset()
        return super().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ContinuationStats:
        return ContinuationStats(data=data) if data is not None else ContinuationStats()

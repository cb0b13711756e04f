"""The connector's worker side, in each engine worker process: NIXL READs whose
descriptors are merged over runs of blocks (``connector.runs``; vLLM's own per-block
descriptors where a READ is outside what the merge covers), fenced by P's lease
(refused when the lease ends within ``lease_safety_margin_s``, discarded when they
complete after it), plus beam-fork copies and, with fault injection, the harness's
faults."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from connector.beam_fork import BeamForkWorker
from connector.faults import corrupt_imported, scribble
from connector.handoff import DEFAULT_LEASE_SAFETY_MARGIN_S
from connector.runs import MERGE_FAULTS, fill_host_bytes, merge
from connector.runtime import back_with_huge_pages, nixl_agent_options
from connector.stats import ContinuationStats
from kvhandoff.ucxlog import flush_ucx_log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

#: A READ slower than this is logged as a warning (loopback READs take milliseconds).
SLOW_READ_S = 1.0


class ContinuationConnectorWorker(BeamForkWorker, NixlPullConnectorWorker):
    """Worker side: stock READs, fenced by the lease."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ):
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        with nixl_agent_options(
            progress_thread=bool(extra.get_from_extra_config("nixl_progress_thread", True)),
            progress_delay_us=int(
                extra.get_from_extra_config("nixl_progress_delay_us", 500)
            ),
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        if affinity is not None and extra.get_from_extra_config("keep_cpu_affinity", True):
            # On CPU, vLLM's NIXL worker pins this thread (which also runs the forward
            # pass) to the last core of each NUMA node, expecting OpenMP threads bound
            # to the others. Unbound (VLLM_CPU_OMP_THREADS_BIND=nobind, our default),
            # that puts every engine's forward pass and READs on one core of the host:
            # keep the cores the worker started with (docs/decisions.md, "Worker CPU
            # affinity").
            os.sched_setaffinity(0, affinity)
        self._huge_pages = bool(extra.get_from_extra_config("kv_huge_pages", True))
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
        # P: held exports (parents) -> their lease end (perf_counter, as _reqs_to_send):
        # READs do not release them, the lease end does.
        self._held: dict[str, float] = {}
        # READs with their descriptors merged over runs (connector.runs); off: vLLM's.
        self._merge_runs = bool(extra.get_from_extra_config("kv_runs", True))
        # (P's engine id, its rank) -> its descriptors as vLLM prepared them, an (n, 3)
        # array of (address, length, device), one row per block per region.
        self._remote_rows: dict[tuple[str, int], np.ndarray] = {}
        self._adding_rank = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._huge_pages:
            t0 = time.perf_counter()
            collapsed = back_with_huge_pages(list(kv_caches.values()))
            logger.info("KV pool: %.0f MiB on 2 MiB pages (%.2fs)", collapsed / 2**20,
                        time.perf_counter() - t0)
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
                self.xfer_stats.record_fault()
        super().start_load_kv(metadata)
        for req_id in getattr(metadata, "kvhandoff_hold", None) or ():
            expires = self._reqs_to_send.get(req_id)
            if expires is not None:
                self._held[req_id] = expires
        for req_id in getattr(metadata, "kvhandoff_unhold", None) or ():
            if req_id in self._held:
                self._held[req_id] = 0.0  # _reap_expired_send_leases frees it next
                logger.debug("Held parent %s released early", req_id)

    def add_remote_agent(self, nixl_agent_meta: Any, remote_tp_rank: int = 0,
                         *args: Any, **kwargs: Any) -> str:
        self._adding_rank = remote_tp_rank  # read by _build_fa_remote below
        return super().add_remote_agent(nixl_agent_meta, remote_tp_rank, *args, **kwargs)

    def _build_fa_remote(self, plan: Any, nixl_agent_meta: Any, block_size_ratio: int
                         ) -> np.ndarray:
        rows = super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        if block_size_ratio == 1:
            self._remote_rows[(nixl_agent_meta.engine_id, self._adding_rank)] = rows
        return rows

    def _can_merge(self, read_spec: Any, dst_engine_id: str, local_handle: int) -> bool:
        """Whether a READ is one the merge covers: same block size, one local handle
        over the whole pool, attention layers only, no decode context parallelism;
        anything else goes through vLLM's own descriptors."""
        assert self.transfer_topo is not None
        info = self.transfer_topo.get_engine_info(dst_engine_id)
        return (self._merge_runs
                and not read_spec.block_ids_by_region
                and not self._mixed_mem_types
                and not self._has_mamba
                and not self._transfer_layer_group_ids
                and self.dcp_size == 1 and info.remote_dcp_size == 1
                and self.transfer_topo.block_size_ratio(info.remote_block_size) == 1
                and local_handle == self.src_xfer_handles_by_block_size.get(self.block_size)
                and (dst_engine_id, read_spec.remote_rank) in self._remote_rows)

    def _read_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str,
                     remote_request_id: str, local_xfer_side_handle: int,
                     local_dram_handle: int | None, remote_xfer_side_handle: int,
                     expected_consumers: int, awaiting_kvs: bool) -> bool:
        """Post one READ from one of P's ranks. Where the merge covers it, the same
        block pairs as vLLM's (after its prefix-cache trim) in merged descriptors;
        else, and for a READ with nothing to move (a full prefix hit), vLLM's."""
        def stock() -> bool:
            return super(ContinuationConnectorWorker, self)._read_blocks(
                read_spec, dst_engine_id, request_id, remote_request_id,
                local_xfer_side_handle, local_dram_handle, remote_xfer_side_handle,
                expected_consumers, awaiting_kvs)

        if not self._can_merge(read_spec, dst_engine_id, local_xfer_side_handle):
            return stock()
        assert self.transfer_topo is not None
        info = self.transfer_topo.get_engine_info(dst_engine_id)
        local_ids, remote_ids = self._apply_prefix_caching(
            decode_block_ids=read_spec.local_block_ids,
            prefill_block_ids=read_spec.remote_block_ids,
            decode_physical_per_logical=self._physical_blocks_per_logical_kv_block,
            prefill_physical_per_logical=info.remote_physical_blocks_per_logical,
        )
        if not any(len(group) > 0 for group in local_ids):
            return stock()
        remote_rows = self._remote_rows[(dst_engine_id, read_spec.remote_rank)][
            self._compute_desc_ids(
                block_ids=remote_ids,
                dst_num_blocks=self.dst_num_blocks[dst_engine_id],
                block_size_ratio=None,
                physical_blocks_per_logical=info.remote_physical_blocks_per_logical,
                region_num_blocks=self.dst_region_num_blocks.get(dst_engine_id) or None,
                region_group_ids=self.dst_region_group_ids.get(dst_engine_id) or None,
                uses_region_group_mapping=self.dst_uses_region_group_mapping[dst_engine_id],
            )]
        local_rows = self.src_blocks_data[
            self._compute_desc_ids(
                block_ids=local_ids,
                dst_num_blocks=self.dst_num_blocks[self.engine_id],
                block_size_ratio=1,
                physical_blocks_per_logical=self._physical_blocks_per_logical_kv_block,
                region_num_blocks=self.dst_region_num_blocks.get(self.engine_id) or None,
                region_group_ids=self.region_group_ids or None,
                uses_region_group_mapping=self._uses_region_group_mapping,
            )]
        fault = self._import_faults.get(request_id)
        if fault in MERGE_FAULTS:
            del self._import_faults[request_id]
        else:
            fault = None
        merged = merge(local_rows, remote_rows, fault)
        if merged.took:
            logger.warning("Injected fault %r into %s's READ: %d bytes of its blocks "
                           "not read", fault, request_id, merged.unread_bytes)
            self._fill_unread(merged.unread)
            self.xfer_stats.record_fault()
        elif fault is not None:
            logger.warning("Fault %r not injected into %s: its READ has no run boundary "
                           "to merge across", fault, request_id)
        agent = self._remote_agents[dst_engine_id][(0, read_spec.remote_rank)]
        handle = None
        try:
            handle = self.nixl_wrapper.initialize_xfer(
                "READ",
                self.nixl_wrapper.get_xfer_descs(merged.local, self.region_mem_types[0]),
                self.nixl_wrapper.get_xfer_descs(
                    merged.remote, self.dst_region_mem_types[dst_engine_id][0]),
                agent,
                notif_msg=f"{remote_request_id}:{expected_consumers}".encode(),
            )
            self.nixl_wrapper.transfer(handle)
            self._recving_transfers[request_id].append(handle)
            logger.debug("READ for %s: %d descriptors for %d block pieces", request_id,
                         len(merged.local), len(local_rows))
            return True
        except Exception as e:
            self._log_failure(
                failure_type="transfer_setup_failed",
                req_id=request_id,
                msg="Deferring failure reporting until outstanding transfers finish",
                error=e,
                dst_engine_id=dst_engine_id,
                remote_rank=read_spec.remote_rank,
            )
            if not self._handle_failed_transfer(request_id, handle, self._recv_failures):
                assert handle is not None
                self._recving_transfers[request_id].append(handle)
            return False

    def _fill_unread(self, unread: list[tuple[int, int]]) -> None:
        """A merge fault's unread destination bytes get a filler: left alone they hold
        whatever the block held before, which on a block reused for the same prompt
        is the very KV the READ should have brought, and the fault would not show."""
        if self.region_mem_types[0] != "DRAM":
            logger.warning("Merge fault: unread bytes left as they were (not host memory)")
            return
        for address, length in unread:
            fill_host_bytes(address, length)

    def _get_new_notifs(self) -> set[str]:
        """Exports D has read (P frees them). A held export stays until its lease ends:
        it goes back in the list of exports to serve, with its own lease end."""
        read = super()._get_new_notifs()
        for req_id in read & self._held.keys():
            read.discard(req_id)
            self._reqs_to_send[req_id] = self._held[req_id]
            self._reqs_to_process.add(req_id)
            logger.debug("Held parent %s read; kept until its lease ends in %.1fs", req_id,
                         self._held[req_id] - time.perf_counter())
        return read

    def _reap_expired_send_leases(self, done_sending: set[str]) -> None:
        """Free exports whose lease ended. A held one ending is its normal end (not an
        expiry: it was read, or never needed)."""
        now = time.perf_counter()
        for req_id in [r for r, expires in self._held.items() if now >= expires]:
            del self._held[req_id]
            if self._reqs_to_send.pop(req_id, None) is not None:
                self._reqs_to_process.discard(req_id)
                self.consumer_notification_counts_by_req.pop(req_id, None)
                self.expected_consumer_notifications_by_req.pop(req_id, None)
                done_sending.add(req_id)
                logger.debug("Held parent %s released: its lease ended", req_id)
        super()._reap_expired_send_leases(done_sending)

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
            if fault in MERGE_FAULTS:  # its READ did not go through the merge
                logger.warning("Fault %r not injected into %s: its READ was not merged",
                               fault, req_id)
                continue
            blocks = list(meta.local_block_ids[0])
            if corrupt_imported(fault, self._kv_views, blocks, self._kernel_blocks_per_block):
                logger.warning("Injected fault %r into %s's imported blocks", fault, req_id)
                self.xfer_stats.record_fault()
            else:
                logger.warning("Fault %r not injected into %s: %d imported blocks are too "
                               "few for it", fault, req_id, len(blocks))

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

    def _cleanup_remote_engines(self) -> None:
        """Each step: a P any of whose READs failed in transport is released (its
        NIXL agent and connection dropped) once its other READs drain, and the next
        handoff from it handshakes again. vLLM does this only when the local NIXL
        metadata is gone; a UCX connection broken by an outage (a link down, a host
        gone and back: ``NIXL_ERR_REMOTE_DISCONNECT``) keeps its metadata, so every
        later READ from that P failed at once, for good. A P that keeps failing is
        released again after vLLM's backoff (1 s doubling to 60 s), its READs
        failing fast meanwhile (the router recomputes them)."""
        now = time.perf_counter()
        for engine_id in self._failed_remote_engines - self._invalid_remote_engines:
            if engine_id in self._remote_agents:
                logger.warning("A READ from %s failed: dropping its NIXL agent and "
                               "connection, the next handoff from it handshakes again",
                               engine_id)
                self._mark_remote_engine_invalid(engine_id, now)
        super()._cleanup_remote_engines()

    def _abandon_reads_past_lease(self, transfers: dict[str, list[int]], now: float) -> set[str]:
        """READs still in flight when P's lease on their blocks ended (P unreachable: a
        link down, P's host gone) fail now rather than when the transport gives up
        (minutes, over TCP): their handles are released (NIXL cancels the transfer) and
        the request is reported failed, so the router recomputes it. A handle NIXL cannot
        release yet stays, and with it the request and its blocks, which the transport
        may still write (vLLM's own rule for failed transfers)."""
        failed: set[str] = set()
        for req_id, handles in list(transfers.items()):
            fence = self._read_deadlines.get(req_id)
            if fence is None or now < fence[0]:
                continue
            deadline, issued_at = self._read_deadlines.pop(req_id)
            logger.error("Abandoning READ for %s: still in flight %.2fs after P's lease "
                         "ended (issued %.2fs before it); P unreachable?", req_id,
                         now - deadline, deadline - issued_at)
            self.xfer_stats.record_kv_expired_req()
            meta = self._recving_metadata.get(req_id)
            if meta is not None and meta.remote is not None:
                # Its connection is suspect: handshake again (_cleanup_remote_engines).
                self._failed_remote_engines.add(meta.remote.engine_id)
            kept = [h for h in handles if not self._handle_failed_transfer(
                req_id, h, failed, record_failed_transfer=False)]
            if kept:
                transfers[req_id] = kept
            else:
                del transfers[req_id]
        return failed

    def _pop_done_transfers(
        self, transfers: dict[str, list[int]]
    ) -> tuple[set[str], set[str]]:
        """READs that completed, and those that failed; a READ that completed after
        P's lease ended is failed too (the blocks may hold another request's KV), and
        one still in flight when it ended is abandoned (``_abandon_reads_past_lease``)."""
        abandoned = self._abandon_reads_past_lease(transfers, time.perf_counter())
        done, failed = super()._pop_done_transfers(transfers)
        failed |= abandoned
        if self._import_faults:
            self._inject_import_faults(done - failed)
        if done or failed:
            flush_ucx_log()  # the READ's protocol table, if UCX logs to a file
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

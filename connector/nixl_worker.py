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

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from connector.beam_fork import BeamForkWorker
from connector.blend import BlendWorker
from connector.faults import SKIP_LIVE_FAULT, corrupt_imported, scribble
from connector.handoff import DEFAULT_LEASE_SAFETY_MARGIN_S
from connector.liveness import LiveChecks
from connector.merged_reads import MergedReadWorker
from connector.runs import MERGE_FAULTS
from connector.runtime import back_with_huge_pages, nixl_agent_options
from connector.stats import ContinuationStats
from connector.step_meta import OUTBOX
from connector.step_orders import ContinuationMetadata
from kvhandoff.ucxlog import flush_ucx_log

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

#: A READ slower than this is logged as a warning (loopback READs take milliseconds).
SLOW_READ_S = 1.0


class ContinuationConnectorWorker(MergedReadWorker, NixlPullConnectorWorker):
    """Worker side: READs in merged descriptors, fenced by the lease."""

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
        self._fork = BeamForkWorker.from_config(extra, kv_cache_config.num_blocks)
        self._fault_injection = bool(extra.get_from_extra_config("fault_injection", False))
        self._import_faults: dict[str, str] = {}  # request id -> fault, until its READ is done
        # P: held exports (parents) -> their lease end (perf_counter, as _reqs_to_send):
        # READs do not release them, the lease end does.
        self._held: dict[str, float] = {}
        self._init_merged_reads(bool(extra.get_from_extra_config("kv_runs", True)))
        self._blend = BlendWorker(vllm_config, kv_cache_config)
        self._live_checks = LiveChecks()
        self._named_blocks: dict[str, list[list[int]]] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._huge_pages:
            t0 = time.perf_counter()
            collapsed = back_with_huge_pages(list(kv_caches.values()))
            logger.info("KV pool: %.0f MiB on 2 MiB pages (%.2fs)", collapsed / 2**20,
                        time.perf_counter() - t0)
        super().register_kv_caches(kv_caches)
        ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1))
        if self._fork.enabled or self._fault_injection:
            self._fork.register_kv_views(kv_caches, ratio)
        self._blend.register(kv_caches, self.block_size)  # the kernel's block size

    def start_load_kv(self, metadata: Any) -> None:
        """Each step, before the forward pass: beam-fork copies, releases, approximate
        compositions' copies (``connector.blend``) and injected faults from the
        scheduler, then the stock READs (posted, not awaited)."""
        assert isinstance(metadata, ContinuationMetadata), \
            f"the connector's worker got {type(metadata).__name__}, not its scheduler's"
        orders = metadata.orders
        OUTBOX.stopping = frozenset(orders.stop_groups)
        self._fork.on_step(orders)
        self._blend.apply(orders.blend)
        if self._fault_injection:
            self._import_faults.update(orders.faults)
            stale = orders.scribble
            if stale:
                logger.warning("Injected fault 'stale': overwriting %d exported blocks",
                               len(stale))
                scribble(self._fork.kv_views, stale, self._fork.kernel_blocks_per_block)
                self.xfer_stats.record_fault()
        super().start_load_kv(metadata)
        for req_id in orders.hold:
            expires = self._reqs_to_send.get(req_id)
            if expires is not None:
                self._held[req_id] = expires
        for req_id in orders.unhold:
            # A held parent, or an export its D refused before reading (the router's
            # Release): its lease ends now, and vLLM's reaper frees it next.
            if req_id in self._held:
                self._held[req_id] = 0.0
                logger.debug("Held parent %s released early", req_id)
            elif req_id in self._reqs_to_send:
                self._reqs_to_send[req_id] = 0.0
                logger.debug("Export %s released early (its D will not read it)", req_id)

    def _take_merge_fault(self, request_id: str) -> str | None:
        """The merge fault ``request_id`` names (``connector.runs``), taken: it acts
        once, when the READ is posted."""
        if self._import_faults.get(request_id) in MERGE_FAULTS:
            return self._import_faults.pop(request_id)
        return None

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
        results = super().get_transfer_results()
        # A READ vLLM failed without posting it (its P marked invalid) ends here, not in
        # _pop_done_transfers: its deadline goes with it.
        for req_id in getattr(results, "finished_recving", None) or ():
            self._read_deadlines.pop(req_id, None)
        return self._fork.report_releases(results)

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
            if corrupt_imported(fault, self._fork.kv_views, blocks,
                                self._fork.kernel_blocks_per_block):
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

    def _outside_remote_pool(self, meta: Any) -> int | None:
        """A block id of the READ outside P's pool as P's handshake gave it, or None."""
        pool = self.dst_num_blocks.get(meta.remote.engine_id)
        if pool is None:
            return None
        for group in meta.remote.block_ids:
            for block in group:
                if not 0 <= block < pool:
                    return block
        return None

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """Post one request's READ from P, unless P's lease (on P's clock, rebased at
        the handshake) ends within ``lease_safety_margin_s``: then it fails as expired."""
        assert meta.remote is not None
        deadline = None
        if meta.remote.engine_id in self._remote_agents:
            outside = self._outside_remote_pool(meta)
            if outside is not None:
                # The admission checked every other field; only P's handshake knows its
                # pool. vLLM would index its descriptor table with the id (IndexError in
                # the engine core) or READ memory that is not a block.
                logger.error("Refusing READ for %s: block %d is outside P %s's pool of %d "
                             "blocks", req_id, outside, meta.remote.engine_id,
                             self.dst_num_blocks[meta.remote.engine_id])
                self._handle_failed_transfer(
                    req_id, None, self._recv_failures, record_failed_transfer=False)
                return
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
        # The block ids the handoff named (vLLM turns them into kernel ids below): what
        # P confirms after the READ (connector.liveness).
        self._named_blocks[req_id] = [list(group) for group in meta.remote.block_ids]
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
        done, failed = self._confirm_live(done, failed)
        if self._import_faults:
            self._inject_import_faults(done - failed)
        return done, failed

    def _confirm_live(self, done: set[str], failed: set[str]) -> tuple[set[str], set[str]]:
        """Merged READs that completed wait for their P to confirm the export was still
        live (``connector.liveness``): reported done once it does (and P told it may
        free a read export, the notification the READ did not carry), failed if it does
        not. A READ vLLM posted itself carried its notification: P may already have
        freed the export for it, so it is not asked (the lease fence only)."""
        for req_id in [r for r in self.deferred_notifs
                       if r in failed or r not in self._recving_metadata]:
            del self.deferred_notifs[req_id]  # failed or gone: P frees at the lease end
        for req_id in [r for r in self._named_blocks if r not in self._recving_metadata]:
            del self._named_blocks[req_id]
        for req_id in done - failed:
            notifs = self.deferred_notifs.get(req_id)
            meta = self._recving_metadata.get(req_id)
            if notifs is None or meta is None or meta.remote is None:
                continue
            if self._import_faults.get(req_id) == SKIP_LIVE_FAULT:
                del self._import_faults[req_id]  # the negative control: not asked
                self.xfer_stats.record_fault()
                self._send_deferred_notifs(req_id)
                continue
            self._live_checks.ask(req_id, meta.remote.host, meta.remote.port,
                                  meta.remote.request_id, self._named_blocks.pop(req_id, []))
            done.discard(req_id)
        confirmed, refused = self._live_checks.settle()
        for req_id in confirmed:
            self._send_deferred_notifs(req_id)
        for req_id, why in refused.items():
            self.deferred_notifs.pop(req_id, None)
            logger.error("Discarding READ for %s: %s", req_id, why)
            self.xfer_stats.record_kv_expired_req()
        return done | confirmed | refused.keys(), failed | refused.keys()

    def _send_deferred_notifs(self, req_id: str) -> None:
        for agent, message in self.deferred_notifs.pop(req_id, ()):
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=message)
            except Exception as e:  # P gone: it frees the export when its lease ends
                logger.warning("Could not tell P that %s's READ is done (%s)", req_id, e)

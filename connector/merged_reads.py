"""The worker side of ``connector.runs``: a READ posted in merged descriptors.

A base of the connector's worker (``connector.nixl_worker``), beside vLLM's pull worker:
it overrides ``_read_blocks`` (one READ from one of P's ranks) and keeps P's descriptor
rows from the handshake (``_build_fa_remote``). The block pairs are vLLM's (after its
prefix-cache trim), the rows vLLM's own; only their grouping into descriptors changes
(``connector.runs.merge``), and NIXL's ``initialize_xfer`` takes the merged lists. A READ
the merge does not cover goes through vLLM's prepared descriptors unchanged.

The worker provides ``_take_merge_fault(request_id)`` (the harness's merge faults, or
None) and ``xfer_stats.record_fault()``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)

from connector.runs import fill_host_bytes, merge

logger = logging.getLogger(__name__)


class MergedReadWorker(NixlPullConnectorWorker):
    """vLLM's pull worker, its READs posted in descriptors merged over runs."""

    def _init_merged_reads(self, enabled: bool) -> None:
        """Called once from the worker's constructor; ``enabled`` False keeps vLLM's
        descriptors (the engine setting ``kv_runs``)."""
        self._merge_runs = enabled
        # (P's engine id, its rank) -> its descriptors as vLLM prepared them, an (n, 3)
        # array of (address, length, device), one row per block per region.
        self._remote_rows: dict[tuple[str, int], np.ndarray] = {}
        self._adding_rank = 0
        # Request id -> the notifications its merged READs owe P ((P's agent, message)),
        # sent by the worker once P confirms the export was live (connector.liveness):
        # P frees a read export on that notification, so it must not come with the READ.
        self.deferred_notifs: dict[str, list[tuple[str, bytes]]] = {}

    def _take_merge_fault(self, request_id: str) -> str | None:
        return None

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
            return super(MergedReadWorker, self)._read_blocks(
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
        fault = self._take_merge_fault(request_id)
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
            )
            self.nixl_wrapper.transfer(handle)
            self._recving_transfers[request_id].append(handle)
            self.deferred_notifs.setdefault(request_id, []).append(
                (agent, f"{remote_request_id}:{expected_consumers}".encode()))
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


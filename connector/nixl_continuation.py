"""ContinuationConnector: vLLM's NIXL pull connector plus continuation semantics.

Loaded by vLLM through ``kv_connector_module_path="connector.nixl_continuation"``; it runs
inside each engine-core process (scheduler side) and each worker (worker side).

P side: a request sent with ``{"do_remote_decode": True}`` that ends by stop token, EOS or
length keeps its blocks (stock behaviour) and its returned params gain a typed
:class:`~connector.handoff.Handoff` under ``kvhandoff``: token count, token digest, lease.

D side: the stock connector claims the whole prompt as remote; a continuation prompt
(parent + suffix) would then import KV that P never computed. We import exactly
``min(remote_num_tokens, len(prompt) - 1)`` tokens. P imports the same way when a
running stage 1 moves to it from another P (``REEXPORT_KEY``), and exports again at
the end: once its READ is queued the request becomes an exporting one
(``do_remote_decode``), which vLLM's pull connector treats as any P's. Reads are refused
once the lease is (nearly) over, and a READ that completes after the lease ended is
discarded as a load failure: the freed blocks may already hold another request's KV.

This module is the class vLLM instantiates; the scheduler side (in the engine-core
process) is ``connector.nixl_scheduler``, the worker side ``connector.nixl_worker``. Split by job: beam fork
(``connector.beam_fork``), the runtime adjustments to NIXL and
vLLM (``connector.runtime``), stats (``connector.stats``) and the harness's injected faults
(``connector.faults``, inert unless switched on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
)

from connector.nixl_scheduler import ContinuationConnectorScheduler
from connector.nixl_worker import ContinuationConnectorWorker
from connector.runs import kv_layout
from connector.runtime import bound_shm_reader_waits
from connector.stats import ContinuationStats
from connector.step_meta import OUTBOX

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import KVCacheConfig


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
        busy_loop_ms = extra.get_from_extra_config("shm_busy_loop_ms", 0.5)
        bound_shm_reader_waits(int(extra.get_from_extra_config("shm_reader_recheck_ms", 10)),
                               None if busy_loop_ms is None else float(busy_loop_ms))
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ContinuationConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ContinuationConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The KV layout this connector asks vLLM for: ``connector.runs.kv_layout``,
        else vLLM's NIXL choice."""
        return kv_layout(vllm_config) or super().get_required_kvcache_layout(vllm_config)

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        """vLLM's scheduler hands over its block pool (any device, despite the name)."""
        super().bind_gpu_block_pool(gpu_block_pool)
        if isinstance(self.connector_scheduler, ContinuationConnectorScheduler):
            self.connector_scheduler.use_block_pool(gpu_block_pool)

    def build_connector_worker_meta(self) -> Any:
        """The step's metadata (``connector.step_meta``: the beam groups', filled by the
        logits processor during this step's sampling); None while no group runs."""
        return OUTBOX.open_step()

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

"""What an engine reports: its KV pool as of the last step (:class:`PoolSnapshot`) and
cumulative counters from vLLM's stat loggers and the connector (:class:`EngineCounters`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from connector.params import FAULTS_KEY, FORK_TOKENS_KEY, RUNS_KEY, RUNS_OUT_OF_ORDER_KEY


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """KV pool state as of the engine's last step (current while it is idle)."""

    num_total_blocks: int
    num_used_blocks: int
    num_running_reqs: int
    num_waiting_reqs: int
    block_size: int

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - self.num_used_blocks

    @property
    def is_clean(self) -> bool:
        """No block held by a request or an export; cached blocks count as free."""
        return self.num_used_blocks == 0 and not self.num_running_reqs and not self.num_waiting_reqs


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One NIXL READ as NIXL's telemetry reports it."""

    seconds: float
    num_bytes: int
    num_descriptors: int
    post_seconds: float


@dataclass(frozen=True, slots=True)
class IterationRecord:
    """One engine step as vLLM's iteration stats report it: ``inter_token_s`` holds, for
    every request that decoded a (non-first) token in the step, the time since its
    previous token: with all of a batch decoding, the step's duration."""

    index: int
    num_generation_tokens: int
    inter_token_s: tuple[float, ...]


@dataclass
class EngineCounters:
    """Cumulative counters from vLLM's stat loggers (prompt tokens by source, and the NIXL
    connector's transfer stats), for metrics and benchmarks."""

    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_transferred: int = 0
    #: Prompt tokens beam steps copied from a kept beam on this engine (vLLM counts them
    #: with the transferred ones; they are subtracted from prompt_tokens_transferred).
    beam_fork_tokens: int = 0
    _fork_tokens_unmatched: int = 0
    generation_tokens: int = 0
    transfers: int = 0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    failed_transfers: int = 0
    failed_notifications: int = 0
    failed_handshakes: int = 0
    expired_leases: int = 0
    #: Injected faults that took effect on this engine (``connector.faults``).
    faults_injected: int = 0
    #: Allocations this engine made in runs (``connector.runs``), and the cached blocks
    #: they evicted out of the LRU order (each before an older cached block).
    runs_arranged: int = 0
    runs_out_of_lru_order: int = 0
    #: vLLM's prefix-cache stats: prompt tokens looked up in this engine's cache and
    #: tokens found there (hit rate = hits / queries).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: Iterations (engine output batches) reported so far, and the latest (newest last).
    iterations: int = 0
    recent_iterations: deque[IterationRecord] = field(default_factory=lambda: deque(maxlen=4096))
    #: Descriptors NIXL posted for the READs (after its own merging of adjacent ones).
    transfer_descriptors: int = 0
    #: The latest transfers, newest last.
    recent_transfers: deque[TransferRecord] = field(default_factory=lambda: deque(maxlen=256))

    def add_connector_stats(self, data: dict[str, list]) -> None:
        durations = data.get("transfer_duration", [])
        sizes = data.get("bytes_transferred", [])
        self.transfers += len(durations)
        self.transfer_s += float(sum(durations))
        self.transfer_bytes += int(sum(sizes))
        descriptors = data.get("num_descriptors", [])
        posts = data.get("post_duration", [])
        self.transfer_descriptors += int(sum(descriptors))
        self.recent_transfers.extend(
            TransferRecord(float(s), int(b), int(n), float(p))
            for s, b, n, p in zip(durations, sizes, descriptors, posts))
        self.failed_transfers += len(data.get("num_failed_transfers", []))
        self.failed_notifications += len(data.get("num_failed_notifications", []))
        self.failed_handshakes += len(data.get("num_failed_handshakes", []))
        self.expired_leases += len(data.get("num_kv_expired_reqs", []))
        self.faults_injected += len(data.get(FAULTS_KEY, []))
        self.runs_arranged += len(data.get(RUNS_KEY, []))
        self.runs_out_of_lru_order += int(sum(data.get(RUNS_OUT_OF_ORDER_KEY, [])))
        fork = int(sum(data.get(FORK_TOKENS_KEY, [])))
        self.beam_fork_tokens += fork
        self._fork_tokens_unmatched += fork

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def add_iteration(self, iteration_stats: Any) -> None:
        self.iterations += 1
        self.recent_iterations.append(IterationRecord(
            self.iterations, int(iteration_stats.num_generation_tokens),
            tuple(iteration_stats.inter_token_latencies_iter)))

    def add_external_tokens(self, num_tokens: int) -> None:
        """vLLM's external (KV connector) prompt tokens, minus the beam fork copies."""
        fork = min(num_tokens, self._fork_tokens_unmatched)
        self._fork_tokens_unmatched -= fork
        self.prompt_tokens_transferred += num_tokens - fork


def stats_logger_factory(sink: dict[str, Any]):
    from vllm.v1.metrics.loggers import StatLoggerBase

    counters = sink.setdefault("counters", EngineCounters())

    class _StatsSink(StatLoggerBase):
        """Keeps the last SchedulerStats and accumulates counters."""

        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                sink["scheduler"] = scheduler_stats
                cache = scheduler_stats.prefix_cache_stats
                if cache is not None:
                    counters.prefix_cache_queries += cache.queries
                    counters.prefix_cache_hits += cache.hits
                if scheduler_stats.kv_connector_stats:
                    counters.add_connector_stats(scheduler_stats.kv_connector_stats)
            if iteration_stats is not None:
                tokens = iteration_stats.prompt_token_stats
                counters.prompt_tokens_computed += tokens.computed
                counters.prompt_tokens_cached += tokens.local_cache_hit
                counters.add_external_tokens(tokens.external_kv_transfer)
                counters.generation_tokens += iteration_stats.num_generation_tokens
                counters.add_iteration(iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _StatsSink

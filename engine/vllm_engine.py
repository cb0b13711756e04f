"""One vLLM engine (AsyncLLM) configured for kvhandoff, shared by the P and D wrappers.

Both roles load the same connector so either can export or import; the decode role also
installs the admission-checking scheduler. Each engine gets its own NIXL side-channel
port, set in the environment the engine-core process is started with.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from connector.handoff import DEFAULT_LEASE_SAFETY_MARGIN_S, FORK_TOKENS_KEY
from kvhandoff.ports import free_port
from kvhandoff.types import MAX_BEAM_WIDTH

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]

CONNECTOR_CLASS = "ContinuationConnector"
CONNECTOR_MODULE = "connector.nixl_continuation"
DECODE_SCHEDULER = "decode_engine.scheduler.ContinuationScheduler"


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to start one engine. Validated on construction."""

    model: str
    role: Role
    block_size: int = 32
    #: KV pool size. On CPU this is host RAM; vLLM's gpu_memory_utilization would
    #: mean a fraction of *all* host RAM there.
    kv_cache_memory_bytes: int = 256 << 20
    max_model_len: int = 4096
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    #: None = off on CPU hosts, vLLM's default elsewhere. vLLM 0.32's CPU worker cannot
    #: rewind a seeded request's sampler after a partial (chunked) prefill step
    #: ("CPU Generator does not use offset") and the engine dies; without chunking a
    #: prompt is prefilled in one step, so max_num_batched_tokens is raised to max_model_len.
    chunked_prefill: bool | None = None
    max_logprobs: int = 2 * MAX_BEAM_WIDTH
    enforce_eager: bool = True
    load_format: str = "auto"
    #: vLLM's "auto" runs float32 checkpoints in bfloat16 on CPU; float32 keeps the
    #: built-in model's logprobs precise enough for a 1e-5 comparison.
    dtype: str = "float32"
    seed: int = 0
    tensor_parallel_size: int = 1
    #: Where NIXL reads from/writes to: None = the platform default ("cpu" on CPU
    #: hosts, "cuda" on GPUs so transfers go device to device).
    kv_buffer_device: str | None = None
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int | None = None
    engine_id: str | None = None
    #: Seconds P holds exported blocks for D to read.
    lease_s: int = 30
    lease_safety_margin_s: float = DEFAULT_LEASE_SAFETY_MARGIN_S
    #: NIXL progress thread, sleeping ``nixl_progress_delay_us`` between sweeps
    #: (0 = NIXL's own busy-spinning thread: only for hosts with a core to spare).
    nixl_progress_thread: bool = True
    nixl_progress_delay_us: int = 500
    #: UCX interfaces; "lo" keeps transfers on loopback (single host). None = all.
    ucx_net_devices: str | None = "lo"
    #: CPU hosts only: torch threads per engine (OMP_NUM_THREADS). vLLM's default
    #: binds each engine's OpenMP threads to cores; with two engines and their
    #: engine-core processes on the same cores, spin-waits made every step ~25x
    #: slower here (265 ms vs 10 ms per token), so threads are left unbound.
    cpu_threads: int | None = 1
    #: CPU hosts: oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY; oneDNN's
    #: default 1024). vLLM's CPU matmuls cache a primitive per batch shape; under load
    #: every new token count added one, and P's worker grew ~320 KB per request
    #: (+211 MiB over 640 stage 1s, still growing). 64 kept it flat at the same speed.
    onednn_cache_capacity: int | None = 64
    #: Beam steps copy each beam's partial last block instead of recomputing it
    #: (``connector.nixl_continuation``); kept blocks wait ``beam_fork_hold_s`` at most.
    beam_fork: bool = True
    beam_fork_hold_s: float = 10.0
    #: Signed handoffs (``connector.signing``): a file with the shared secret; None =
    #: ``KVHANDOFF_HANDOFF_SECRET_FILE`` / ``KVHANDOFF_HANDOFF_SECRET`` if set, else off.
    handoff_secret_file: str | None = None
    #: D only: another id handoffs for this engine may be addressed to (replicas behind
    #: one handle share it); None = the engine id only.
    handoff_group: str | None = None
    #: Negative controls only (``connector.faults``): honour a fault a request names.
    #: Off in every server; the harness turns it on for ``kvhandoff verify --inject``.
    fault_injection: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {self.role!r}")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"block_size must be a positive multiple of 16: {self.block_size}")
        for name in ("kv_cache_memory_bytes", "max_model_len", "max_num_seqs", "lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_logprobs < 2:
            raise ValueError("max_logprobs must be >= 2 (beam width 1 needs 2)")
        if not 0 <= self.lease_safety_margin_s < self.lease_s:
            raise ValueError("lease_safety_margin_s must be in [0, lease_s)")
        if self.onednn_cache_capacity is not None and self.onednn_cache_capacity < 0:
            raise ValueError("onednn_cache_capacity must be >= 0 (or None: oneDNN's default)")

    @property
    def enable_chunked_prefill(self) -> bool | None:
        if self.chunked_prefill is not None:
            return self.chunked_prefill
        from vllm.platforms import current_platform

        return False if current_platform.is_cpu() else None

    @property
    def max_beam_width(self) -> int:
        return min(MAX_BEAM_WIDTH, self.max_logprobs // 2)

    def engine_args(self, engine_id: str) -> AsyncEngineArgs:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR_CLASS,
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer" if self.role == "prefill" else "kv_consumer",
            engine_id=engine_id,
            kv_load_failure_policy="fail",
            kv_connector_extra_config={
                "kv_lease_duration": self.lease_s,
                "lease_safety_margin_s": self.lease_safety_margin_s,
                "nixl_progress_thread": self.nixl_progress_thread,
                "nixl_progress_delay_us": self.nixl_progress_delay_us,
                "beam_fork": self.beam_fork,
                "beam_fork_hold_s": self.beam_fork_hold_s,
                "handoff_secret_file": self.handoff_secret_file,
                "handoff_group": self.handoff_group,
                "fault_injection": self.fault_injection,
                "backends": ["UCX"],
            },
            **({"kv_buffer_device": self.kv_buffer_device} if self.kv_buffer_device else {}),
        )
        chunked = self.enable_chunked_prefill
        return AsyncEngineArgs(
            model=self.model,
            tokenizer=self.model,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=(self.max_num_batched_tokens if chunked is not False
                                    else max(self.max_num_batched_tokens, self.max_model_len)),
            enable_chunked_prefill=chunked,
            max_logprobs=self.max_logprobs,
            enforce_eager=self.enforce_eager,
            load_format=self.load_format,
            dtype=self.dtype,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            enable_prefix_caching=True,
            kv_transfer_config=kv_transfer,
            scheduler_cls=DECODE_SCHEDULER if self.role == "decode" else None,
            disable_log_stats=False,
        )


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set env vars while the engine-core process is spawned (it copies os.environ)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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
    #: The latest transfers' (seconds, bytes), newest last.
    recent_transfers: deque = field(default_factory=lambda: deque(maxlen=256))

    def add_connector_stats(self, data: dict[str, list]) -> None:
        durations = data.get("transfer_duration", [])
        sizes = data.get("bytes_transferred", [])
        self.transfers += len(durations)
        self.transfer_s += float(sum(durations))
        self.transfer_bytes += int(sum(sizes))
        self.recent_transfers.extend(zip(durations, sizes))
        self.failed_transfers += len(data.get("num_failed_transfers", []))
        self.failed_notifications += len(data.get("num_failed_notifications", []))
        self.failed_handshakes += len(data.get("num_failed_handshakes", []))
        self.expired_leases += len(data.get("num_kv_expired_reqs", []))
        fork = int(sum(data.get(FORK_TOKENS_KEY, [])))
        self.beam_fork_tokens += fork
        self._fork_tokens_unmatched += fork

    def add_external_tokens(self, num_tokens: int) -> None:
        """vLLM's external (KV connector) prompt tokens, minus the beam fork copies."""
        fork = min(num_tokens, self._fork_tokens_unmatched)
        self._fork_tokens_unmatched -= fork
        self.prompt_tokens_transferred += num_tokens - fork


def _stats_logger_factory(sink: dict[str, Any]):
    from vllm.v1.metrics.loggers import StatLoggerBase

    counters = sink.setdefault("counters", EngineCounters())

    class _StatsSink(StatLoggerBase):
        """Keeps the last SchedulerStats and accumulates counters."""

        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                sink["scheduler"] = scheduler_stats
                if scheduler_stats.kv_connector_stats:
                    counters.add_connector_stats(scheduler_stats.kv_connector_stats)
            if iteration_stats is not None:
                tokens = iteration_stats.prompt_token_stats
                counters.prompt_tokens_computed += tokens.computed
                counters.prompt_tokens_cached += tokens.local_cache_hit
                counters.add_external_tokens(tokens.external_kv_transfer)
                counters.generation_tokens += iteration_stats.num_generation_tokens

        def log_engine_initialized(self) -> None:
            pass

    return _StatsSink


def engine_env(config: EngineConfig, side_channel_port: int) -> dict[str, str]:
    """Environment an engine's processes start with (they inherit it from ``start``)."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": config.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        **({"UCX_NET_DEVICES": config.ucx_net_devices} if config.ucx_net_devices else {}),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        **({"OMP_NUM_THREADS": str(config.cpu_threads)} if config.cpu_threads else {}),
        **({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get(
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(config.onednn_cache_capacity))}
           if config.onednn_cache_capacity is not None else {}),
        **config.extra_env,
    }


class VllmEngine:
    """An AsyncLLM with the kvhandoff connector; base of PrefillEngine/DecodeEngine."""

    def __init__(self, config: EngineConfig, llm: AsyncLLM, engine_id: str,
                 stats: dict[str, Any]):
        self.config = config
        self.llm = llm
        self.engine_id = engine_id
        #: What P addresses (and signs) handoffs for this engine with.
        self.handoff_target = config.handoff_group or engine_id
        self._stats = stats
        cache = llm.vllm_config.cache_config
        self.block_size: int = cache.block_size
        # vLLM reserves one block as the null block.
        self.num_total_blocks: int = (cache.num_gpu_blocks or 1) - 1
        #: Peak blocks of the stage 2s running here (see run_beam_stage).
        self.num_reserved_blocks: int = 0
        model_config = llm.vllm_config.model_config
        self.vocab_size: int = model_config.get_vocab_size()
        self.max_model_len: int = model_config.max_model_len
        self.eos_token_id: int | None = getattr(model_config.hf_config, "eos_token_id", None)

    @classmethod
    def start(cls, config: EngineConfig, **kwargs: Any):
        """Start the engine (blocks until its engine core is up: ~30 s on CPU)."""
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_id = config.engine_id or f"{config.role}-{uuid.uuid4().hex[:8]}"
        port = config.side_channel_port or free_port(config.side_channel_host)
        env = engine_env(config, port)
        stats: dict[str, Any] = {}
        t0 = time.perf_counter()
        with _environment(env):
            # No local for the AsyncLLM: vLLM keeps this frame alive, and a local here
            # would keep the engine from being collected after shutdown().
            engine = cls(
                config,
                AsyncLLM.from_engine_args(
                    config.engine_args(engine_id), stat_loggers=[_stats_logger_factory(stats)]
                ),
                engine_id,
                stats,
                **kwargs,
            )
        logger.info("Engine %s (%s) up in %.1fs, NIXL side channel %s:%d",
                    engine_id, config.role, time.perf_counter() - t0,
                    config.side_channel_host, port)
        return engine

    async def stream(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[RequestOutput]:
        """Run one request, yielding each output delta (new tokens only). Cancelling
        the consumer aborts the request in the engine."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.llm is None:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        params.output_kind = RequestOutputKind.DELTA
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=prompt_token_ids), params, request_id
        ):
            yield out

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> RequestOutput:
        """Run one request to completion and return its final output."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self.llm is None:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        async for out in self.llm.generate(
            TokensPrompt(prompt_token_ids=prompt_token_ids), params, request_id
        ):
            final = out
        assert final is not None and final.finished, f"{request_id}: no final output"
        return final

    async def warmup(self) -> None:
        """Run the first logprobs requests now. vLLM compiles its logprobs gather on
        first use (seconds on CPU); during that the engine does not step, so a KV READ
        in flight would look seconds slow and could outlive P's lease."""
        from vllm import SamplingParams

        for k in (2, 8):
            await self.generate([1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0,
                                                          logprobs=k, detokenize=False),
                                f"warmup-{self.engine_id}-{k}")

    def check_fault(self, fault: str) -> None:
        """Raise ``ValueError`` unless this engine may inject ``fault``."""
        from connector.faults import FAULTS

        if not self.config.fault_injection:
            raise ValueError(f"fault {fault!r}: engine {self.engine_id} was not started "
                             "with fault_injection")
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    @property
    def counters(self) -> EngineCounters:
        return self._stats["counters"]

    def pool(self) -> PoolSnapshot:
        s = self._stats.get("scheduler")
        used = round(s.kv_cache_usage * self.num_total_blocks) if s else 0
        return PoolSnapshot(
            num_total_blocks=self.num_total_blocks,
            num_used_blocks=used,
            num_running_reqs=s.num_running_reqs if s else 0,
            num_waiting_reqs=(s.num_waiting_reqs + s.num_skipped_waiting_reqs) if s else 0,
            block_size=self.block_size,
        )

    async def wait_pool_clean(self, timeout_s: float = 10.0) -> PoolSnapshot:
        """Wait until no block is held (exports are released when D has read them)."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.pool()
            if snap.is_clean or time.monotonic() >= deadline:
                return snap
            await asyncio.sleep(0.05)

    def shutdown(self) -> None:
        """Stop the engine-core and worker processes. Idempotent."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ shuts down again; let that happen now, not during
            # interpreter teardown when the modules it calls are already gone.
            del llm
            gc.collect()


def shutdown_all(engines: list[VllmEngine | None]) -> None:
    """Shut engines down in parallel (each waits up to ~5 s for its processes)."""
    live = [e for e in engines if e is not None]
    threads = [threading.Thread(target=e.shutdown, name=f"shutdown-{e.engine_id}") for e in live]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

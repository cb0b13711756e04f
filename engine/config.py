"""An engine's configuration: validated settings, the vLLM engine arguments they make
(our connector by module path, D's scheduler by class path) and the environment its
processes start with. Imports vLLM only when engine arguments are built."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from connector.adapters import Adapter, load_all, max_lora_rank
from connector.handoff import DEFAULT_LEASE_SAFETY_MARGIN_S
from connector.params import ADAPTERS_KEY, CATALOGS_KEY
from kvhandoff.ports import is_loopback
from kvhandoff.types import MAX_BEAM_WIDTH

if TYPE_CHECKING:
    from vllm.engine.arg_utils import AsyncEngineArgs

    from engine.kv_events import EventEndpoints

Role = Literal["prefill", "decode"]

CONNECTOR_CLASS = "ContinuationConnector"
CONNECTOR_MODULE = "connector.nixl_continuation"
DECODE_SCHEDULER = "decode_engine.scheduler.ContinuationScheduler"
PREFILL_SCHEDULER = "prefill_engine.scheduler.PrefillScheduler"
#: The logits processor of positional sampling (``engine.sampling``), in every engine.
POSITIONAL_SAMPLER = "engine.sampling:PositionalSampler"
#: GPU hosts: each engine's share of the device's memory (``EngineConfig.gpu_memory_share``).
GPU_SHARE_ENV = "KVHANDOFF_GPU_MEMORY_SHARE"
#: Beam search inside the engine: each beam group's step (``decode_engine.beam_processor``).
BEAM_SLOT_PROCESSOR = "decode_engine.beam_processor:BeamSlotProcessor"


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
    #: At least the widest beam group: its W slots run in one batch.
    max_num_seqs: int = MAX_BEAM_WIDTH
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
    #: READs in merged descriptors over blocks allocated in runs (``connector.runs``);
    #: False: vLLM's own, one descriptor per block per layer region, blocks in LRU order.
    kv_runs: bool = True
    #: UCX interfaces; "lo" keeps transfers on loopback (single host). None = all.
    ucx_net_devices: str | None = "lo"
    #: CPU hosts only: torch threads per engine (OMP_NUM_THREADS), left unbound: vLLM's
    #: default binds each engine's OpenMP threads to cores, and two engines on the same
    #: cores then spin-wait on each other (docs/decisions.md, "CPU threads").
    cpu_threads: int | None = 1
    #: CPU hosts: oneDNN's primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY; oneDNN's
    #: default 1024). vLLM's CPU matmuls cache a primitive per batch shape, so an
    #: unbounded cache grows with every new token count (docs/decisions.md, "oneDNN").
    onednn_cache_capacity: int | None = 64
    #: The model's worker runs inside the engine-core process (vLLM's "uni" executor,
    #: its default for one GPU) instead of a process of its own. None = on for CPU hosts
    #: with one worker, where vLLM would otherwise spawn the worker (a second ~20 s
    #: import of vLLM per engine: docs/decisions.md, "One process per engine core").
    worker_in_engine_core: bool | None = None
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
    #: Publish vLLM's KV-cache events for the router's placement (``engine.kv_events``,
    #: ports picked at start) on ``kv_events_host``. They carry every prompt's token ids:
    #: loopback unless asked, where only this host's processes (a router beside the
    #: engine) read them; on any other address only with ``kv_events_key_file``
    #: (``kvhandoff.event_keys``: ZMQ CURVE, for routers holding the same file).
    kv_events: bool = True
    kv_events_host: str = "127.0.0.1"
    kv_events_key_file: str | None = None
    #: Catalogs beams may be constrained to, (name, path) pairs (``engine.catalog``):
    #: loaded and checked at start by the front end and by each worker.
    catalogs: tuple[tuple[str, str], ...] = ()
    #: LoRA adapters served here, (name, directory in PEFT's format) pairs
    #: (``connector.adapters``): vLLM's LoRA is on when there is one.
    adapters: tuple[tuple[str, str], ...] = ()
    #: GPU hosts: the share of the device's memory this engine may take (vLLM's
    #: gpu_memory_utilization): P and D on one GPU need shares that add up below 1,
    #: since vLLM refuses to start when less than its share is free. None =
    #: ``KVHANDOFF_GPU_MEMORY_SHARE`` if set, else vLLM's default (0.9). Unused on CPU.
    gpu_memory_share: float | None = None
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
        if self.gpu_share is not None and not 0 < self.gpu_share < 1:
            raise ValueError(f"gpu_memory_share must be in (0, 1): {self.gpu_share}")
        if self.onednn_cache_capacity is not None and self.onednn_cache_capacity < 0:
            raise ValueError("onednn_cache_capacity must be >= 0 (or None: oneDNN's default)")
        if (self.kv_events and not self.kv_events_key_file
                and not is_loopback(self.kv_events_host)):
            raise ValueError(f"KV events on {self.kv_events_host} carry every prompt's "
                             "token ids: give a key (--kv-events-key FILE, shared with the "
                             "routers) or keep them on loopback")
        for what, pairs in (("catalog", self.catalogs), ("adapter", self.adapters)):
            names = [name for name, _ in pairs]
            if len(set(names)) != len(names) or not all(names):
                raise ValueError(f"{what} names must be distinct and non-empty: {names}")

    @property
    def enable_chunked_prefill(self) -> bool | None:
        if self.chunked_prefill is not None:
            return self.chunked_prefill
        from vllm.platforms import current_platform

        return False if current_platform.is_cpu() else None

    @property
    def gpu_share(self) -> float | None:
        if self.gpu_memory_share is not None:
            return self.gpu_memory_share
        env = os.environ.get(GPU_SHARE_ENV)
        try:
            return float(env) if env else None
        except ValueError:
            raise ValueError(f"{GPU_SHARE_ENV}={env!r}: not a number") from None

    @property
    def on_cpu_host(self) -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    @property
    def uni_executor(self) -> bool:
        if self.worker_in_engine_core is not None:
            return self.worker_in_engine_core
        from vllm.platforms import current_platform

        return current_platform.is_cpu() and self.tensor_parallel_size == 1

    @property
    def max_beam_width(self) -> int:
        """The widest beam search this engine runs: step 0 asks for 2W logprobs, and
        the W slots run in one batch."""
        return min(MAX_BEAM_WIDTH, self.max_logprobs // 2, self.max_num_seqs)

    def engine_args(self, engine_id: str, events: EventEndpoints | None = None,
                    adapters: dict[str, Adapter] | None = None) -> AsyncEngineArgs:
        """vLLM's arguments; ``events``: where the engine core publishes its KV events
        (``engine.kv_events``; None: it does not); ``adapters``: ``self.adapters``
        already loaded (None: loaded here, their files read and hashed)."""
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
                "kv_runs": self.kv_runs,
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
        if adapters is None:
            adapters = load_all(self.adapters)
        return AsyncEngineArgs(
            model=self.model,
            tokenizer=self.model,
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            **({"gpu_memory_utilization": self.gpu_share}
               if self.gpu_share is not None and not self.on_cpu_host else {}),
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
            **({"distributed_executor_backend": "uni"} if self.uni_executor else {}),
            enable_prefix_caching=True,
            kv_transfer_config=kv_transfer,
            scheduler_cls=DECODE_SCHEDULER if self.role == "decode" else PREFILL_SCHEDULER,
            # Off, as vLLM's CPU platform sets it: our schedulers subclass Scheduler, not
            # AsyncScheduler (which tracks the output placeholders an overlapped step
            # leaves), and on GPUs vLLM would otherwise turn it on.
            async_scheduling=False,
            # Positional sampling (engine.sampling) and beam slots
            # (decode_engine.beam_processor), for the requests that ask for them.
            logits_processors=[POSITIONAL_SAMPLER, BEAM_SLOT_PROCESSOR],
            additional_config={
                **({CATALOGS_KEY: dict(self.catalogs)} if self.catalogs else {}),
                **({ADAPTERS_KEY: {a.name: a.digest for a in adapters.values()}}
                   if adapters else {})},
            kv_events_config=events.vllm_config() if events is not None else None,
            disable_log_stats=False,
            **({"enable_lora": True, "max_lora_rank": max_lora_rank(adapters),
                "max_loras": len(adapters), "max_cpu_loras": len(adapters)}
               if adapters else {}),
        )


def engine_env(config: EngineConfig, side_channel_port: int) -> dict[str, str]:
    """Environment an engine's processes start with (they inherit it from ``start``)."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": config.side_channel_host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"),
        **({"UCX_NET_DEVICES": config.ucx_net_devices} if config.ucx_net_devices else {}),
        # GPU hosts: UCX turns cuda_ipc READs off where it sees no NVLink (PCIe cards, or
        # P and D on one GPU), and NIXL's READ of GPU memory then crawls through TCP in
        # software (0.5 GB/s against 1.5 TB/s with it on: docs/performance.md, "On a
        # GPU"). Not on CPU hosts (UCX warns of a variable no module there reads); the
        # operator's value wins.
        **({} if config.on_cpu_host else {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": os.environ.get(
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")}),
        # vLLM 0.32's v1 model runner, on every platform. On CUDA with Triton vLLM would
        # pick Model Runner V2, whose loader refuses v1-interface logits processors (the
        # positional sampler); the v1 runner is also the one every test here runs (the
        # CPU build has no Triton). Not the operator's to change: under V2 the engine
        # would not start (docs/decisions.md, "The CUDA runner").
        "VLLM_USE_V2_MODEL_RUNNER": "0",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        **({"OMP_NUM_THREADS": str(config.cpu_threads)} if config.cpu_threads else {}),
        **({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": os.environ.get(
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(config.onednn_cache_capacity))}
           if config.onednn_cache_capacity is not None else {}),
        # vLLM's CPU platform turns "uni" into "mp" unless this is off; AsyncLLM runs its
        # engine core in a process of its own either way.
        **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if config.uni_executor else {}),
        **config.extra_env,
    }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
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

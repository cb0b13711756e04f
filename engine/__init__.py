"""The engine layer's base: one vLLM ``AsyncLLM`` configured for kvhandoff (config ->
engine args, lifecycle, pool snapshot and counters), under ``prefill_engine`` and
``decode_engine``. vLLM is imported lazily, when an engine starts."""

from __future__ import annotations

from engine.vllm_engine import (
    EngineConfig,
    EngineCounters,
    PoolSnapshot,
    VllmEngine,
    shutdown_all,
)

__all__ = ["EngineConfig", "EngineCounters", "PoolSnapshot", "VllmEngine", "shutdown_all"]

"""The engine layer's base: one vLLM ``AsyncLLM`` configured for kvhandoff, under
``prefill_engine`` and ``decode_engine``: its configuration and engine arguments
(``config``), its pool snapshot and counters (``stats``), its lifecycle
(``vllm_engine``), and the catalogs constrained beams are kept in (``catalog``). vLLM is
imported lazily, when an engine starts."""

from __future__ import annotations

from engine.config import EngineConfig, engine_env
from engine.stats import EngineCounters, PoolSnapshot
from engine.vllm_engine import VllmEngine, shutdown_all

__all__ = ["EngineConfig", "EngineCounters", "PoolSnapshot", "VllmEngine", "engine_env",
           "shutdown_all"]

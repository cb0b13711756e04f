"""What the connector's worker sends its scheduler each step beside the KV transfers
(vLLM's connector worker metadata): a source registers itself in the worker process (the
beam processor, when vLLM loads it: ``decode_engine.beam_processor``), and the connector
asks it once per step. This module knows nothing of what the source sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_source: Callable[[], Any] | None = None


def register(source: Callable[[], Any]) -> None:
    """``source()``, called once per step, returns the step's metadata (None: none)."""
    global _source
    _source = source


def open_step() -> Any:
    """This step's metadata from the registered source (None without one)."""
    return _source() if _source is not None else None

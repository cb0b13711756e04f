"""D, the decode/beam engine: the import of a parent's KV, beam search over
``AsyncLLM.generate`` (``beam``), and the admission-checking scheduler vLLM loads by class
path (``scheduler``, which imports vLLM)."""

from __future__ import annotations

from decode_engine.engine import DecodeEngine, run_beam_stage

__all__ = ["DecodeEngine", "run_beam_stage"]

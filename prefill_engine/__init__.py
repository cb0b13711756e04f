"""P, the prefill/sampling engine: stage 1 until ``</think>``, EOS or max_tokens, and the
export of the parent's KV blocks under a lease. Also serves the colocated path."""

from __future__ import annotations

from prefill_engine.engine import PrefillEngine, stage1_sampling

__all__ = ["PrefillEngine", "stage1_sampling"]

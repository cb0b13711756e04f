"""prefill_engine."""

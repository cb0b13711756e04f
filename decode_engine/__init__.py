"""decode_engine."""

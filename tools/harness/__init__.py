"""``kvhandoff verify``: the handoff-correctness harness."""

__all__: list[str] = []

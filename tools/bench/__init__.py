"""``kvhandoff bench`` and its probes."""

__all__: list[str] = []

"""The engine gRPC server (``kvhandoff serve --role prefill|decode``): a thin servicer over
one engine, its protobuf conversions, Prometheus metrics and what every kvhandoff gRPC
server shares (message limits, health, reflection, shutdown)."""

__all__: list[str] = []

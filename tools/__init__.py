"""What people run: the ``kvhandoff`` command (``cli``), the router client, the process
launcher, the demo, the correctness harness and its two-stage pipeline, the benchmark and
its probes, and an in-process P+D pair."""

__all__: list[str] = []

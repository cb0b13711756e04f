"""What people run: the ``kvhandoff`` command (``cli``), the router client, the process
launcher, the demo, the soak, the correctness harness (``harness``) and its two-stage
pipeline, the benchmark and its probes (``bench``), and an in-process P+D pair."""

__all__: list[str] = []

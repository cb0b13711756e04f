"""What P's confirmation costs D per import (``connector.liveness``): the side channel's
round trip, measured against the real listener loop on loopback (no engine: the loop
answers from its set of live exports, as P's does).

``python -m tools.liveness_probe [CALLS]`` prints the median and p99 in milliseconds."""

from __future__ import annotations

import statistics
import sys
import threading
import time

from connector.liveness import LiveExports, ask_live, side_channel_listener
from kvhandoff.ports import free_port


def probe(calls: int = 300) -> tuple[float, float]:
    """(median, p99) of ``calls`` questions, in ms."""
    live = LiveExports()
    live.add("export-1", [[1, 2, 3]])
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=side_channel_listener(live, {}), daemon=True,
                              args=({(0, 0): b""}, ready, stop, "127.0.0.1", port))
    thread.start()
    ready.wait()
    try:
        asked = [("export-1", [[1, 2, 3]])]
        assert ask_live("127.0.0.1", port, [*asked, ("export-2", [[1]])]) == [True, False]
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            ask_live("127.0.0.1", port, asked)
            times.append((time.perf_counter() - t0) * 1e3)
    finally:
        stop.set()
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    median, p99 = probe(n)
    print(f"side-channel confirmation over loopback: median {median:.2f} ms, "
          f"p99 {p99:.2f} ms ({n} calls)")

"""An engine process's heap: returning glibc's free pages (:class:`Trimmer`, on by
default), and Python heap snapshots for finding what grows (a diagnostic, off unless
asked).

``Trimmer``: glibc keeps the pages of freed chunks inside its main heap (brk) mapped, and
an engine core's churn of differently sized buffers (tensors of each step's batch, event
payloads, request records) leaves more of them behind over hours: resident, counted in
RSS, never reused whole. ``malloc_trim(0)`` gives those pages back to the kernel
(``madvise(MADV_DONTNEED)`` on free chunks); :meth:`Trimmer.maybe_trim`, called from the
scheduler's step, runs it at most every ``KVHANDOFF_MALLOC_TRIM_S`` seconds (default 10;
0 turns it off). It frees no live memory: a real leak still shows.

With ``KVHANDOFF_HEAP_DIR`` set, :func:`start_from_env` (called by our scheduler, so in
the engine-core process, and by the server) starts ``tracemalloc`` with
``KVHANDOFF_HEAP_FRAMES`` frames (default 8) and writes a snapshot every
``KVHANDOFF_HEAP_EVERY_S`` seconds (default 60) to ``<dir>/<role>-<pid>-<n>.snap``, from a
daemon thread. tracemalloc slows allocation-heavy Python code (about 2x here); use it for
a diagnosis, never in production. ``python -m kvhandoff.heap DIR`` prints, per process, the
traced total of each snapshot and the lines whose memory grew most between the last
snapshot and the ``--from`` one.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import threading
import time
import tracemalloc
from pathlib import Path

ENV_DIR = "KVHANDOFF_HEAP_DIR"
ENV_TRIM_S = "KVHANDOFF_MALLOC_TRIM_S"
_started = False


class Trimmer:
    """``malloc_trim(0)`` at most every ``every_s`` seconds (glibc only; else never)."""

    def __init__(self, every_s: float | None = None):
        if every_s is None:
            every_s = float(os.environ.get(ENV_TRIM_S, "10"))
        self.every_s = every_s
        self.trims = 0
        self._next = time.monotonic() + every_s
        self._trim = None
        if every_s > 0:
            try:
                libc = ctypes.CDLL("libc.so.6")
                self._trim = libc.malloc_trim
                self._trim.argtypes, self._trim.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):  # not glibc: nothing to trim this way
                self._trim = None

    def maybe_trim(self) -> bool:
        """Trim when the interval has passed; whether it did."""
        if self._trim is None or time.monotonic() < self._next:
            return False
        self._trim(0)
        self.trims += 1
        self._next = time.monotonic() + self.every_s
        return True


def start_from_env(role: str) -> bool:
    """Start the snapshots when ``KVHANDOFF_HEAP_DIR`` is set (once per process)."""
    global _started
    directory = os.environ.get(ENV_DIR)
    if not directory or _started:
        return False
    _started = True
    frames = int(os.environ.get("KVHANDOFF_HEAP_FRAMES", "8"))
    every_s = float(os.environ.get("KVHANDOFF_HEAP_EVERY_S", "60"))
    Path(directory).mkdir(parents=True, exist_ok=True)
    tracemalloc.start(frames)
    prefix = Path(directory) / f"{role}-{os.getpid()}"

    def run() -> None:
        for n in itertools.count():  # until the process ends (a daemon thread)
            time.sleep(every_s)
            tracemalloc.take_snapshot().dump(f"{prefix}-{n:03d}.snap")

    threading.Thread(target=run, name="kvhandoff-heap", daemon=True).start()
    return True


def _report(directory: Path, first: int, top: int) -> None:
    groups: dict[str, list[Path]] = {}
    for path in sorted(directory.glob("*.snap")):
        groups.setdefault(re.sub(r"-\d+\.snap$", "", path.name), []).append(path)
    for name, paths in groups.items():
        snaps = [tracemalloc.Snapshot.load(str(p)) for p in paths]
        totals = [sum(s.size for s in snap.statistics("filename")) / 2**20 for snap in snaps]
        print(f"{name}: traced MiB by snapshot {[round(t, 1) for t in totals]}")
        if len(snaps) <= first + 1:
            continue
        diff = snaps[-1].compare_to(snaps[first], "traceback")
        for stat in diff[:top]:
            print(f"  {stat.size_diff / 2**20:+8.2f} MiB {stat.count_diff:+8d} blocks  "
                  f"(now {stat.size / 2**20:.2f} MiB)")
            for line in stat.traceback.format()[-6:]:
                print(f"      {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--from", dest="first", type=int, default=1,
                        help="the snapshot the last one is compared with (index)")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    _report(args.directory, args.first, args.top)


if __name__ == "__main__":
    main()

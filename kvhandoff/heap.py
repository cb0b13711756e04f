"""Python heap snapshots of an engine's processes, for finding what grows (a diagnostic,
off unless asked).

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
import os
import re
import threading
import tracemalloc
from pathlib import Path

ENV_DIR = "KVHANDOFF_HEAP_DIR"
_started = False


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
        n = 0
        stop = threading.Event()
        while not stop.wait(every_s):
            tracemalloc.take_snapshot().dump(f"{prefix}-{n:03d}.snap")
            n += 1

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

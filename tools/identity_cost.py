"""What a model's identity (:func:`kvhandoff.model.model_identity`) costs at an engine's
start: ``python -m tools.identity_cost [MODEL ...]`` (default: ``builtin bench``).

Per model, the median of ``repeats`` runs of :meth:`FileDigests.digest` over the files
the identity covers, each with a cache of its own:

- ``cold (disk)``: nothing cached, the weight files first dropped from the page cache
  (``posix_fadvise DONTNEED``): a first start after the files arrived;
- ``cold (page cache)``: nothing cached, the files in memory: SHA-256's own speed;
- ``warm``: a new process's view (nothing in memory) of a cache the first run wrote:
  every later start, and the engine core after its server.

Bytes per second are the identity's bytes over the cold times; from them, what a
1.7B (3.4 GB in bfloat16) and an 8B model (16 GB) would take, one file after another
(one core; shards are hashed on up to 8 threads at once, which this does not count).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvhandoff.digests import FileDigests
from kvhandoff.model import identity_files, resolve_model

#: Bytes of the models the figures are projected to (bfloat16 weights).
PROJECTED = {"1.7B": 3.4e9, "8B": 16e9}


@dataclass(frozen=True)
class IdentityCost:
    model: str
    num_bytes: int
    cold_disk_s: float
    cold_memory_s: float
    warm_s: float

    def rate(self, seconds: float) -> float:
        return self.num_bytes / seconds


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed_digest(cache: Path, model_dir: Path, names: list[str]) -> float:
    t0 = time.perf_counter()
    FileDigests(cache).digest(model_dir, names, "cost")
    return time.perf_counter() - t0


def measure(model: str, repeats: int = 3) -> IdentityCost:
    """The three timings of the module docstring for ``model`` (a ``--model`` name)."""
    model_dir = resolve_model(model)
    names = identity_files(model_dir)
    num_bytes = sum((model_dir / n).stat().st_size for n in names)
    disk, memory, warm = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for name in names:
                _drop_from_page_cache(model_dir / name)
            disk.append(_timed_digest(Path(tmp) / f"d{i}", model_dir, names))
            cache = Path(tmp) / f"m{i}"
            memory.append(_timed_digest(cache, model_dir, names))
            warm.append(_timed_digest(cache, model_dir, names))
    return IdentityCost(str(model), num_bytes, statistics.median(disk),
                        statistics.median(memory), statistics.median(warm))


def table(costs: list[IdentityCost]) -> str:
    """The figures as a Markdown table."""
    head = ("| model | bytes hashed | cold, disk | cold, page cache | warm (cache hit) | "
            + " | ".join(f"{k} cold (disk / page cache)" for k in PROJECTED) + " |")
    lines = [head, "|" + "---|" * (5 + len(PROJECTED))]
    for c in costs:
        disk, memory = c.rate(c.cold_disk_s), c.rate(c.cold_memory_s)
        projected = " | ".join(f"{b / disk:.1f} s / {b / memory:.1f} s"
                               for b in PROJECTED.values())
        lines.append(f"| {c.model} | {c.num_bytes / 1e6:.1f} MB | {c.cold_disk_s * 1e3:.0f} ms"
                     f" ({disk / 1e9:.2f} GB/s) | {c.cold_memory_s * 1e3:.0f} ms "
                     f"({memory / 1e9:.2f} GB/s) | {c.warm_s * 1e3:.2f} ms | {projected} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", default=["builtin", "bench"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(table([measure(m, args.repeats) for m in args.models]))


if __name__ == "__main__":
    main()

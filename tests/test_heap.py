"""kvhandoff.heap: the Trimmer gives glibc's free heap pages back (measured in a process of
its own), at most once per interval; the snapshots a diagnosis reads."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from kvhandoff.heap import Trimmer

#: A process that leaves its heap fragmented (every other 64 KiB-ish chunk freed, one kept
#: at the top so nothing can be cut from the end), then prints its RSS before and after
#: ``trim`` (the argument: "1" trims through Trimmer, "0" waits the same without).
_FRAGMENT = textwrap.dedent("""
    import sys, time
    from kvhandoff.heap import Trimmer

    def rss_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    chunks = [bytearray(60_000 + (i % 7) * 512) for i in range(6000)]  # ~360 MiB, on brk
    del chunks[::2]
    del chunks[:-1]  # the top chunk stays: glibc cannot shrink the heap from its end
    before = rss_mib()
    trimmer = Trimmer(every_s=0.01)
    time.sleep(0.02)
    trimmed = trimmer.maybe_trim() if sys.argv[1] == "1" else False
    print(before, rss_mib(), trimmed)
""")


def _run(trim: str) -> tuple[float, float, str]:
    out = subprocess.run([sys.executable, "-c", _FRAGMENT, trim], capture_output=True,
                         text=True, check=True, env={"MALLOC_MMAP_THRESHOLD_": "131072",
                                                     "PYTHONPATH": "."}).stdout.split()
    return float(out[0]), float(out[1]), out[2]


def test_trimming_gives_free_heap_pages_back_and_without_it_they_stay():
    before, after, trimmed = _run("1")
    assert trimmed == "True" and before > 300 and after < before - 250, (before, after)
    before, after, trimmed = _run("0")  # the control: the same process, no trim
    assert trimmed == "False" and after > before - 20, (before, after)


def test_at_most_once_per_interval_and_off_at_zero():
    trimmer = Trimmer(every_s=0.2)
    assert not trimmer.maybe_trim()  # the interval starts at creation
    time.sleep(0.25)
    assert trimmer.maybe_trim() and not trimmer.maybe_trim()
    assert trimmer.trims == 1
    off = Trimmer(every_s=0)
    time.sleep(0.01)
    assert not off.maybe_trim() and off.trims == 0

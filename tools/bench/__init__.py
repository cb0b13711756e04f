"""``kvhandoff bench``: what the handoff buys against what a user would do instead, and
its probes.

- ``main``: the command, its flags to the measurement they select, and the outputs;
- ``run``: the full bench, every phase on one P+D pair; ``modes``: one request in each
  mode (``types``: its config, the modes, a sample); ``floor``: stage 2 against its
  floor and the import step by parent length; ``idle``: the engines' CPU idle and while
  P holds an export; ``report``: the printed report, the summaries and the plot;
- ``router_overhead``: the router's own time per request; ``nixl_probe``: raw NIXL
  READs in one or many descriptors, also between two hosts;
- ``moves`` (``--moves``), ``hosts`` (``--hosts-link``), ``http_two_calls``
  (``--http-two-calls``): the other measurements ``kvhandoff bench`` runs;
  ``sampling``: positional sampling's cost (``python -m tools.bench.sampling``).

Modules in this package import each other by their full path, never through this file.
"""

from __future__ import annotations

from tools.bench.main import main_bench
from tools.bench.modes import Bench, make_prompts, rotated
from tools.bench.report import format_report, plot
from tools.bench.run import run_bench
from tools.bench.types import MODES, BenchConfig, BenchError, Sample

__all__ = ["MODES", "Bench", "BenchConfig", "BenchError", "Sample", "format_report",
           "main_bench", "make_prompts", "plot", "rotated", "run_bench"]

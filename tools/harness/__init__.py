"""The handoff-correctness harness and ``kvhandoff verify``: every case through the
colocated reference and through the P -> D handoff (or its moves), compared token for
token.

- ``cases``: which parents, endings, beam widths, D cache states and adapters it runs,
  and their prompts;
- ``run``: the harness on a P and a D, the references each case is compared against;
- ``checks``: what makes a case pass, and the logprob bound a case is held to (its
  engine's measured noise times ``NOISE_FACTOR``, floored at ``LOGPROB_TOLERANCE``; a
  noise above ``NOISE_CEILING`` fails the case);
- ``report``: a row per case, the run's verdict, its table and JSON (and
  ``LOGPROB_TOLERANCE``, which the bench and the demo also hold their beams to);
- ``main``: ``kvhandoff verify``, on engines it starts.

Modules in this package import each other by their full path, never through this file.
"""

from __future__ import annotations

from tools.harness.cases import (
    Case,
    adapter_cases,
    default_cases,
    fault_cases,
    history_prompt,
)
from tools.harness.checks import (
    NOISE_CEILING,
    NOISE_FACTOR,
    BeamVerdict,
    Noise,
    Reference,
    compare,
    judge_beams,
    logprob_bound,
)
from tools.harness.main import VERIFY_D_POOL_BLOCKS, main_verify, verify
from tools.harness.report import (
    LOGPROB_TOLERANCE,
    CaseReport,
    HarnessReport,
    format_table,
    result_text,
    write_json,
)
from tools.harness.run import Harness

__all__ = ["LOGPROB_TOLERANCE", "NOISE_CEILING", "NOISE_FACTOR", "VERIFY_D_POOL_BLOCKS",
           "BeamVerdict", "Case", "CaseReport", "Harness", "HarnessReport", "Noise",
           "Reference", "adapter_cases", "compare", "default_cases", "fault_cases", "format_table",
           "history_prompt", "judge_beams", "logprob_bound", "main_verify", "result_text",
           "verify", "write_json"]

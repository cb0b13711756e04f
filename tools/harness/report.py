"""What the harness reports: a row per case, the run's verdict, its table and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from connector.faults import FAULTS
from tools.ucx_report import all_network

#: Cumulative logprobs of the two paths may differ by float rounding (the reference
#: recomputes the parent's partial last block; D imports it). Stated and small. The
#: harness's floor: it holds a case to ``max(LOGPROB_TOLERANCE, NOISE_FACTOR * noise)``
#: (``tools.harness.checks``); the bench and the demo hold their beams to it as is.
LOGPROB_TOLERANCE = 1e-5

@dataclass
class CaseReport:
    name: str
    prompt_token_ids: list[int]
    stage1_seed: int
    stage1_token_ids: list[int]
    stage1_finish_reason: str
    suffix_token_ids: list[int]
    beam: dict[str, Any]
    d_state: str
    colocated_beams: list[dict[str, Any]]
    handoff_beams: list[dict[str, Any]]
    vllm_beams: list[dict[str, Any]]
    num_parent_tokens: int
    num_imported_tokens: int
    #: Parent tokens D already held in its prefix cache (not read from P).
    num_found_on_d_tokens: int
    num_computed_tokens_d_first_step: int
    num_computed_tokens_d_total: int
    num_bytes_moved: int
    #: What a text round-trip would compute: the re-tokenised parent + suffix.
    num_text_roundtrip_tokens: int | None
    stage1_identical: bool
    stage1_identical_on_d: bool
    beams_identical: bool
    #: Ids equal to vLLM's beam_search and logprobs within ``logprob_bound``.
    beams_match_vllm: bool
    #: The largest |delta cumulative logprob| of the handoff's beams against the
    #: colocated reference's, and against vLLM's beam_search.
    max_logprob_diff: float
    max_logprob_diff_vllm: float
    #: The engine's own noise on the case: the colocated reference against its rerun
    #: under another batch; and the bound both differences are held to.
    logprob_noise: float
    logprob_bound: float
    #: The noise exceeded the ceiling (or the rerun chose other beams): the case fails.
    noisy: bool
    computed_as_expected: bool
    #: Stage 1 moved from P to D after this many tokens (then ``num_imported_tokens`` and
    #: ``num_computed_tokens_d_first_step`` are the move's, ``num_bytes_moved`` its READ).
    move_at: int | None = None
    fault: str | None = None
    #: False: the injected fault cannot corrupt this parent (e.g. no partial block).
    fault_applies: bool = True
    #: The injected faults the engines counted as taking effect during the case's run
    #: (their connector stats): a fault that applies and was never counted fails the case.
    faults_injected: int = 0
    failures: list[str] = field(default_factory=list)
    #: D refused the import, as it must (a case whose stage 2 names another adapter):
    #: D's message; "" when it ran.
    refused: str = ""
    #: A case whose prompt starts with a pinned chunk: the prompt tokens P computed.
    num_computed_tokens_p: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class HarnessReport:
    model_dir: str
    block_size: int
    #: The bound's floor, factor and noise ceiling (``tools.harness.checks``).
    logprob_tolerance: float
    noise_factor: float
    noise_ceiling: float
    cases: list[CaseReport]
    pools_clean: bool
    pool_details: dict[str, Any]
    elapsed_s: float
    fault: str | None = None
    #: Across hosts (``verify --hosts``): P's and D's addresses and the transports UCX
    #: chose for the READs (from its protocol tables); they must all be network ones.
    hosts: dict[str, str] | None = None
    read_transports: list[str] | None = None

    @property
    def over_network(self) -> bool:
        return all_network(self.read_transports or [])

    @property
    def ok(self) -> bool:
        return (self.pools_clean and all(c.ok for c in self.cases)
                and (self.hosts is None or self.over_network))

    @property
    def caught(self) -> list[str]:
        """Cases whose failures the injected fault caused (the fault applied)."""
        return [c.name for c in self.cases if c.fault_applies and not c.ok]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def result_text(c: CaseReport) -> str:
    if c.ok and c.refused:
        return f"refused as it must be ({c.refused})"
    if c.ok:
        return "identical" if c.fault_applies else "identical (fault n/a for this parent)"
    return "FAIL: " + "; ".join(c.failures)


def format_table(report: HarnessReport) -> str:
    head = (f"{'case':<26}{'parent':>7}{'stage1':>8}{'suffix':>7}{'W':>4}{'D':>5}"
            f"{'imported':>9}{'on D':>6}{'D comp':>7}{'text rt':>8}{'KiB moved':>10}"
            f"{'noise':>9}{'d coloc':>9}{'d vllm':>9}{'bound':>9}  result")
    lines = [f"injected fault: {report.fault} ({FAULTS[report.fault].what})"] if report.fault else []
    lines += [head, "-" * len(head)]
    for c in report.cases:
        lines.append(
            f"{c.name:<26}{c.num_parent_tokens:>7}{len(c.stage1_token_ids):>4} "
            f"{c.stage1_finish_reason[:3]:>3}{len(c.suffix_token_ids):>7}{c.beam['beam_width']:>4}"
            f"{c.d_state:>5}{c.num_imported_tokens:>9}{c.num_found_on_d_tokens:>6}"
            f"{c.num_computed_tokens_d_first_step:>7}"
            f"{(c.num_text_roundtrip_tokens or 0):>8}{c.num_bytes_moved / 1024:>10.0f}"
            f"{c.logprob_noise:>9.1e}{c.max_logprob_diff:>9.1e}"
            f"{c.max_logprob_diff_vllm:>9.1e}{c.logprob_bound:>9.1e}  {result_text(c)}"
        )
    n_ok = sum(c.ok for c in report.cases)
    lines.append("-" * len(head))
    lines.append(
        f"{n_ok}/{len(report.cases)} cases identical (beams exact and equal to vLLM's "
        f"beam_search, logprobs within max({report.logprob_tolerance:.0e}, "
        f"{report.noise_factor:g} x noise), noise at most {report.noise_ceiling:.0e}, "
        f"stage 1 equal on P and D); pools clean: {'yes' if report.pools_clean else 'NO'} "
        f"{report.pool_details if not report.pools_clean else ''}; {report.elapsed_s:.1f}s"
    )
    if report.hosts is not None:
        lines.append(f"hosts: P on {report.hosts['p']}, D on {report.hosts['d']} (network "
                     f"namespaces); the READs went by "
                     f"{', '.join(report.read_transports or []) or 'nothing seen'} "
                     f"({'a network transport' if report.over_network else 'NOT a network transport'})")
    if report.fault:
        fault = FAULTS[report.fault]
        verdict = (f"caught in {len(report.caught)} case(s)" if report.caught
                   else "not caught")
        lines.append(f"fault {fault.name}: {verdict}; expected "
                     f"{'caught' if fault.expected_caught else 'invisible'}: {fault.caught_by}")
    return "\n".join(lines)


def write_json(report: HarnessReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_json(), indent=1) + "\n")

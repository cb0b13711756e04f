"""What our code hands through vLLM's dictionaries: every key, one definition each, and the
typed records the connector returns under them on a request's final output.

Keys travel in a request's ``kv_transfer_params`` (the engine front -> the connector's
scheduler side, and back on the final ``RequestOutput``), in ``SamplingParams.extra_args``
(a beam slot's spec), in ``additional_config`` (what an engine loaded at start) and in the
connector's stats. Their string values are the wire names: never change one without
``connector.handoff.PROTOCOL_VERSION``.

The records are the one shape of each fact the connector reports back (its scheduler
side writes them, the engines read them): what a request imported
(:class:`ImportReport`), what a composed stage 1 blended (:class:`BlendReport`), until
when a parent is held here (:class:`HoldReport`), and why an import was refused
(:class:`Refusal`). Light: no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

# ---- kv_transfer_params keys --------------------------------------------------------
#: Our handoff (``connector.handoff.Handoff``) on P's final output and on D's import
#: request; on a final output also the import's report, a refusal, or ``held_until``.
KEY = "kvhandoff"
#: The beam-fork parameters (``connector.beam_fork``). A request sent with
#: ``{"id": name, "keep": True, "hold_s": s}`` under it is a parent held on its own engine
#: (the one-engine path): its blocks stay ``s`` seconds, however many continuations copy
#: from them (``{"fork_from": name}``).
BEAM_KEY = "kvhandoff_beam"
#: ``kv_transfer_params[BEAM_KEY]`` flag on a beam slot: not yet (the connector skips it).
WAIT_KEY = "slot_wait"
#: P's stage-1 request: hold the export for its whole lease (a parent for continuations):
#: P keeps the blocks after a READ, so several continuations (on one D or several) may
#: read them, until the lease ends. True: P's lease; a number of seconds: that long, at
#: most P's lease.
HOLD_KEY = "kvhandoff_hold"
#: A one-token request that ends holds early (the engine's Release): exported parents by
#: their handoff's request id (P's internal one), parents held on their own engine by
#: their stage-1 request id. Unknown ones are ignored.
RELEASE_KEY = "kvhandoff_release"
#: ... and the name prefixes whose parents held on this engine it ends (a router's
#: chunks, pinned here, released when that router starts again).
RELEASE_PREFIX_KEY = "kvhandoff_release_prefix"
#: A one-token request that stops running requests after their next token (the engine's
#: ``stop``; a move): client request ids.
STOP_KEY = "kvhandoff_stop"
#: With ``STOP_KEY``: the engine id the stopped requests' handoffs are addressed to
#: instead of the one they named (a move to another P); absent or "": unchanged.
RETARGET_KEY = "kvhandoff_retarget"
#: A beam search stopped to move (``decode_engine.search_stops``): its slot 0 exports only
#: the search's shared prefix, this many tokens (its own beam's tokens stay behind).
EXPORT_TOKENS_KEY = "kvhandoff_export_tokens"
#: An import that exports again when it ends (a stage 1 moved to another P: it imports
#: the tokens so far, samples on and exports its own handoff). Its import's report is then
#: returned under ``IMPORTED_KEY`` (``KEY`` carries the new handoff).
REEXPORT_KEY = "kvhandoff_reexport"
IMPORTED_KEY = "kvhandoff_imported"
#: A stage 1 composed approximately (``connector.blend_spec.Blend.to_params``).
BLEND_KEY = "kvhandoff_blend"
#: What a composed stage 1 blended, on its final output (:class:`BlendReport`).
BLENDED_KEY = "kvhandoff_blended"
#: The fault a request names (``connector.faults``; P's stage-1 params or D's import).
FAULT_KEY = "kvhandoff_fault"
#: The D engine id P's stage-1 request addresses its handoff to (``connector.signing``).
TARGET_KEY = "kvhandoff_target"

# ---- SamplingParams.extra_args ------------------------------------------------------
#: A beam slot's parameters (beam search inside the engine:
#: ``decode_engine.slot_spec``), and the group's beams on the final output of its slot 0
#: (``kv_transfer_params[KEY][SLOT_KEY]``).
SLOT_KEY = "kvhandoff_slot"
#: A positional request's sampling parameters (``engine.sampling``).
SAMPLE_KEY = "kvhandoff_sample"

# ---- additional_config (what an engine loaded at start, for its other processes) ----
#: Adapter name -> its digest (``connector.adapters``; the scheduler side's copy).
ADAPTERS_KEY = "kvhandoff_adapters"
#: Catalog name -> path (``engine.catalog``), read by each worker's beam processor.
CATALOGS_KEY = "kvhandoff_catalogs"

# ---- the connector's stats (``connector.stats``) ------------------------------------
#: Prompt tokens beam steps copied from a kept beam (beam fork). vLLM counts them as
#: external (KV-connector) tokens; they were copied on D, not transferred.
FORK_TOKENS_KEY = "kvhandoff_beam_fork_tokens"
#: Injected faults (``connector.faults``) that took effect on this engine, one entry each:
#: the harness's evidence that a negative control really ran.
FAULTS_KEY = "kvhandoff_faults_injected"
#: Allocations arranged in runs (``connector.runs``), one entry each (the runs made), and
#: the cached blocks each evicted out of the LRU order.
RUNS_KEY = "kvhandoff_runs"
RUNS_OUT_OF_ORDER_KEY = "kvhandoff_runs_out_of_lru_order"


def _under(params: Mapping[str, Any] | None, key: str) -> Mapping[str, Any]:
    """``params[key]`` where it is a mapping, else empty."""
    value = (params or {}).get(key)
    return value if isinstance(value, Mapping) else {}


# ---- the records on a final output --------------------------------------------------
@dataclass(frozen=True, slots=True)
class ImportReport:
    """What a request imported from P's export (all 0: nothing). Under ``KEY``, or under
    ``IMPORTED_KEY`` on a request that exports again (``KEY`` then carries its handoff)."""

    num_imported_tokens: int = 0
    num_imported_blocks: int = 0
    num_imported_bytes: int = 0
    #: Admitted only without beam fork (the pool was short for it).
    beam_fork_disabled: bool = False

    @staticmethod
    def key(exporting: bool) -> str:
        return IMPORTED_KEY if exporting else KEY

    def attach(self, params: dict[str, Any] | None, exporting: bool) -> dict[str, Any]:
        """``params`` (a copy) with this report under its key."""
        return {**(params or {}), self.key(exporting): asdict(self)}

    @classmethod
    def read(cls, params: Mapping[str, Any] | None, exporting: bool = False) -> ImportReport:
        """The report on a final output's ``kv_transfer_params`` (all 0 without one)."""
        fields = _under(params, cls.key(exporting))
        return cls(num_imported_tokens=int(fields.get("num_imported_tokens", 0)),
                   num_imported_blocks=int(fields.get("num_imported_blocks", 0)),
                   num_imported_bytes=int(fields.get("num_imported_bytes", 0)),
                   beam_fork_disabled=bool(fields.get("beam_fork_disabled", False)))


@dataclass(frozen=True, slots=True)
class BlendReport:
    """What a stage 1 composed approximately (``connector.blend``) blended: its first
    ``num_blended_tokens`` prompt tokens' KV copied from held chunks; ``refused``: why the
    composition was not made ("": it was). Under ``BLENDED_KEY``."""

    num_blended_tokens: int = 0
    refused: str = ""

    def attach(self, params: dict[str, Any] | None) -> dict[str, Any]:
        return {**(params or {}), BLENDED_KEY: asdict(self)}

    @classmethod
    def read(cls, params: Mapping[str, Any] | None) -> BlendReport:
        fields = _under(params, BLENDED_KEY)
        return cls(num_blended_tokens=int(fields.get("num_blended_tokens", 0)),
                   refused=str(fields.get("refused", "")))


@dataclass(frozen=True, slots=True)
class HoldReport:
    """Until when (Unix time) a parent is held on its own engine; under ``KEY``."""

    held_until: float = 0.0

    def attach(self, params: dict[str, Any] | None) -> dict[str, Any]:
        return {**(params or {}), KEY: asdict(self)}

    @classmethod
    def read(cls, params: Mapping[str, Any] | None) -> HoldReport:
        return cls(held_until=float(_under(params, KEY).get("held_until", 0.0)))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request that imports ended in error (refused at admission, or its READ
    failed): ``reason`` (``kvhandoff.errors`` maps it to a status) and a message. Under
    ``KEY``."""

    reason: str
    error: str

    def to_params(self) -> dict[str, Any]:
        return {KEY: {"error": self.error, "reason": self.reason}}

    def attach(self, params: dict[str, Any] | None) -> dict[str, Any]:
        """``params`` (a copy) with this refusal beside what else is under ``KEY``."""
        params = dict(params or {})
        params[KEY] = {**_under(params, KEY), "reason": self.reason, "error": self.error}
        return params

    @classmethod
    def read(cls, params: Mapping[str, Any] | None) -> Refusal:
        """The refusal on a failed final output ("" where it names none)."""
        fields = _under(params, KEY)
        return cls(reason=str(fields.get("reason") or ""), error=str(fields.get("error") or ""))

"""Request parameters and results shared by the engines, the pipeline and the harness.

Parameters are frozen dataclasses validated on construction; bad values raise
:class:`InvalidRequest`, which names the field (the router maps it to INVALID_ARGUMENT).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

#: Beam search runs W slots in one engine batch (``decode_engine.beam_slots``): an engine
#: takes widths up to its ``max_num_seqs`` and ``max_logprobs / 2`` (step 0 asks for 2W
#: logprobs), within its vocabulary's half.
MAX_BEAM_WIDTH = 512
#: Most alternatives a sampled token's logprobs may list (OpenAI's completions limit).
MAX_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request field with a bad value."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field = field_name
        self.reason = reason


class StageError(RuntimeError):
    """An engine finished a request with an error (e.g. D refused a handoff)."""

    def __init__(self, stage: str, reason: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage = stage
        self.reason = reason


class HandoffError(ValueError):
    """A handoff D must refuse. ``reason`` is a short machine-readable code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Stage1Params:
    """Sampling for stage 1 (thinking)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    #: Sample past EOS: stage 1 ends only at a stop token or max_tokens.
    ignore_eos: bool = False
    #: Neither EOS nor a stop token ends stage 1 before this many tokens.
    min_tokens: int = 0
    #: Drop tokens whose probability is below min_p x the most likely one's (0 = off).
    min_p: float = 0.0
    #: Each token a pure function of (seed, absolute position, logits) (``engine.sampling``):
    #: the same tokens on any engine, in any batch, after any move. Needs a seed.
    positional: bool = False
    #: Return each sampled token's logprob and this many most likely alternatives
    #: (None: no logprobs). vLLM's raw logprobs (the model's, before temperature).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest("stage1.max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("stage1.min_tokens",
                                 f"must be in [0, max_tokens={self.max_tokens}], "
                                 f"got {self.min_tokens}")
        if not self.temperature >= 0:
            raise InvalidRequest("stage1.temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("stage1.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest("stage1.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest("stage1.min_p", f"must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest("stage1.logprobs",
                                 f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.positional and self.seed is None:
            raise InvalidRequest("stage1.seed", "positional sampling needs a seed")


@dataclass(frozen=True)
class Sampling:
    """Sampling as a caller asked for it: None (or empty) where it left a field to the
    one who runs it, which :meth:`resolve` fills in. What every front builds from its
    wire; the engines and the router resolve it with their own defaults."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    positional: bool | None = None
    logprobs: int | None = None

    def resolve(self, *, default_stop_ids: tuple[int, ...] = (),
                default_max_tokens: int = 256, default_positional: bool = False,
                default_seed: int | None = None) -> Stage1Params:
        """The parameters that run (validated: InvalidRequest names a bad field)."""
        return Stage1Params(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k, seed=default_seed if self.seed is None else self.seed,
            stop_token_ids=tuple(self.stop_token_ids) or default_stop_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, min_p=self.min_p,
            positional=default_positional if self.positional is None else self.positional,
            logprobs=self.logprobs)


class Path(IntEnum):
    """Where stage 2 runs (``common.proto``'s ``Path``, the same numbers)."""

    #: The router decides (colocated below its parent-length threshold).
    AUTO = 0
    #: Stage 1 on P, KV handed to D over NIXL, stage 2 on D.
    HANDOFF = 1
    #: Both stages on one prefill engine (the reference and the fallback).
    COLOCATED = 2


#: Largest |length_penalty| accepted (vLLM's beam search uses 0-2 in practice).
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamParams:
    """Beam search for stage 2, with vLLM's beam-search semantics."""

    beam_width: int = 4
    max_tokens: int = 3
    length_penalty: float = 1.0
    ignore_eos: bool = False
    #: Beams stay in this catalog of D's (``engine.catalog``); None: unconstrained.
    catalog: str | None = None

    def __post_init__(self) -> None:
        if self.catalog == "":
            raise InvalidRequest("beam.catalog", "an empty name (leave it unset for none)")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise InvalidRequest(
                "beam.beam_width", f"must be in [1, {MAX_BEAM_WIDTH}], got {self.beam_width}"
            )
        if self.max_tokens < 1:
            raise InvalidRequest("beam.max_tokens", f"must be >= 1, got {self.max_tokens}")
        # Scores divide by len ** length_penalty: beyond this bound a long sequence's
        # power overflows a float (or underflows to 0), which no request means.
        if not abs(self.length_penalty) <= MAX_LENGTH_PENALTY:  # also refuses NaN
            raise InvalidRequest(
                "beam.length_penalty",
                f"must be a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {self.length_penalty:g}")


def check_beam_width(beam_width: int, limit: int, who: str) -> None:
    """``beam_width`` must not exceed ``who``'s limit (an engine's ``max_logprobs / 2``, a
    deployment's configured width)."""
    if beam_width > limit:
        raise InvalidRequest("beam.beam_width", f"{beam_width} exceeds {who}'s limit {limit}")


def validate_token_ids(token_ids: list[int] | tuple[int, ...], *, vocab_size: int,
                       field_name: str) -> None:
    """Every id in ``token_ids`` must be in the vocabulary."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(field_name, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def validate_prompt(
    prompt_token_ids: list[int],
    *,
    vocab_size: int,
    max_model_len: int,
    num_new_tokens: int,
    field_name: str = "prompt",
) -> None:
    """Check a token-id prompt against the model before it reaches an engine."""
    if not prompt_token_ids:
        raise InvalidRequest(field_name, "is empty")
    validate_token_ids(prompt_token_ids, vocab_size=vocab_size, field_name=field_name)
    total = len(prompt_token_ids) + num_new_tokens
    if total > max_model_len:
        raise InvalidRequest(
            field_name,
            f"{len(prompt_token_ids)} prompt tokens + {num_new_tokens} new tokens = {total} "
            f"exceeds the model length {max_model_len}",
        )


def continuation_prompt(parent_ids: list[int], suffix_ids: list[int], think_end_id: int | None) -> list[int]:
    """Stage 2's prompt: the parent then the suffix.

    The default suffix starts with ``</think>``. When stage 1 already ended with
    ``</think>`` (its stop token), that token is not repeated.
    """
    if (
        think_end_id is not None
        and parent_ids
        and suffix_ids
        and parent_ids[-1] == think_end_id
        and suffix_ids[0] == think_end_id
    ):
        suffix_ids = suffix_ids[1:]
    return list(parent_ids) + list(suffix_ids)


@dataclass(slots=True)
class Beam:
    """One finished beam: generated tokens only (the prompt is not repeated)."""

    token_ids: list[int]
    cum_logprob: float
    finish_reason: str  # "length" or "stop" (EOS)
    #: The tokens as text (the router decodes them; "" on the engines).
    text: str = ""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's logprob and the most likely tokens at its position."""

    token_id: int
    logprob: float
    #: (token id, logprob), most likely first.
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Stage1Result:
    token_ids: list[int]
    finish_reason: str
    #: P's returned kv_transfer_params (None unless exported).
    handoff_params: dict | None
    elapsed_s: float
    #: Held on this engine (``hold`` without export) until then, Unix time; 0: not held.
    held_until: float = 0.0
    #: Per token, when ``Stage1Params.logprobs`` asked for them.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: A stage 1 moved here (it imported another P's export): tokens and KV bytes it
    #: imported; and the prompt tokens this engine computed for its first step.
    num_imported_tokens: int = 0
    num_imported_bytes: int = 0
    num_computed_tokens: int = 0
    #: An approximate composition (``connector.blend``): prompt tokens whose KV came from
    #: chunks, and why none did ("" where they did, or none was asked).
    num_blended_tokens: int = 0
    blend_refused: str = ""


@dataclass(slots=True)
class Stage2Result:
    beams: list[Beam]
    #: Prompt tokens of the first beam step (parent + suffix).
    num_prompt_tokens: int
    #: Tokens imported over NIXL for the first step (0 on the colocated path).
    num_imported_tokens: int
    num_imported_bytes: int
    #: Tokens the stage-2 engine computed for the first step / for all steps.
    num_computed_tokens_first_step: int
    num_computed_tokens_total: int
    first_step_s: float
    elapsed_s: float
    step_computed_tokens: list[int] = field(default_factory=list)
    #: See ``decode_engine.beam.BeamSearchOutcome.recomputed_tokens``.
    num_recomputed_beam_tokens: int = 0
    #: D's blocks the import filled (num_imported_bytes = blocks x bytes per block).
    num_imported_blocks: int = 0
    #: See ``decode_engine.beam.BeamSearchOutcome.slot_steps`` (in-process only; not on
    #: the wire).
    beam_steps: dict[str, list[float]] | None = None
    #: Beams fewer than the width asked for (a catalog that could not fill it), and the
    #: live beams left out at the last step for not being whole items.
    num_beams_short: int = 0
    num_dropped_beams: int = 0
    #: The search was stopped to move before its end (``beams`` is then empty): its
    #: state, a ``decode_engine.beam.StoppedSearch`` (in-process only).
    stopped: Any = None

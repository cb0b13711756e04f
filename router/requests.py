"""The router's request API in its own terms: the requests each front builds from its
wire (``router.grpc_wire`` from protobuf for gRPC and Ray Serve, ``router.http`` from
JSON) and the results it writes back. Field names follow ``router.proto``'s, so a wire
converts them one to one; nothing here knows a wire."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvhandoff.types import Beam, BeamParams, Path, Sampling, TokenLogprob

#: A prompt or suffix as given: text (tokenised by the router, once) or token ids.
Prompt = str | list[int]


@dataclass(frozen=True)
class Stage1Call:
    """What a request that runs stage 1 gives (its fields both calls below share)."""

    #: None: the caller gave none (refused by the plan, naming the field).
    prompt: Prompt | None
    stage1: Sampling = Sampling()
    path: Path = Path.AUTO
    request_id: str = ""
    timeout_ms: int = 0
    adapter: str = ""
    #: The prompt starts with these chunks' tokens (a registered chain, root first).
    chunk_ids: tuple[str, ...] = ()
    #: Compose ``chunk_ids`` by position, this share of their tokens recomputed
    #: (``router.composition``; None: only an exact chain).
    recompute_share: float | None = None


@dataclass(frozen=True)
class GenerateCall(Stage1Call):
    """A two-stage request (Generate, GenerateStream)."""

    #: None: the model's default, ``</think>\n<|sid_begin|>``.
    suffix: Prompt | None = None
    beam: BeamParams = BeamParams()
    #: A negative control's fault (``connector.faults``); an operator's call.
    fault: str = ""


@dataclass(frozen=True)
class ParentCall(Stage1Call):
    """Stage 1 as a parent that continuations name (StartParent)."""

    #: The model the caller means (refused when it is not the router's).
    model: str = ""


@dataclass(frozen=True)
class ChunkCall:
    """A named KV chunk to register (RegisterChunk; ``router.chunks``)."""

    tokens: Prompt | None
    chunk_id: str = ""
    #: The chunk it extends ("": a root).
    under: str = ""
    adapter: str = ""
    #: A negative control's P-side fault ("stale": its held blocks overwritten).
    fault: str = ""


@dataclass(frozen=True)
class ContinueCall:
    """Stage 2 of a parent (Continue): beam search, or one sampled sequence."""

    parent_id: str
    suffix: Prompt | None = None
    beam: BeamParams = BeamParams()
    #: Sample one sequence with this instead of beam search.
    sampling: Sampling | None = None
    #: Refuse rather than recompute when the parent's blocks are gone.
    strict: bool = False
    request_id: str = ""
    timeout_ms: int = 0
    model: str = ""
    adapter: str = ""
    fault: str = ""
    #: ``model`` names the base model as the one to run under (vLLM's reading of HTTP's
    #: ``model``): a parent that ran under an adapter is refused, not inherited.
    base_only: bool = False


@dataclass(frozen=True)
class BeamsCall:
    """Beam search over a whole prompt, nothing imported (HTTP's beam search without a
    parent)."""

    prompt: Prompt
    beam: BeamParams = BeamParams()
    adapter: str = ""
    timeout_ms: int = 0
    request_id: str = ""


@dataclass(frozen=True)
class Approximation:
    """An approximate composition's KV (``router.composition``): its chunk tokens whose
    KV P copied, and the share of the chunks' tokens computed instead (1.0 where P
    copied none). A request's, and a parent's, which its continuations carry."""

    num_blended_tokens: int
    recomputed_share: float

    @property
    def approximate(self) -> bool:
        """Flagged wherever P copied any chunk token."""
        return self.num_blended_tokens > 0

    @staticmethod
    def fields_of(approximation: Approximation | None) -> dict[str, Any]:
        """Its wire fields (``approximate``, ``num_blended_tokens``,
        ``recomputed_share``: router.proto's HandoffStats and Parent, the HTTP answer's
        ``kvhandoff``); none for an exact request (None)."""
        if approximation is None:
            return {}
        return {"approximate": approximation.approximate,
                "num_blended_tokens": approximation.num_blended_tokens,
                "recomputed_share": approximation.recomputed_share}


@dataclass
class Move:
    """One move of a running request (Router.Move, Drain, a resume), as it happened: of
    its stage 1, or (``at_beam_step`` > 0) of its stage 2's beam search between Ds."""

    from_endpoint: str = ""
    to_endpoint: str = ""
    at_token: int = 0
    num_imported_tokens: int = 0
    num_computed_tokens: int = 0
    reason: str = ""
    pause_ms: float = 0.0
    num_bytes_moved: int = 0
    at_beam_step: int = 0
    #: A stage 2's move: the engines behind the two endpoints ("" for stage 1's).
    from_engine_id: str = ""
    to_engine_id: str = ""


@dataclass
class Timings:
    stage1_ms: float = 0.0
    stage2_first_step_ms: float = 0.0
    stage2_ms: float = 0.0
    total_ms: float = 0.0
    router_overhead_ms: float = 0.0


@dataclass
class HandoffStats:
    """Where a request ran and what moved (``router.proto`` says what each counts)."""

    path: Path = Path.AUTO
    prefill_endpoint: str = ""
    decode_endpoint: str = ""
    num_parent_tokens: int = 0
    num_imported_tokens: int = 0
    num_bytes_moved: int = 0
    num_computed_tokens_first_step: int = 0
    num_computed_tokens_total: int = 0
    recomputed: bool = False
    failed_decode_endpoint: str = ""
    num_recomputed_beam_tokens: int = 0
    handoff_failure: str = ""
    num_found_on_d_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    prefill_engine_id: str = ""
    decode_engine_id: str = ""
    #: An approximate composition's KV (None: exact, or no chunks).
    approximation: Approximation | None = None


@dataclass
class Result:
    """A served stage 2 (of a two-stage request, a continuation, or beams over a
    prompt): its beams, best first, and how it ran."""

    request_id: str
    prompt_token_ids: list[int]
    thinking_token_ids: list[int]
    thinking_text: str
    stage1_finish_reason: str
    suffix_token_ids: list[int]
    beams: list[Beam]
    timings: Timings
    stats: HandoffStats
    moves: list[Move] = field(default_factory=list)
    num_beams_short: int = 0
    num_dropped_beams: int = 0
    #: The continued parent ("" for a two-stage request).
    parent_id: str = ""
    stage1_seed: int = 0
    stage1_positional: bool = False
    #: The LoRA adapter stage 2 ran under ("": the base model). Not on the gRPC wire.
    adapter: str = ""


@dataclass(frozen=True)
class TokenBatch:
    """A stream item: stage-1 tokens of request ``request_id`` (a parent's id) as P
    sampled them, and their logprobs when the call asked for them (None when not)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class Parent:
    """StartParent's answer: the parent as it stands when stage 1 ended."""

    parent_id: str
    model: str
    adapter: str
    prompt_ids: list[int]
    thinking_ids: list[int]
    thinking_text: str
    thinking_logprobs: list[TokenLogprob]
    finish_reason: str
    held: bool
    not_held_reason: str
    prefill_endpoint: str
    #: When P's hold ends (Unix time); None when it is not held.
    lease_expires_at: float | None
    stage1_ms: float
    #: Its stage-1 sampling as run (None: not known).
    stage1_seed: int | None
    stage1_positional: bool
    #: An approximate composition's KV (None: exact, or no chunks).
    approximation: Approximation | None = None


@dataclass(frozen=True)
class Chunk:
    """A registered named KV chunk (RegisterChunk's answer, ListChunks' items)."""

    chunk_id: str
    under: str
    token_ids: list[int]
    num_chain_tokens: int
    num_blocks: int
    prefill_endpoint: str
    adapter: str
    uses: int
    last_used: float
    prefill_ms: float
    num_cached_tokens: int


@dataclass(frozen=True)
class ChunkListing:
    """ListChunks' answer: the chunks, and per P (by address) the blocks they hold and
    the most they may."""

    chunks: list[Chunk]
    held_blocks: dict[str, int]
    share_blocks: dict[str, int]
    evictions: int


@dataclass(frozen=True)
class Readiness:
    """Whether the router takes work: the roles with no engine taking it, and each
    engine's state by address ("ok", "drained", or why it is out)."""

    missing: list[str]
    engines: dict[str, str]

    @property
    def ready(self) -> bool:
        return not self.missing


@dataclass(frozen=True)
class Moved:
    """Router.Move's answer: stage 1 goes on at ``to_endpoint``."""

    from_endpoint: str
    to_endpoint: str


@dataclass(frozen=True)
class Drained:
    """Router.Drain's answer."""

    endpoint: str
    moved: int = 0
    finished_in_place: int = 0
    failed: int = 0
    #: No request of this router's uses the engine any more.
    empty: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class Released:
    """Router.ReleaseParent's answer: whether P's hold on the parent's blocks ended."""

    parent_id: str
    hold_ended: bool

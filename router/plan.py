"""Requests in, results out: a :class:`~router.requests.GenerateCall` becomes a
:class:`Plan` (all token ids, validated against the engines' vocabulary and context);
what ran (an :class:`Outcome`) becomes a :class:`~router.requests.Result`."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.blend_spec import Blend
from connector.faults import FAULTS
from kvhandoff.model import ModelTokens
from kvhandoff.types import (
    BeamParams,
    InvalidRequest,
    Path,
    Sampling,
    Stage1Params,
    TokenLogprob,
    validate_prompt,
    validate_token_ids,
)
from kvhandoff.v1 import engine_pb2
from router.composition import Composition
from router.requests import (
    Approximation,
    GenerateCall,
    HandoffStats,
    Move,
    ParentCall,
    Prompt,
    Result,
    Timings,
)
from wire import common as convert

if TYPE_CHECKING:
    from router.endpoint import Endpoint


@dataclass(frozen=True)
class ParentLink:
    """A continuation's parent, as its answer reports it."""

    parent_id: str
    #: Its stage-1 sampling as run (None: not known).
    stage1: Stage1Params | None
    #: An approximate composition's KV (None: exact): so the continuation's.
    approximation: Approximation | None


@dataclass
class Plan:
    """A validated two-stage request, all token ids."""

    request_id: str
    prompt_ids: list[int]
    suffix_ids: list[int]
    stage1: Stage1Params
    beam: BeamParams
    path: Path
    deadline: float | None  # time.monotonic() by which the request must be done
    #: (P, D) to use instead of choosing (the router's warm-up).
    pinned: tuple[Endpoint, Endpoint] | None = None
    #: A continuation that samples instead of beam search (``beam`` is then its shape:
    #: width 1, the sampled tokens, which is what D's blocks are claimed for).
    stage2_sampling: Stage1Params | None = None
    #: An injected fault of ``connector.faults`` (negative controls; "" none), sent to
    #: the engine of its side: P with its export, D with its import.
    fault: str = ""
    #: The LoRA adapter both stages run under ("": the base model): engines that serve
    #: it are picked, and a continuation of this parent inherits it.
    adapter: str = ""
    #: The chunks the prompt starts with (``router.chunks``), and the P that holds them:
    #: stage 1 runs there whenever it takes work.
    chunk_ids: tuple[str, ...] = ()
    prefer_prefill: Endpoint | None = None
    #: An approximate composition of those chunks: how P copies them
    #: (``router.composition``; None: an exact chain, or no chunks).
    blend: Blend | None = None
    #: The parent a continuation continues (None: a two-stage request or beams).
    parent: ParentLink | None = None

    @property
    def export_fault(self) -> str:
        return self.fault if self.fault and FAULTS[self.fault].side == "prefill" else ""

    @property
    def import_fault(self) -> str:
        return self.fault if self.fault and FAULTS[self.fault].side != "prefill" else ""


@dataclass
class Outcome:
    plan: Plan
    prefill: str
    decode: str | None
    thinking_ids: list[int] = field(default_factory=list)
    stage1_finish_reason: str = ""
    suffix_ids: list[int] = field(default_factory=list)
    stage2: engine_pb2.Stage2Response | None = None
    stage1_ms: float = 0.0
    total_ms: float = 0.0
    #: Time spent waiting on P's Stage1 stream and D's Stage2 call.
    engine_ms: float = 0.0
    #: The D whose handoff failed (stage 2 was then recomputed on ``decode``).
    failed_decode: str | None = None
    #: Why that handoff failed (the D's status message).
    handoff_failure: str = ""
    #: P holds the parent itself until then (Unix time; Stage1Request hold, no export).
    held_until: float = 0.0
    #: Per stage-1 token, when its sampling asked for logprobs.
    thinking_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Moves of stage 1 (Router.Move, Router.Drain, a resume), as they happened.
    moves: list[Move] = field(default_factory=list)
    #: time.perf_counter() when the last stage-1 token came from P.
    last_token_at: float = 0.0
    #: Prompt tokens stage 1's first engine found in its prefix cache.
    cached_prompt_tokens: int = 0
    #: The engine id of that engine, and of the one stage 1 runs on now (another
    #: after a resume or a move to another P).
    prefill_engine_id: str = ""
    stage1_engine_id: str = ""
    #: Prompt tokens whose KV P copied from chunks (an approximate composition).
    num_blended_tokens: int = 0


def ids_of(tokens: ModelTokens, text_or_ids: Prompt, field_name: str) -> list[int]:
    """Token ids of a prompt or suffix as given (text tokenised, at most 1 MiB of it)."""
    if not isinstance(text_or_ids, str):
        return list(text_or_ids)
    if len(text_or_ids) > 1 << 20:
        raise InvalidRequest(field_name, "longer than 1 MiB")
    return tokens.tokenizer.encode(text_or_ids, add_special_tokens=False)


def suffix_ids_of(suffix: Prompt | None, tokens: ModelTokens) -> list[int]:
    """The continuation suffix a request gives, else the default
    ``</think>\n<|sid_begin|>``."""
    if suffix is None:
        return list(tokens.default_suffix_ids)
    return ids_of(tokens, suffix, "suffix_text" if isinstance(suffix, str) else "suffix")


def stop_ids_of(tokens: ModelTokens, stop: list[str], stop_token_ids: list[int],
                after_think_end: bool) -> tuple[int, ...]:
    """The stop token ids of ``stop_token_ids`` and ``stop`` (strings, each a single
    token: else InvalidRequest on "stop"); with ``after_think_end`` (stage 1 of a
    parent) and any given, ``</think>`` first, which stage 1 stops at when none is."""
    stop_ids = list(stop_token_ids)
    for text in stop:
        ids = tokens.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise InvalidRequest("stop", f"stop strings must be single tokens here; {text!r} "
                                         f"is {len(ids)} (use stop_token_ids)")
        stop_ids += ids
    think_end = tokens.think_end_id
    if stop_ids and after_think_end and think_end is not None:
        stop_ids.insert(0, think_end)
    return tuple(stop_ids)


def sampling_of(asked: Sampling, positional: bool,
                default_stop_ids: tuple[int, ...] = ()) -> Stage1Params:
    """A request's sampling as the router runs it: positional unless it says otherwise
    (``positional`` is the router's default); positional without a seed gets one here
    (returned to the client, so the request can be replayed or continued anywhere)."""
    on = positional if asked.positional is None else asked.positional
    seed = secrets.randbits(63) if on and asked.seed is None else None
    return asked.resolve(default_stop_ids=default_stop_ids, default_positional=positional,
                         default_seed=seed)


def asked_path(req: GenerateCall | ParentCall, has_decode: bool) -> Path:
    """The path ``req`` asks for. A parent is exported to a D when the router has one
    (its continuations run there), unless it asks to be held on P (COLOCATED)."""
    if isinstance(req, GenerateCall):
        return req.path
    return Path.HANDOFF if has_decode and req.path != Path.COLOCATED else Path.COLOCATED


def plan_request(req: GenerateCall | ParentCall, deadline: float | None, *,
                 tokens: ModelTokens, prefill_capacity: engine_pb2.Capacity | None,
                 has_decode: bool, colocated_below_tokens: int,
                 new_id: Callable[[], str], positional: bool = True,
                 composition: Composition | None = None) -> Plan:
    """The one builder of a request's Plan: ``req`` validated (with P's capacity when
    one answered), tokenised once, its path chosen; stage 1 samples positionally unless
    it (or the router, ``positional``) says not. ``composition``: the chunks its
    ``chunk_ids`` resolve to (``router.chunks``), whose tokens the prompt follows (then
    it may be empty) and whose P runs stage 1. A parent (``ParentCall``) is validated
    for the default continuation after it."""
    if req.recompute_share is not None and not req.chunk_ids:
        raise InvalidRequest("recompute_share", "composes chunks: name them (chunk_ids)")
    two_stage = isinstance(req, GenerateCall)
    prefix_ids = composition.prefix_ids if composition is not None else None
    if req.prompt is None and not prefix_ids:
        raise InvalidRequest("prompt", "set prompt_text or prompt_token_ids")
    prompt = list(prefix_ids or []) + ids_of(
        tokens, req.prompt if req.prompt is not None else [],
        "prompt_text" if isinstance(req.prompt, str) else "prompt")
    suffix = suffix_ids_of(req.suffix if two_stage else None, tokens)
    think_end = tokens.think_end_id
    stage1 = sampling_of(req.stage1, positional,
                         default_stop_ids=(think_end,) if think_end is not None else ())
    beam = req.beam if two_stage else BeamParams()
    cap = prefill_capacity
    if cap is not None:
        validate_prompt(prompt, vocab_size=cap.vocab_size, max_model_len=cap.max_model_len,
                        num_new_tokens=stage1.max_tokens + len(suffix) + beam.max_tokens)
        validate_token_ids(suffix, vocab_size=cap.vocab_size, field_name="suffix")
        validate_token_ids(stage1.stop_token_ids, vocab_size=cap.vocab_size,
                           field_name="stage1.stop_token_ids")
    elif not prompt:
        raise InvalidRequest("prompt", "is empty")
    if req.timeout_ms:
        t = time.monotonic() + req.timeout_ms / 1e3
        deadline = t if deadline is None else min(deadline, t)
    request_id = check_request_id(req.request_id or new_id())
    asked = path = asked_path(req, has_decode)
    if path == Path.AUTO:
        longest_parent = len(prompt) + stage1.max_tokens
        path = (Path.COLOCATED if not has_decode or longest_parent < colocated_below_tokens
                else Path.HANDOFF)
    if path == Path.HANDOFF and not has_decode:
        raise InvalidRequest("path", "no decode engine is configured")
    fault = fault_of(req.fault if two_stage else "")
    blend = composition.blend if composition is not None else None
    if blend is not None:
        # Stage 1 is exported and never held or moved: its KV is salted on P and D.
        if asked == Path.COLOCATED:
            raise InvalidRequest("path", "an approximate composition runs stage 2 on "
                                         "a decode engine (path HANDOFF or AUTO)")
        if not has_decode:
            raise InvalidRequest("recompute_share", "an approximate composition runs "
                                 "stage 2 on a decode engine; none is configured")
        if fault and FAULTS[fault].side != "prefill":
            raise InvalidRequest("fault", "a decode-side fault runs under a salt of its "
                                 "own, which an approximate composition's KV refuses")
        path = Path.HANDOFF
    return Plan(request_id, prompt, suffix, stage1, beam, path, deadline, fault=fault,
                adapter=adapter_of(req.adapter), chunk_ids=tuple(req.chunk_ids),
                prefer_prefill=composition.prefill if composition is not None else None,
                blend=blend)


#: What the router names named KV chunks with on the Ps (``router.chunks``): no request's
#: id may start with it (a pin's name, and what a router releases at its start).
CHUNK_PREFIX = "chunk-"


def check_request_id(request_id: str) -> str:
    if len(request_id) > 128:
        raise InvalidRequest("request_id", "longer than 128 characters")
    if request_id.startswith(CHUNK_PREFIX):
        raise InvalidRequest("request_id", f"ids starting {CHUNK_PREFIX!r} are the "
                                           "router's own (named KV chunks)")
    return request_id


def adapter_of(name: str) -> str:
    """The adapter a request names ("": none), checked for shape only: whether an
    engine serves it is the placement's to say (NOT_FOUND)."""
    if len(name) > 128 or not name.isprintable():
        raise InvalidRequest("adapter", "longer than 128 characters or not printable")
    return name


def fault_of(fault: str) -> str:
    """The fault a request names (checked against ``connector.faults``; the engines
    refuse it unless they run with --fault-injection)."""
    if fault and fault not in FAULTS:
        raise InvalidRequest("fault", f"unknown fault {fault!r}; known: "
                                      f"{', '.join(FAULTS)}")
    return fault


def to_result(out: Outcome, tokenizer: Any, received_at: float | None = None) -> Result:
    """The result; ``received_at`` (perf_counter when the call arrived) sets the
    router's own overhead."""
    s2 = out.stage2
    assert s2 is not None
    beams = convert.beams_from_pb(s2.beams)
    for b in beams:
        b.text = tokenizer.decode(b.token_ids, skip_special_tokens=False)
    num_parent_tokens = len(out.plan.prompt_ids) + len(out.thinking_ids)
    parent = out.plan.parent
    stage1 = out.plan.stage1 if parent is None else parent.stage1 or out.plan.stage1
    return Result(
        request_id=out.plan.request_id,
        prompt_token_ids=out.plan.prompt_ids,
        thinking_token_ids=out.thinking_ids,
        thinking_text=tokenizer.decode(out.thinking_ids, skip_special_tokens=False),
        stage1_finish_reason=out.stage1_finish_reason,
        suffix_token_ids=out.suffix_ids,
        beams=beams,
        timings=Timings(
            stage1_ms=out.stage1_ms, stage2_first_step_ms=s2.first_step_ms,
            stage2_ms=s2.total_ms, total_ms=out.total_ms,
            router_overhead_ms=0.0 if received_at is None else max(
                (time.perf_counter() - received_at) * 1e3 - out.engine_ms, 0.0)),
        moves=out.moves,
        num_beams_short=s2.num_beams_short,
        num_dropped_beams=s2.num_dropped_beams,
        stage1_seed=stage1.seed or 0,
        stage1_positional=stage1.positional,
        adapter=out.plan.adapter,
        parent_id=parent.parent_id if parent is not None else "",
        stats=HandoffStats(
            path=out.plan.path, prefill_endpoint=out.prefill, decode_endpoint=out.decode or "",
            num_parent_tokens=num_parent_tokens,
            num_imported_tokens=s2.num_imported_tokens, num_bytes_moved=s2.num_imported_bytes,
            num_computed_tokens_first_step=s2.num_computed_tokens_first_step,
            num_computed_tokens_total=s2.num_computed_tokens_total,
            num_recomputed_beam_tokens=s2.num_recomputed_beam_tokens,
            recomputed=out.failed_decode is not None,
            failed_decode_endpoint=out.failed_decode or "",
            handoff_failure=out.handoff_failure,
            num_found_on_d_tokens=max(0, num_parent_tokens + len(out.suffix_ids)
                                      - s2.num_imported_tokens
                                      - s2.num_computed_tokens_first_step),
            num_cached_prompt_tokens=out.cached_prompt_tokens,
            prefill_engine_id=out.prefill_engine_id,
            decode_engine_id=s2.engine_id,
            approximation=approximation(out) if parent is None else parent.approximation),
    )


def approximation(out: Outcome) -> Approximation | None:
    """What P copied of an approximate composition's chunks (None: not one)."""
    blend = out.plan.blend
    if blend is None:
        return None
    num_chunk_tokens = sum(p.length for p in blend.parts)
    return Approximation(out.num_blended_tokens,
                         1.0 - out.num_blended_tokens / max(num_chunk_tokens, 1))

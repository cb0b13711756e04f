"""The engine wire's own conversions: a handoff between ``common_pb2.Handoff`` and the
``kv_transfer_params`` vLLM's connector and our scheduler read; a stopped beam search
(``decode_engine.beam.StoppedSearch``) and its message. The messages both wires
share (sampling, beams, logprobs): ``wire.common``."""

from __future__ import annotations

from typing import Any

from connector.blend_spec import Blend, BlendPart
from connector.handoff import HANDOFF_FIELDS, TRANSPORT_FIELDS
from connector.params import KEY
from decode_engine.beam import StoppedSearch
from kvhandoff.types import BeamParams, InvalidRequest, validate_token_ids
from kvhandoff.v1 import common_pb2, engine_pb2

#: Transport fields the Handoff message carries as they are (P's engine and request id
#: travel as ``engine_id``/``request_id``, the block ids as a repeated message).
_TRANSPORT_FIELDS = tuple(f for f in TRANSPORT_FIELDS
                          if f not in ("remote_engine_id", "remote_request_id", "remote_block_ids"))


def handoff_to_pb(params: dict[str, Any]) -> common_pb2.Handoff:
    fields = params.get(KEY) or {}
    msg = common_pb2.Handoff(**{k: fields[k] for k in HANDOFF_FIELDS if k in fields})
    for k in _TRANSPORT_FIELDS:
        if params.get(k) is not None:
            setattr(msg, k, params[k])
    for group in params.get("remote_block_ids") or ():
        msg.remote_block_ids.add(ids=list(group))
    return msg


def handoff_from_pb(msg: common_pb2.Handoff) -> dict[str, Any]:
    """P's export params as vLLM's NIXL connector and our D scheduler expect them."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": msg.engine_id,
        "remote_request_id": msg.request_id,
        "remote_num_tokens": msg.num_computed_tokens,
        "remote_block_ids": [list(g.ids) for g in msg.remote_block_ids],
        "transfer_mode": "pull",
        **{k: getattr(msg, k) for k in _TRANSPORT_FIELDS},
        KEY: {k: getattr(msg, k) for k in HANDOFF_FIELDS},
    }


def blend_from_pb(msg: engine_pb2.Stage1Request) -> Blend | None:
    """A stage 1's approximate composition (None: it has none)."""
    if not msg.HasField("blend"):
        return None
    return Blend(tuple(BlendPart(p.source, p.source_start, p.length, p.position)
                       for p in msg.blend.parts), msg.blend.num_loaded)


def stopped_to_pb(stopped: StoppedSearch) -> engine_pb2.StoppedSearch:
    """A search stopped to move, as Stage2Response.stopped (its export as a Handoff)."""
    def beams(pairs):
        return [common_pb2.Beam(token_ids=list(t), cum_logprob=c) for t, c in pairs]

    return engine_pb2.StoppedSearch(
        prompt_token_ids=list(stopped.prompt), live=beams(stopped.live),
        completed=beams(stopped.completed), steps_done=stopped.steps_done,
        members=stopped.members, export=handoff_to_pb(stopped.export))


def stopped_from_pb(msg: engine_pb2.StoppedSearch) -> StoppedSearch:
    """Stage2Request.resume as the engine resumes it (``export``: the kv_transfer_params
    of its Handoff; the cumulative logprobs travel as doubles, exactly)."""
    return StoppedSearch(
        prompt=list(msg.prompt_token_ids),
        live=[(list(b.token_ids), b.cum_logprob) for b in msg.live],
        completed=[(list(b.token_ids), b.cum_logprob) for b in msg.completed],
        steps_done=msg.steps_done, members=msg.members,
        export=handoff_from_pb(msg.export))


def check_stopped(stopped: StoppedSearch, beam: BeamParams, vocab_size: int) -> None:
    """A resume's search is one this beam could have stopped: steps left to run, at most
    W live beams each of ``steps_done`` tokens, at most W slots, every token in the
    vocabulary (INVALID_ARGUMENT otherwise, before anything runs)."""
    def bad(reason: str) -> InvalidRequest:
        return InvalidRequest("resume", reason)

    if not 1 <= stopped.steps_done < beam.max_tokens:
        raise bad(f"steps_done {stopped.steps_done} leaves no step of beam.max_tokens "
                  f"{beam.max_tokens} to run (or none ran)")
    if len(stopped.live) > beam.beam_width:
        raise bad(f"{len(stopped.live)} live beams for a width of {beam.beam_width}")
    if any(len(tokens) != stopped.steps_done for tokens, _ in stopped.live):
        raise bad(f"a live beam without exactly steps_done ({stopped.steps_done}) tokens")
    if not 1 <= stopped.members <= beam.beam_width:
        raise bad(f"members {stopped.members} is not in [1, the width {beam.beam_width}]")
    for tokens, _ in (*stopped.live, *stopped.completed):
        validate_token_ids(tokens, vocab_size=vocab_size, field_name="resume")

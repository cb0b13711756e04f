"""Engine-service conversions between protobuf messages and in-process types."""

from __future__ import annotations

from typing import Any

from connector.handoff import HANDOFF_FIELDS, KEY, TRANSPORT_FIELDS
from kvhandoff.types import Beam, BeamParams, InvalidRequest, Stage1Params, TokenLogprob
from kvhandoff.v1 import common_pb2

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


def stage1_from_pb(msg: common_pb2.Stage1Sampling, *, default_stop_ids: tuple[int, ...] = (),
                   default_max_tokens: int = 256, default_positional: bool = False,
                   default_seed: int | None = None) -> Stage1Params:
    return Stage1Params(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else default_seed,
        stop_token_ids=tuple(msg.stop_token_ids) or default_stop_ids,
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,
        min_p=msg.min_p,
        positional=msg.positional if msg.HasField("positional") else default_positional,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def stage1_to_pb(p: Stage1Params) -> common_pb2.Stage1Sampling:
    msg = common_pb2.Stage1Sampling(max_tokens=p.max_tokens, temperature=p.temperature,
                                    top_p=p.top_p, top_k=p.top_k,
                                    stop_token_ids=list(p.stop_token_ids),
                                    ignore_eos=p.ignore_eos, min_tokens=p.min_tokens,
                                    min_p=p.min_p, positional=p.positional,
                                    logprobs=p.logprobs)
    if p.seed is not None:
        if p.seed < 0:
            raise InvalidRequest("stage1.seed", "must be >= 0")
        msg.seed = p.seed
    return msg


def beam_from_pb(msg: common_pb2.BeamSearch) -> BeamParams:
    return BeamParams(
        beam_width=msg.beam_width if msg.HasField("beam_width") else 4,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else 3,
        length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
        catalog=msg.catalog or None,
    )


def beam_to_pb(p: BeamParams) -> common_pb2.BeamSearch:
    return common_pb2.BeamSearch(beam_width=p.beam_width, max_tokens=p.max_tokens,
                                 length_penalty=p.length_penalty, catalog=p.catalog or "")


def beams_to_pb(beams: list[Beam]) -> list[common_pb2.Beam]:
    return [common_pb2.Beam(token_ids=b.token_ids, cum_logprob=b.cum_logprob,
                            finish_reason=b.finish_reason) for b in beams]


def beams_from_pb(beams) -> list[Beam]:
    return [Beam(token_ids=list(b.token_ids), cum_logprob=b.cum_logprob,
                 finish_reason=b.finish_reason) for b in beams]


def logprobs_to_pb(logprobs: list[TokenLogprob]) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                     top_token_ids=[t for t, _ in lp.top],
                                     top_logprobs=[v for _, v in lp.top]) for lp in logprobs]

"""The messages both wires share (``common.proto``: stage-1 sampling, beam search, beams,
logprobs) to and from the in-process types (``kvhandoff.types``): what the router's and
the engines' gRPC fronts convert at their edges."""

from __future__ import annotations

from kvhandoff.types import (
    Beam,
    BeamParams,
    InvalidRequest,
    Sampling,
    Stage1Params,
    TokenLogprob,
)
from kvhandoff.v1 import common_pb2


def sampling_from_pb(msg: common_pb2.Stage1Sampling) -> Sampling:
    """The sampling ``msg`` asks for: None where a field is unset."""
    def opt(name: str):
        return getattr(msg, name) if msg.HasField(name) else None
    return Sampling(max_tokens=opt("max_tokens"), temperature=opt("temperature"),
                    top_p=opt("top_p"), top_k=msg.top_k, seed=opt("seed"),
                    stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
                    min_tokens=msg.min_tokens, min_p=msg.min_p,
                    positional=opt("positional"), logprobs=opt("logprobs"))


def stage1_from_pb(msg: common_pb2.Stage1Sampling, **defaults) -> Stage1Params:
    """``msg`` resolved with ``defaults`` (:meth:`Sampling.resolve`'s)."""
    return sampling_from_pb(msg).resolve(**defaults)


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
                            finish_reason=b.finish_reason, text=b.text) for b in beams]


def beams_from_pb(beams) -> list[Beam]:
    return [Beam(token_ids=list(b.token_ids), cum_logprob=b.cum_logprob,
                 finish_reason=b.finish_reason, text=b.text) for b in beams]


def logprobs_to_pb(logprobs: list[TokenLogprob]) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob,
                                     top_token_ids=[t for t, _ in lp.top],
                                     top_logprobs=[v for _, v in lp.top]) for lp in logprobs]


def logprobs_from_pb(logprobs) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob,
                         tuple(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))
            for lp in logprobs]

"""The Router service's protobuf (``router.proto``) to and from the request API's types
(``router.requests``): the only module of the router that reads or writes its messages,
used by both gRPC fronts (``router.service``, and Ray Serve's ``deploy.router_server``).
What a conversion finds wrong raises InvalidRequest, which the front answers with
INVALID_ARGUMENT like any other."""

from __future__ import annotations

import dataclasses

from kvhandoff.types import InvalidRequest, Path
from kvhandoff.v1 import common_pb2, router_pb2
from router.requests import (
    Approximation,
    Chunk,
    ChunkCall,
    ChunkListing,
    ContinueCall,
    Drained,
    GenerateCall,
    Moved,
    Parent,
    ParentCall,
    Prompt,
    Released,
    Result,
    TokenBatch,
)
from wire import common

#: The service's full name (health checks and reflection list it).
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


def _text_or_ids(msg, oneof: str) -> Prompt | None:
    which = msg.WhichOneof(oneof)
    if which is None:
        return None
    value = getattr(msg, which)
    return value if isinstance(value, str) else list(value.ids)


def _path(value: int) -> Path:
    try:
        return Path(value)
    except ValueError:
        raise InvalidRequest("path", f"unknown path {value}") from None


def _share(msg: router_pb2.GenerateRequest | router_pb2.ParentRequest) -> float | None:
    return msg.recompute_share if msg.HasField("recompute_share") else None


def generate_call(msg: router_pb2.GenerateRequest) -> GenerateCall:
    return GenerateCall(
        prompt=_text_or_ids(msg, "prompt"), stage1=common.sampling_from_pb(msg.stage1),
        suffix=_text_or_ids(msg, "suffix"), beam=common.beam_from_pb(msg.beam),
        path=_path(msg.path), request_id=msg.request_id, timeout_ms=msg.timeout_ms,
        adapter=msg.adapter, fault=msg.fault, chunk_ids=tuple(msg.chunk_ids),
        recompute_share=_share(msg))


def parent_call(msg: router_pb2.ParentRequest) -> ParentCall:
    return ParentCall(
        prompt=_text_or_ids(msg, "prompt"), stage1=common.sampling_from_pb(msg.stage1),
        path=_path(msg.path), request_id=msg.request_id, timeout_ms=msg.timeout_ms,
        model=msg.model, adapter=msg.adapter, chunk_ids=tuple(msg.chunk_ids),
        recompute_share=_share(msg))


def continue_call(msg: router_pb2.ContinueRequest) -> ContinueCall:
    return ContinueCall(
        parent_id=msg.parent_id, suffix=_text_or_ids(msg, "suffix"),
        beam=common.beam_from_pb(msg.beam),
        sampling=common.sampling_from_pb(msg.sampling) if msg.HasField("sampling") else None,
        strict=msg.strict, request_id=msg.request_id, timeout_ms=msg.timeout_ms,
        model=msg.model, adapter=msg.adapter, fault=msg.fault)


def result_to_pb(result: Result) -> router_pb2.GenerateResponse:
    fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
              if f.name != "adapter"}  # HTTP's answer names it; the proto has no field
    stats = {f.name: getattr(result.stats, f.name) for f in dataclasses.fields(result.stats)
             if f.name != "approximation"}
    return router_pb2.GenerateResponse(**{
        **fields, "beams": common.beams_to_pb(result.beams),
        "timings": router_pb2.Timings(**dataclasses.asdict(result.timings)),
        "stats": router_pb2.HandoffStats(
            **stats, **Approximation.fields_of(result.stats.approximation)),
        "moves": [router_pb2.Move(**dataclasses.asdict(m)) for m in result.moves]})


def event_to_pb(item: TokenBatch | Result) -> router_pb2.GenerateStreamEvent:
    """GenerateStream's event for what the API yields: stage-1 tokens, or the result."""
    if isinstance(item, Result):
        return router_pb2.GenerateStreamEvent(result=result_to_pb(item))
    return router_pb2.GenerateStreamEvent(
        stage1_tokens=common_pb2.TokenIds(ids=item.token_ids))


def parent_event_to_pb(item: TokenBatch | Parent) -> router_pb2.ParentEvent:
    """StartParent's event: stage-1 tokens, or the parent."""
    if isinstance(item, TokenBatch):
        return router_pb2.ParentEvent(stage1_tokens=common_pb2.TokenIds(ids=item.token_ids))
    return router_pb2.ParentEvent(parent=router_pb2.Parent(
        parent_id=item.parent_id, prompt_token_ids=item.prompt_ids,
        thinking_token_ids=item.thinking_ids, thinking_text=item.thinking_text,
        finish_reason=item.finish_reason, held=item.held,
        not_held_reason=item.not_held_reason, prefill_endpoint=item.prefill_endpoint,
        lease_expires_at=item.lease_expires_at or 0.0,
        stage1_ms=item.stage1_ms, model=item.model, adapter=item.adapter,
        stage1_seed=item.stage1_seed or 0, stage1_positional=item.stage1_positional,
        thinking_logprobs=common.logprobs_to_pb(item.thinking_logprobs),
        **Approximation.fields_of(item.approximation)))


def moved_to_pb(moved: Moved) -> router_pb2.MoveResponse:
    return router_pb2.MoveResponse(**dataclasses.asdict(moved))


def drained_to_pb(drained: Drained) -> router_pb2.DrainResponse:
    return router_pb2.DrainResponse(**dataclasses.asdict(drained))


def released_to_pb(released: Released) -> router_pb2.ReleaseParentResponse:
    return router_pb2.ReleaseParentResponse(**dataclasses.asdict(released))


def chunk_call(msg: router_pb2.ChunkRequest) -> ChunkCall:
    return ChunkCall(tokens=_text_or_ids(msg, "tokens"), chunk_id=msg.chunk_id,
                     under=msg.under, adapter=msg.adapter, fault=msg.fault)


def chunk_to_pb(chunk: Chunk) -> router_pb2.Chunk:
    return router_pb2.Chunk(**dataclasses.asdict(chunk))


def chunks_to_pb(listing: ChunkListing) -> router_pb2.ListChunksResponse:
    return router_pb2.ListChunksResponse(
        chunks=[chunk_to_pb(r) for r in listing.chunks], held_blocks=listing.held_blocks,
        share_blocks=listing.share_blocks, evictions=listing.evictions)


def deleted_to_pb(deleted: list[str]) -> router_pb2.DeleteChunkResponse:
    return router_pb2.DeleteChunkResponse(deleted=deleted)

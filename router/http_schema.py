"""OpenAI's completions API as the router's HTTP front reads and writes it: the request
body (:class:`CompletionRequest`, plus the continuation fields), the error body with the
HTTP status of a gRPC code, and the JSON of completions, beams and logprobs. No routing
and no I/O here."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from kvhandoff.types import InvalidRequest, TokenLogprob
from router.requests import Approximation, Chunk, Result

#: gRPC status -> HTTP status of the error body.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}

#: Seconds a client told 429 (router busy) or 503 is asked to wait before it retries.
RETRY_AFTER_S = 1


class CompletionRequest(BaseModel):
    """The fields of OpenAI's completions request this front reads (others are ignored,
    as vLLM's server does), plus the continuation fields."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | list[int] | list[str] | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    min_p: float | None = None
    logprobs: int | None = None
    #: Positional sampling (the router's default unless started with --sampling vllm).
    positional: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    use_beam_search: bool = False
    length_penalty: float | None = None
    #: Keep the beams in this catalog of the engines' (``--catalog NAME=PATH``).
    catalog: str | None = None
    ignore_eos: bool = False
    timeout_ms: int | None = None
    # A continuation of a parent (a previous completion's id).
    continuation_of: str | None = None
    continuation_suffix: str | list[int] | None = None
    #: Refuse rather than recompute when the parent's blocks are gone.
    continuation_strict: bool = False
    #: Negative controls only: a fault of connector.faults injected into the
    #: continuation's import (the decode engine must run with --fault-injection).
    fault: str | None = None
    #: The prompt starts with these named KV chunks (a registered chain, root first);
    #: ``prompt`` is what follows them.
    chunks: list[str] | None = None
    #: Compose ``chunks`` by position even where they are not a chain, this share of
    #: their tokens recomputed (``router.composition``); the answer's ``kvhandoff``
    #: says ``approximate``.
    recompute_share: float | None = None


class ChunkBody(BaseModel):
    """``POST /v1/chunks``: a named KV chunk to register (``router.chunks``)."""

    model_config = ConfigDict(extra="forbid")

    #: Its tokens, as text or token ids.
    prompt: str | list[int]
    chunk_id: str | None = None
    #: The chunk it extends.
    under: str | None = None
    #: The base model or an adapter (its KV is computed under it).
    model: str | None = None


def chunk_json(record: Chunk) -> dict[str, Any]:
    """A chunk as ``/v1/chunks`` answers it."""
    return {"id": record.chunk_id, "object": "kv_chunk", "under": record.under or None,
            "token_ids": record.token_ids, "num_chain_tokens": record.num_chain_tokens,
            "num_blocks": record.num_blocks, "prefill_endpoint": record.prefill_endpoint,
            "adapter": record.adapter or None, "uses": record.uses,
            "last_used": record.last_used, "prefill_ms": record.prefill_ms,
            "num_cached_tokens": record.num_cached_tokens}


def error_response(code: grpc.StatusCode, message: str, param: str | None = None
                   ) -> JSONResponse:
    """OpenAI's error body, with the HTTP status of ``code``; a refusal to retry
    (429, 503) says when, in ``Retry-After``."""
    status = HTTP_STATUS.get(code, 500)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(status_code=status, headers=headers, content={"error": {
        "message": message, "type": code.name.lower(), "param": param, "code": status}})


def unauthorized() -> JSONResponse:
    """401 as OpenAI answers a missing or wrong API key."""
    return JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"}, content={
        "error": {"message": "Incorrect or missing API key: send it as 'Authorization: "
                             "Bearer <key>'", "type": "invalid_request_error", "param": None,
                  "code": "invalid_api_key"}})


def bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(param, message)


def prompt_of(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request, as text or token ids."""
    prompt = body.prompt
    if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise bad("prompt", "give one prompt, as text or as token ids")


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def completion(model: str, request_id: str, choices: list, usage: dict | None,
               **extra: Any) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage,
            **({"kvhandoff": extra} if extra else {})}


def logprobs_json(decode: Callable[[list[int]], str], logprobs: list[TokenLogprob],
                  asked: int | None) -> dict[str, Any] | None:
    """OpenAI's completions ``logprobs`` object: tokens, their logprobs, the most likely
    alternatives at each position, and the tokens' text offsets."""
    if asked is None:
        return None
    tokens = [decode([lp.token_id]) for lp in logprobs]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode([t]): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def beams_json(model: str, resp: Result) -> dict[str, Any]:
    """A stage 2 (continuation or beams over a prompt): one choice per beam, best
    first, how many prompt tokens were imported rather than computed, and the moves of
    its beam search between Ds (``kvhandoff.moves``: router.proto's Move fields; [] when
    it ran where it started)."""
    s = resp.stats
    prompt_tokens = s.num_parent_tokens + len(resp.suffix_token_ids)
    choices = [{"index": i, "text": b.text, "token_ids": list(b.token_ids),
                "cumulative_logprob": b.cum_logprob, "logprobs": None,
                "finish_reason": b.finish_reason or "length", "stop_reason": None}
               for i, b in enumerate(resp.beams)]
    completion_tokens = sum(len(b.token_ids) for b in resp.beams)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens,
             "prompt_tokens_details": {
                 "imported_tokens": s.num_imported_tokens,
                 "cached_tokens": s.num_found_on_d_tokens,
                 "computed_tokens": s.num_computed_tokens_first_step}}
    return completion(model, resp.request_id, choices, usage, parent_id=resp.parent_id,
                      num_beams_short=resp.num_beams_short,
                      num_dropped_beams=resp.num_dropped_beams,
                      recomputed=s.recomputed, handoff_failure=s.handoff_failure,
                      decode_endpoint=s.decode_endpoint,
                      stage2_first_step_ms=resp.timings.stage2_first_step_ms,
                      stage2_ms=resp.timings.stage2_ms,
                      moves=[dataclasses.asdict(m) for m in resp.moves],
                      **Approximation.fields_of(s.approximation))

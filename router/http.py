"""The router's OpenAI-compatible HTTP front (``kvhandoff serve --role router --http-port``),
on FastAPI and uvicorn (the ASGI stack vLLM's own server uses), beside gRPC in the same
process and event loop, over the same :class:`~router.api.RouterAPI` (the ``http`` front:
the same ``max_inflight``, deadlines and statuses as gRPC). Under Ray Serve the same app
is the Router deployment's HTTP ingress, over each replica's API
(``deploy/router_server.py``).

``POST /v1/completions``:

- without ``continuation_of``: stage 1 on P as a parent. The response's ``id`` is the
  parent id; ``stream`` sends its tokens as server-sent events.
- with ``continuation_of: <id>`` (and ``continuation_suffix``, text or token ids; in the
  ``openai`` client, through ``extra_body``): stage 2 as a continuation of that parent.
  With ``use_beam_search``: ``n`` beams of ``max_tokens`` tokens, one choice per beam,
  best first, with its token ids and cumulative logprob; without: one sequence sampled
  with the request's sampling fields (``n`` = 1).
- with ``use_beam_search`` and no ``continuation_of``: beams over the prompt as given.

``usage`` has prompt and completion tokens and, for a continuation, how many prompt tokens
were imported from P rather than computed (``prompt_tokens_details``). Errors use
OpenAI's error body with the HTTP status of the gRPC code (``http_schema.HTTP_STATUS``;
over ``max_inflight``: 429 with ``Retry-After``); a client that disconnects cancels its
request, which frees both pools. ``GET /v1/models``, ``GET /health`` and ``GET /metrics``
(the router's Prometheus registry) complete it. With an API key, every ``/v1`` route
wants ``Authorization: Bearer <key>`` (401 without it), as vLLM's server does; with the
router's certificate it serves HTTPS (and, with a client CA, wants client certificates).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from kvhandoff.types import BeamParams, InvalidRequest, Sampling
from router.api import RouterAPI
from router.auth import CLIENT, OPERATOR, need_of
from router.errors import RouterError
from router.http_schema import (
    ChunkBody,
    CompletionRequest,
    bad,
    beams_json,
    chunk_json,
    completion,
    error_response,
    logprobs_json,
    prompt_of,
    sse,
    unauthorized,
)
from router.requests import Approximation, BeamsCall, ChunkCall, ContinueCall, Parent, ParentCall, TokenBatch

logger = logging.getLogger(__name__)

FRONT = "http"


class HttpFront:
    """The FastAPI app over ``api`` (see the module docstring)."""

    def __init__(self, api: RouterAPI):
        self.api, self.metrics = api, api.metrics
        self.app = FastAPI(title="kvhandoff router", docs_url=None, redoc_url=None)
        app = self.app
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chunks")(self.register_chunk)
        app.get("/v1/chunks")(self.list_chunks)
        app.delete("/v1/chunks/{chunk_id}")(self.delete_chunk)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/ready")(self.ready)
        app.get("/metrics")(self.prometheus)

    @property
    def model_name(self) -> str:
        return self.api.model_name

    def _refusal(self, request: Request, need: str = CLIENT) -> Response | None:
        """The answer for a caller ``router.auth`` refuses (401 as OpenAI answers a
        missing or wrong key; 403 where an operator's key is needed), else None."""
        try:
            self.api.authorize(request.headers.get("authorization"), need)
        except RouterError as e:
            self.api.failed(FRONT, e)  # counted as the gRPC front counts its refusals
            if e.code == grpc.StatusCode.UNAUTHENTICATED and need == CLIENT:
                return unauthorized()
            return error_response(e.code, str(e))
        return None

    async def models(self, request: Request) -> Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        # The adapters as vLLM lists its LoRA modules: models whose parent is the base.
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvhandoff"},
            *({"id": name, "object": "model", "created": 0, "owned_by": "kvhandoff",
               "parent": self.model_name} for name in self.api.adapters())]})

    async def health(self) -> Response:
        """Liveness: the router answers (its engines may be down: restarting the
        router would not bring them back)."""
        return Response(status_code=200)

    async def ready(self) -> Response:
        """Readiness: a P takes work, and a D too when the router has any configured
        (else two-stage requests could only fail or wait); 503 names what is missing."""
        readiness = self.api.readiness()
        if not readiness.ready:
            return JSONResponse(status_code=503, content={
                "ready": False, "missing": readiness.missing, "engines": readiness.engines})
        return JSONResponse({"ready": True})

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        body = await _parsed(request, CompletionRequest)
        if isinstance(body, Response):
            return body
        if (refused := self._refusal(request, need_of(body.fault))) is not None:
            return refused
        try:
            # ``model`` names the base model or an adapter (vLLM's convention); an
            # answer under an adapter names it as its model, as vLLM's does.
            adapter = self.api.adapter_of_model(body.model or "")
            if body.chunks and (body.continuation_of is not None or body.use_beam_search):
                raise bad("chunks", "chunks start a completion's prompt (stage 1); a "
                                    "continuation's parent or a beam search's prompt is whole")
            if body.continuation_of is not None:
                return await _cancel_on_disconnect(self._continuation(body, adapter),
                                                   request)
            if body.use_beam_search:
                return await _cancel_on_disconnect(self._prompt_beams(body, adapter),
                                                   request)
            if body.stream:
                return await self._stream_parent(body, request, adapter)
            return await _cancel_on_disconnect(self._parent(body, adapter), request)
        except (Exception, asyncio.CancelledError) as e:
            return self._fail(e)

    # ---- named KV chunks (router.chunks) ------------------------------------------------
    async def register_chunk(self, request: Request) -> Response:
        if (refused := self._refusal(request)) is not None:
            return refused
        try:
            body = await _parsed(request, ChunkBody)
            if isinstance(body, Response):
                return body
            record = await _cancel_on_disconnect(self.api.register_chunk(FRONT, ChunkCall(
                tokens=body.prompt, chunk_id=body.chunk_id or "", under=body.under or "",
                adapter=self.api.adapter_of_model(body.model or "")), None), request)
            return record if isinstance(record, Response) else JSONResponse(
                chunk_json(record))
        except (Exception, asyncio.CancelledError) as e:
            return self._fail(e)

    async def list_chunks(self, request: Request) -> Response:
        if (refused := self._refusal(request, OPERATOR)) is not None:
            return refused
        listing = await self.api.chunks()
        return JSONResponse({"object": "list", "data": [chunk_json(r) for r in listing.chunks],
                             "held_blocks": listing.held_blocks,
                             "share_blocks": listing.share_blocks,
                             "evictions": listing.evictions})

    async def delete_chunk(self, chunk_id: str, request: Request) -> Response:
        if (refused := self._refusal(request, OPERATOR)) is not None:
            return refused
        try:
            deleted = await self.api.delete_chunk(chunk_id)
        except (Exception, asyncio.CancelledError) as e:
            return self._fail(e)
        return JSONResponse({"id": chunk_id, "object": "kv_chunk", "deleted": deleted})

    def _fail(self, e: BaseException) -> JSONResponse:
        code, message = self.api.failed(FRONT, e)
        return error_response(code, message, e.field if isinstance(e, InvalidRequest) else None)

    # ---- stage 1: a parent --------------------------------------------------------------
    def _parent_call(self, body: CompletionRequest, adapter: str) -> ParentCall:
        if body.n != 1:
            raise bad("n", "sampling returns one sequence; n beams need use_beam_search")
        return ParentCall(
            prompt=prompt_of(body), stage1=self._sampling_of(body, with_think_end=True),
            timeout_ms=body.timeout_ms or 0, model="" if adapter else body.model or "",
            adapter=adapter, chunk_ids=tuple(body.chunks or ()),
            recompute_share=body.recompute_share)

    def _sampling_of(self, body: CompletionRequest, with_think_end: bool) -> Sampling:
        """The sampling ``body`` asks for; its stop token ids are ``stop_token_ids`` and
        single-token ``stop`` strings (after ``</think>`` with ``with_think_end``, which
        stage 1 stops at: none given, the router's default is that alone)."""
        stop_ids = self.api.stop_token_ids(
            [body.stop] if isinstance(body.stop, str) else (body.stop or []),
            list(body.stop_token_ids or []), after_think_end=with_think_end)
        return Sampling(
            max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k if body.top_k is not None and body.top_k > 0 else 0,
            seed=body.seed, stop_token_ids=tuple(stop_ids), ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens or 0, min_p=body.min_p or 0.0,
            positional=body.positional, logprobs=body.logprobs)

    async def _parent(self, body: CompletionRequest, adapter: str) -> JSONResponse:
        call = self._parent_call(body, adapter)
        parent = None
        async with contextlib.aclosing(self.api.start_parent(FRONT, call, None)) as items:
            async for item in items:
                if isinstance(item, Parent):
                    parent = item
        assert parent is not None, "start_parent ended without its parent"
        return JSONResponse(completion(adapter or self.model_name, parent.parent_id, [{
            "index": 0, "text": parent.thinking_text, "token_ids": parent.thinking_ids,
            "logprobs": logprobs_json(self.api.decode, parent.thinking_logprobs,
                                      body.logprobs),
            "finish_reason": parent.finish_reason, "stop_reason": None}],
            _parent_usage(parent), **_parent_info(parent)))

    async def _stream_parent(self, body: CompletionRequest, request: Request,
                             adapter: str) -> Response:
        """Stage 1's tokens as server-sent events. Admitted, planned and run up to its
        first tokens before the response starts, so a refusal (bad input, router busy,
        no P) is an error status, not a broken stream."""
        call = self._parent_call(body, adapter)
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        items = self.api.start_parent(FRONT, call, None)
        try:
            first = await _cancel_on_disconnect(anext(items), request)
        except BaseException:
            await items.aclose()
            raise
        if isinstance(first, Response):  # the client went away first
            await items.aclose()
            return first

        async def events() -> AsyncIterator[str]:
            try:
                item = first
                while True:
                    if not isinstance(item, TokenBatch):
                        yield sse(completion(adapter or self.model_name, item.parent_id, [{
                            "index": 0, "text": "", "logprobs": None,
                            "finish_reason": item.finish_reason, "stop_reason": None}],
                            None, **_parent_info(item)))
                        if include_usage:
                            yield sse(completion(adapter or self.model_name, item.parent_id, [],
                                                 _parent_usage(item)))
                        break
                    logprobs = None
                    if item.logprobs is not None and body.logprobs is not None:
                        logprobs = logprobs_json(self.api.decode, item.logprobs, body.logprobs)
                    yield sse(completion(adapter or self.model_name, item.request_id, [{
                        "index": 0, "text": self.api.decode(item.token_ids),
                        "token_ids": item.token_ids, "logprobs": logprobs,
                        "finish_reason": None}], None))
                    item = await anext(items)
            except Exception as e:  # after the first event: reported in the stream
                yield sse(json.loads(self._fail(e).body))
            finally:  # the client went away (CancelledError) or it ended: P aborts/frees
                await items.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    # ---- stage 2: a continuation, or beam search over a whole prompt --------------------
    @staticmethod
    def _beam_of(body: CompletionRequest) -> BeamParams:
        if body.stream:
            raise bad("stream", "beam search answers once, not as a stream")
        if body.n < 1:
            raise bad("n", "must be >= 1")
        asked = {"max_tokens": body.max_tokens, "length_penalty": body.length_penalty,
                 "catalog": body.catalog or None}  # "": unconstrained, as over gRPC
        return BeamParams(beam_width=body.n,
                          **{k: v for k, v in asked.items() if v is not None})

    async def _continuation(self, body: CompletionRequest, adapter: str) -> JSONResponse:
        if body.use_beam_search:
            beam, sampling = self._beam_of(body), None
        else:
            # A sampled continuation: one sequence, answered once.
            if body.n != 1:
                raise bad("n", "a sampled continuation returns one sequence; n beams "
                               "need use_beam_search")
            if body.stream:
                raise bad("stream", "a continuation answers once, not as a stream")
            beam, sampling = BeamParams(), self._sampling_of(body, with_think_end=False)
        # ``model`` naming the base model means the base model (vLLM's reading): a
        # parent under an adapter is then refused, not inherited.
        result = await self.api.continue_(FRONT, ContinueCall(
            parent_id=body.continuation_of or "", suffix=body.continuation_suffix,
            beam=beam, sampling=sampling, strict=body.continuation_strict,
            timeout_ms=body.timeout_ms or 0, model="" if adapter else body.model or "",
            adapter=adapter, fault=body.fault or "",
            base_only=bool(body.model) and not adapter), None)
        return JSONResponse(beams_json(result.adapter or self.model_name, result))

    async def _prompt_beams(self, body: CompletionRequest, adapter: str) -> JSONResponse:
        """Beam search over ``prompt`` as given, on a D, nothing imported: stage 2 sent
        as a brand-new request."""
        result = await self.api.prompt_beams(FRONT, BeamsCall(
            prompt=prompt_of(body), beam=self._beam_of(body), adapter=adapter,
            timeout_ms=body.timeout_ms or 0), None)
        return JSONResponse(beams_json(adapter or self.model_name, result))


def _parent_usage(parent: Parent) -> dict[str, Any]:
    return {"prompt_tokens": len(parent.prompt_ids),
            "completion_tokens": len(parent.thinking_ids),
            "total_tokens": len(parent.prompt_ids) + len(parent.thinking_ids)}


def _parent_info(parent: Parent) -> dict[str, Any]:
    return {"held": parent.held, "not_held_reason": parent.not_held_reason,
            "lease_expires_at": parent.lease_expires_at, "seed": parent.stage1_seed,
            "positional": parent.stage1_positional,
            **Approximation.fields_of(parent.approximation)}


async def _parsed(request: Request, model: type[Any]) -> Any:
    """The request's JSON body as ``model``, or the 400 that says what is wrong."""
    try:
        return model.model_validate(await request.json())
    except json.JSONDecodeError as e:
        return error_response(grpc.StatusCode.INVALID_ARGUMENT, f"body is not JSON: {e}")
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        return error_response(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{param}: {first['msg']}", param)


async def _cancel_on_disconnect(work: Awaitable[Any], request: Request) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (its cleanup aborts the
    request on P and D) and answer 499. A cancelled caller cancels ``work`` too (Ray
    Serve cancels the handler when its client goes away)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        logger.info("client disconnected: request cancelled")
        return error_response(grpc.StatusCode.CANCELLED, "client disconnected")
    return task.result()

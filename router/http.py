"""The router's OpenAI-compatible HTTP front (``kvhandoff serve --role router --http-port``),
on FastAPI and uvicorn (the ASGI stack vLLM's own server uses), beside gRPC in the same
process and event loop, over the same :class:`~router.core.Router`.

``POST /v1/completions``:

- without ``continuation_of``: stage 1 on P as a parent (``Router.run_parent``). The
  response's ``id`` is the parent id; ``stream`` sends its tokens as server-sent events.
- with ``continuation_of: <id>`` (and ``continuation_suffix``, text or token ids; in the
  ``openai`` client, through ``extra_body``): stage 2 as a continuation of that parent
  (``Router.run_continuation``). With ``use_beam_search``: ``n`` beams of ``max_tokens``
  tokens, one choice per beam, best first, with its token ids and cumulative logprob;
  without: one sequence sampled with the request's sampling fields (``n`` = 1).

``usage`` has prompt and completion tokens and, for a continuation, how many prompt tokens
were imported from P rather than computed (``prompt_tokens_details``). Errors use
OpenAI's error body with the HTTP status of the gRPC code (``HTTP_STATUS``); a client that
disconnects cancels its request, which frees both pools. ``GET /v1/models``,
``GET /health`` and ``GET /metrics`` (the router's Prometheus registry) complete it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError

from kvhandoff.types import InvalidRequest
from kvhandoff.v1 import common_pb2, router_pb2
from router.core import Router
from router.metrics import RouterMetrics
from router.parents import ParentRecord

logger = logging.getLogger(__name__)

#: gRPC status -> HTTP status of the error body.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.FAILED_PRECONDITION: 412,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
}


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
    ignore_eos: bool = False
    timeout_ms: int | None = None
    # A continuation of a parent (a previous completion's id).
    continuation_of: str | None = None
    continuation_suffix: str | list[int] | None = None
    #: Refuse rather than recompute when the parent's blocks are gone.
    continuation_strict: bool = False


def error_response(code: grpc.StatusCode, message: str, param: str | None = None
                   ) -> JSONResponse:
    status = HTTP_STATUS.get(code, 500)
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": code.name.lower(), "param": param, "code": status}})


def _error_of(exc: BaseException) -> JSONResponse:
    from router.service import status_of

    code, message = status_of(exc)
    param = exc.field if isinstance(exc, InvalidRequest) else None
    return error_response(code, message, param)


def _bad(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(param, message)


class HttpFront:
    """The FastAPI app over ``router`` (see the module docstring)."""

    def __init__(self, router: Router, metrics: RouterMetrics):
        self.router, self.metrics = router, metrics
        self.app = FastAPI(title="kvhandoff router", docs_url=None, redoc_url=None)
        app = self.app
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)

    @property
    def model_name(self) -> str:
        return sorted(self.router.model_names, key=len)[0]

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                            "created": 0, "owned_by": "kvhandoff"}]}

    async def health(self) -> Response:
        ok = any(ep.in_rotation for ep in self.router.prefill)
        return Response(status_code=200 if ok else 503)

    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        try:
            body = CompletionRequest.model_validate(await request.json())
        except json.JSONDecodeError as e:
            return error_response(grpc.StatusCode.INVALID_ARGUMENT, f"body is not JSON: {e}")
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"])
            return error_response(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"{param}: {first['msg']}", param)
        try:
            self.router.check_model(body.model or "")
            if body.continuation_of is not None:
                work = self._continuation(body)
            elif body.use_beam_search:
                work = self._prompt_beams(body)
            else:
                if body.stream:
                    return self._stream_parent(body, request)
                work = self._parent(body)
            return await _cancel_on_disconnect(work, request)
        except (Exception, asyncio.CancelledError) as e:
            return self._fail(e)

    def _fail(self, e: BaseException) -> JSONResponse:
        from router.service import status_of

        code, message = status_of(e)
        self.metrics.observe_error(code, message)
        if code == grpc.StatusCode.INTERNAL:
            logger.error("internal error", exc_info=e)
        return _error_of(e)

    # ---- stage 1: a parent --------------------------------------------------------------
    def _parent_plan(self, body: CompletionRequest):
        if body.n != 1:
            raise _bad("n", "sampling returns one sequence; n beams need use_beam_search")
        req = router_pb2.GenerateRequest(
            request_id="", path=common_pb2.PATH_HANDOFF if self.router.decode
            else common_pb2.PATH_COLOCATED)
        prompt = _prompt_of(body)
        if isinstance(prompt, str):
            req.prompt_text = prompt
        else:
            req.prompt_token_ids.ids.extend(prompt)
        stop_ids = self._sampling_of(body, req.stage1)
        if stop_ids:
            think_end = self.router.tokens.think_end_id
            req.stage1.stop_token_ids.extend(
                ([think_end] if think_end is not None else []) + stop_ids)
        if body.timeout_ms:
            req.timeout_ms = body.timeout_ms
        return self.router.plan(req, None)

    def _sampling_of(self, body: CompletionRequest, s: Any) -> list[int]:
        """Fill the Stage1Sampling ``s`` from ``body``; returns its stop token ids
        (``stop_token_ids`` and single-token ``stop`` strings), for the caller to add."""
        if body.max_tokens is not None:
            s.max_tokens = body.max_tokens
        if body.temperature is not None:
            s.temperature = body.temperature
        if body.top_p is not None:
            s.top_p = body.top_p
        if body.top_k is not None and body.top_k > 0:
            s.top_k = body.top_k
        if body.seed is not None:
            s.seed = body.seed
        if body.min_tokens:
            s.min_tokens = body.min_tokens
        if body.min_p:
            s.min_p = body.min_p
        if body.logprobs is not None:
            s.logprobs = body.logprobs
        if body.positional is not None:
            s.positional = body.positional
        s.ignore_eos = body.ignore_eos
        stop_ids = list(body.stop_token_ids or [])
        for text in [body.stop] if isinstance(body.stop, str) else (body.stop or []):
            ids = self.router.tokens.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) != 1:
                raise _bad("stop", f"stop strings must be single tokens here; {text!r} is "
                                   f"{len(ids)} (use stop_token_ids)")
            stop_ids += ids
        return stop_ids

    async def _parent(self, body: CompletionRequest) -> JSONResponse:
        plan = self._parent_plan(body)
        record = None
        async with contextlib.aclosing(self.router.run_parent(plan)) as items:
            async for item in items:
                if isinstance(item, ParentRecord):
                    record = item
        assert record is not None
        text = self.router.tokens.tokenizer.decode(record.thinking_ids,
                                                   skip_special_tokens=False)
        return JSONResponse(self._completion(record.parent_id, [{
            "index": 0, "text": text, "token_ids": record.thinking_ids,
            "logprobs": self._logprobs_json(record.thinking_logprobs, body.logprobs),
            "finish_reason": record.finish_reason, "stop_reason": None}],
            self._parent_usage(record), **self._parent_info(record)))

    def _logprobs_json(self, logprobs: list[Any], asked: int | None) -> dict[str, Any] | None:
        """OpenAI's completions ``logprobs`` object: tokens, their logprobs, the most
        likely alternatives at each position, and the tokens' text offsets."""
        if asked is None:
            return None
        decode = self.router.tokens.tokenizer.decode
        tokens = [decode([lp.token_id], skip_special_tokens=False) for lp in logprobs]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [
                    {decode([t], skip_special_tokens=False): v
                     for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
                    for lp in logprobs],
                "text_offset": offsets}

    def _stream_parent(self, body: CompletionRequest, request: Request) -> Response:
        plan = self._parent_plan(body)  # bad input: an error body, not a broken stream
        include_usage = bool((body.stream_options or {}).get("include_usage"))
        tokenizer = self.router.tokens.tokenizer

        async def events() -> AsyncIterator[str]:
            sent = 0  # stage-1 tokens streamed so far
            try:
                async with contextlib.aclosing(self.router.run_parent(plan)) as items:
                    async for item in items:
                        if isinstance(item, ParentRecord):
                            final = self._completion(item.parent_id, [{
                                "index": 0, "text": "", "logprobs": None,
                                "finish_reason": item.finish_reason, "stop_reason": None}],
                                None, **self._parent_info(item))
                            yield _sse(final)
                            if include_usage:
                                yield _sse(self._completion(item.parent_id, [],
                                                            self._parent_usage(item)))
                        else:
                            text = tokenizer.decode(item, skip_special_tokens=False)
                            record = self.router.parents.get(plan.request_id)
                            logprobs = None
                            if record is not None and body.logprobs is not None:
                                logprobs = self._logprobs_json(
                                    record.thinking_logprobs[sent:sent + len(item)],
                                    body.logprobs)
                            sent += len(item)
                            yield _sse(self._completion(plan.request_id, [{
                                "index": 0, "text": text, "token_ids": item,
                                "logprobs": logprobs, "finish_reason": None}], None))
            except (Exception, asyncio.CancelledError) as e:
                if isinstance(e, asyncio.CancelledError):
                    raise  # the client went away: run_parent's cleanup aborts on P
                err = self._fail(e)
                yield _sse(json.loads(err.body))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _parent_usage(self, record: ParentRecord) -> dict[str, Any]:
        return {"prompt_tokens": len(record.prompt_ids),
                "completion_tokens": len(record.thinking_ids),
                "total_tokens": len(record.prompt_ids) + len(record.thinking_ids)}

    @staticmethod
    def _parent_info(record: ParentRecord) -> dict[str, Any]:
        return {"held": record.held, "not_held_reason": record.not_held_reason,
                "lease_expires_at": record.held_until if record.held else None,
                "seed": record.stage1.seed if record.stage1 else None,
                "positional": bool(record.stage1 and record.stage1.positional)}

    def _completion(self, request_id: str, choices: list, usage: dict | None,
                    **extra: Any) -> dict[str, Any]:
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage,
                **({"kvhandoff": extra} if extra else {})}

    # ---- stage 2: a continuation, or beam search over a whole prompt --------------------
    @staticmethod
    def _beam_of(body: CompletionRequest, req: Any) -> None:
        if body.stream:
            raise _bad("stream", "beam search answers once, not as a stream")
        if body.n < 1:
            raise _bad("n", "must be >= 1")
        req.beam.beam_width = body.n
        if body.max_tokens is not None:
            req.beam.max_tokens = body.max_tokens
        if body.length_penalty is not None:
            req.beam.length_penalty = body.length_penalty

    async def _continuation(self, body: CompletionRequest) -> JSONResponse:
        req = router_pb2.ContinueRequest(parent_id=body.continuation_of,
                                         strict=body.continuation_strict,
                                         model=body.model or "")
        suffix = body.continuation_suffix
        if isinstance(suffix, str):
            req.suffix_text = suffix
        elif suffix is not None:
            req.suffix_token_ids.ids.extend(suffix)
        if body.use_beam_search:
            self._beam_of(body, req)
        else:
            # A sampled continuation: one sequence, answered once.
            if body.n != 1:
                raise _bad("n", "a sampled continuation returns one sequence; n beams "
                                "need use_beam_search")
            if body.stream:
                raise _bad("stream", "a continuation answers once, not as a stream")
            req.sampling.stop_token_ids.extend(self._sampling_of(body, req.sampling))
        if body.timeout_ms:
            req.timeout_ms = body.timeout_ms
        resp = await self.router.run_continuation(req, None)
        return self._beams_response(resp)

    async def _prompt_beams(self, body: CompletionRequest) -> JSONResponse:
        """Beam search over ``prompt`` as given (tokenised here), on a D, nothing
        imported: stage 2 sent as a brand-new request."""
        from server import convert

        req = router_pb2.ContinueRequest()
        self._beam_of(body, req)
        prompt = _prompt_of(body)
        if isinstance(prompt, str):
            if len(prompt) > 1 << 20:
                raise _bad("prompt", "longer than 1 MiB")
            ids = self.router.tokens.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = prompt
        deadline = None if not body.timeout_ms else time.monotonic() + body.timeout_ms / 1e3
        resp = await self.router.run_prompt_beams(ids, convert.beam_from_pb(req.beam), "",
                                                  deadline)
        return self._beams_response(resp)

    def _beams_response(self, resp: router_pb2.GenerateResponse) -> JSONResponse:
        self.metrics.observe(resp)
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
        return JSONResponse(self._completion(resp.request_id, choices, usage,
                                             parent_id=resp.parent_id,
                                             recomputed=s.recomputed,
                                             handoff_failure=s.handoff_failure,
                                             decode_endpoint=s.decode_endpoint,
                                             stage2_first_step_ms=resp.timings.stage2_first_step_ms,
                                             stage2_ms=resp.timings.stage2_ms))


def _prompt_of(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request, as text or token ids."""
    prompt = body.prompt
    if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return prompt
    raise _bad("prompt", "give one prompt, as text or as token ids")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _cancel_on_disconnect(work, request: Request):
    """Run ``work``; if the client disconnects first, cancel it (its cleanup aborts the
    request on P and D) and answer 499."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        logger.info("client disconnected: request cancelled")
        return error_response(grpc.StatusCode.CANCELLED, "client disconnected")
    return task.result()


async def serve_http(router: Router, metrics: RouterMetrics, host: str, port: int):
    """Start the HTTP front on this loop; returns (uvicorn server, task, bound port)."""
    import uvicorn

    front = HttpFront(router, metrics)
    config = uvicorn.Config(front.app, host=host, port=port, log_level="warning",
                            lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the router handles SIGTERM/SIGINT
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start (e.g. the port is taken)
            raise RuntimeError("the HTTP front stopped before it started")
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, task, bound

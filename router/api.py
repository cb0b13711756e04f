"""The one request API under the router's three fronts (``router.service``: gRPC;
``router.http``: OpenAI-compatible HTTP; ``deploy.router_server``: Ray Serve's gRPC
proxy, and ``router.http`` again behind its HTTP proxy, both over a replica's
``deploy.replica_api.ReplicaAPI``). Every
request, whichever front it came in through, is admitted by the same guard
(:class:`Admission`: ``max_inflight`` over all fronts, refused at once beyond it), planned
and run by the same :class:`~router.core.Router`, counted under its front, and its
failure mapped to one status (``router.errors.status_of``) that each front then writes in
its own form (gRPC status, HTTP error body, Serve's proxy status). It takes and gives
the types of ``router.requests``: each front converts its own wire, and reaches the
router through this door only (an import contract in ``pyproject.toml`` holds it)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from router.auth import Credentials
from router.config import RouterConfig
from router.core import Router
from router.endpoint import Endpoint
from router.errors import OVERLOAD_MESSAGE, RouterError, status_of
from router.metrics import RouterMetrics
from router.parents import ParentRecord
from router.plan import Outcome, ids_of, stop_ids_of, to_result
from router.requests import (
    BeamsCall,
    Chunk,
    ChunkCall,
    ChunkListing,
    ContinueCall,
    Drained,
    GenerateCall,
    Moved,
    Parent,
    ParentCall,
    Readiness,
    Released,
    Result,
    TokenBatch,
)

logger = logging.getLogger(__name__)


class Admission:
    """At most ``limit`` requests run at once over every front; the next is refused
    RESOURCE_EXHAUSTED at once (no queue: the client's retry is the queue, and the D
    wait queue inside the router has its own bound). Counted per front in ``metrics``."""

    def __init__(self, limit: int, metrics: RouterMetrics):
        #: None: every request is admitted (no guard: what the flood tests' control runs).
        self.limit: int | None = limit
        self.metrics = metrics
        self.inflight = 0
        #: The most requests admitted at once since the start (or ``reset_peak``).
        self.peak = 0
        #: Running now and the most at once, per front.
        self._by_front: dict[str, int] = {}
        self._front_peak: dict[str, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.inflight
        self.metrics.inflight_peak.set(self.peak)

    @contextlib.contextmanager
    def admit(self, front: str) -> Iterator[None]:
        if self.limit is not None and self.inflight >= self.limit:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{OVERLOAD_MESSAGE}: {self.limit} requests in flight (its "
                              "limit); retry later")
        self.inflight += 1
        if self.inflight > self.peak:
            self.peak = self.inflight
            self.metrics.inflight_peak.set(self.peak)
        self._by_front[front] = self._by_front.get(front, 0) + 1
        if self._by_front[front] > self._front_peak.get(front, 0):
            self._front_peak[front] = self._by_front[front]
            self.metrics.front_inflight_peak.labels(front).set(self._by_front[front])
        gauge = self.metrics.inflight.labels(front)
        gauge.inc()
        try:
            yield
        finally:
            self.inflight -= 1
            self._by_front[front] -= 1
            gauge.dec()


class RouterAPI:
    """What a front calls: each method admits (except the control calls Move and Drain),
    runs and counts one request; failures raise, and :meth:`failed` maps them."""

    def __init__(self, router: Router, metrics: RouterMetrics | None = None,
                 credentials: Credentials | None = None):
        self.router = router
        self.metrics = metrics or RouterMetrics()
        self.admission = Admission(router.config.max_inflight, self.metrics)
        #: Who may call (``router.auth``): checked by every front before anything runs.
        self.credentials = credentials or Credentials()

    @classmethod
    def over_stubs(cls, config: RouterConfig, prefill: Any, decode: Any,
                   new_id: Callable[[], str] | None = None,
                   credentials: Credentials | None = None,
                   stores: Callable[[Endpoint, Endpoint], dict[str, Any]] | None = None,
                   **extra: Any) -> RouterAPI:
        """A router whose P and D are one stub each, standing for all the engines of
        its role (Ray Serve's deployment handles: Serve picks the replica), named by
        ``config``'s first address of each role. ``stores``: the router's ``parents``,
        ``chunk_store`` and ``rotation`` (``router.core.Router``'s keywords), made
        over those two endpoints (None: this process's own). ``extra``: a subclass's
        own keywords (``deploy.replica_api.ReplicaAPI``)."""
        # A stub that finds the engine running each of its stage 2s says so
        # (``finds_runs``): D's beam searches can then be moved between its engines.
        p, d = (Endpoint(address, stub, None, one_engine=False,
                         finds_runs=bool(getattr(stub, "finds_runs", False)))
                for address, stub in ((config.prefill[0], prefill),
                                      (config.decode[0], decode)))
        router = Router(config, endpoints=([p], [d]), new_id=new_id,
                        **(stores(p, d) if stores is not None else {}))
        return cls(router, RouterMetrics(), credentials, **extra)

    def authorize(self, authorization: str | None, need: str) -> None:
        """Raises the refusal for a caller whose ``authorization`` does not grant
        ``need`` (``router.auth.CLIENT`` or ``OPERATOR``; ``router.auth.need_of``)."""
        self.credentials.check(authorization, need)

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    def failed(self, front: str, exc: BaseException,
               time_remaining: float | None = None) -> tuple[grpc.StatusCode, str]:
        """The status for ``exc``, counted under ``front`` and logged when it is ours
        (INTERNAL). A cancel with no time left (``time_remaining``) is the deadline."""
        code, message = status_of(exc)
        if (code == grpc.StatusCode.CANCELLED and time_remaining is not None
                and time_remaining <= 0):
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
        self.metrics.observe_error(code, message, front)
        if code == grpc.StatusCode.INTERNAL:
            logger.error("internal error", exc_info=exc)
        return code, message

    # ---- what the router serves (not admitted) ----------------------------------------
    @property
    def model_name(self) -> str:
        return self.router.config.model_name

    def adapters(self) -> list[str]:
        """The LoRA adapters the engines in rotation serve."""
        return self.router.adapters()

    def adapter_of_model(self, model: str) -> str:
        """OpenAI's ``model`` as vLLM reads it: the base model (""), or one of the
        engines' LoRA adapters by its name; else InvalidRequest."""
        return self.router.adapter_of_model(model)

    def decode(self, token_ids: list[int]) -> str:
        """``token_ids`` as text (special tokens kept, as every answer writes them)."""
        return self.router.tokens.tokenizer.decode(token_ids, skip_special_tokens=False)

    def stop_token_ids(self, stop: list[str], stop_token_ids: list[int],
                       after_think_end: bool) -> tuple[int, ...]:
        """Stop strings (single tokens) and ids as one tuple (``plan.stop_ids_of``)."""
        return stop_ids_of(self.router.tokens, stop, stop_token_ids, after_think_end)

    def readiness(self) -> Readiness:
        """A P takes work, and a D too when the router has any configured (else
        two-stage requests could only fail or wait)."""
        r = self.router
        missing = [role for role, eps in (("prefill", r.prefill), ("decode", r.decode))
                   if (eps or role == "prefill") and not any(ep.takes_work for ep in eps)]
        return Readiness(missing, {
            ep.address: ep.out_reason or ("drained" if ep.draining else "ok")
            for ep in (*r.prefill, *r.decode)})

    def parent_ids(self) -> list[str]:
        """The parents in the registry."""
        return self.router.parents.ids()

    async def ask_engines(self, roles: tuple[str, ...] = ("prefill", "decode"),
                          unless_one_answered: bool = False) -> None:
        """Ask the engines of ``roles`` without a snapshot (never asked, or out after an
        error) for one now; with ``unless_one_answered``, only when none has one."""
        eps = [ep for role in roles
               for ep in (self.router.prefill if role == "prefill" else self.router.decode)]
        if unless_one_answered and any(ep.capacity for ep in eps):
            return
        missing = [ep for ep in eps if ep.capacity is None]
        if missing:
            await self.router.refresh_capacity(missing)

    async def refresh_engines(self) -> None:
        """Ask every engine for a snapshot (one that fails is marked out)."""
        await self.router.refresh_capacity()

    def engines_known(self) -> bool:
        """Every engine has answered with a snapshot."""
        return all(ep.capacity is not None for ep in self.router.pool.endpoints)

    async def warm_up(self) -> dict[str, str]:
        """One handoff off the request path (``router.warmup``): what it did."""
        return await self.router.warm_up()

    # ---- requests (admitted) ----------------------------------------------------------
    async def generate(self, front: str, request: GenerateCall, deadline: float | None
                       ) -> AsyncIterator[TokenBatch | Result]:
        """Generate / GenerateStream: stage-1 token batches as P samples them, then the
        result."""
        received_at = time.perf_counter()
        with self.admission.admit(front):
            plan = self.router.plan(request, deadline)
            with self.router.chunks.using(plan.chunk_ids):
                async with contextlib.aclosing(self.router.run(plan)) as items:
                    async for item in items:
                        if isinstance(item, Outcome):
                            result = to_result(item, self.router.tokens.tokenizer,
                                               received_at)
                            self.metrics.observe(result, front)
                            yield result
                        else:
                            yield TokenBatch(plan.request_id, item)

    async def start_parent(self, front: str, request: ParentCall, deadline: float | None
                           ) -> AsyncIterator[TokenBatch | Parent]:
        """StartParent: stage 1 for P to export to a D (COLOCATED: to hold itself); its
        token batches as P samples them (with their logprobs, when asked), then the
        parent. Planned (validated, tokenised) before it is admitted."""
        plan = self.router.plan(request, deadline)
        with self.admission.admit(front):
            with self.router.chunks.using(plan.chunk_ids):
                async with contextlib.aclosing(self.router.run_parent(plan)) as items:
                    sent = 0  # stage-1 tokens yielded so far
                    async for item in items:
                        if isinstance(item, ParentRecord):
                            self.metrics.observe_served(front)
                            yield self._parent(item)
                            continue
                        logprobs = None
                        if plan.stage1.logprobs is not None:
                            record = self.router.parents.get(plan.request_id)
                            logprobs = (None if record is None else
                                        record.thinking_logprobs[sent:sent + len(item)])
                        sent += len(item)
                        yield TokenBatch(plan.request_id, item, logprobs)

    def _parent(self, r: ParentRecord) -> Parent:
        held = r.held
        return Parent(
            parent_id=r.parent_id, model=r.model, adapter=r.adapter,
            prompt_ids=r.prompt_ids, thinking_ids=r.thinking_ids,
            thinking_text=self.decode(r.thinking_ids), thinking_logprobs=r.thinking_logprobs,
            finish_reason=r.finish_reason, held=held, not_held_reason=r.not_held_reason,
            prefill_endpoint=r.prefill, lease_expires_at=r.held_until if held else None,
            stage1_ms=r.stage1_ms, stage1_seed=r.stage1.seed if r.stage1 else None,
            stage1_positional=bool(r.stage1 and r.stage1.positional),
            approximation=r.approximation)

    async def continue_(self, front: str, request: ContinueCall,
                        deadline: float | None) -> Result:
        """Continue: stage 2 of a parent."""
        with self.admission.admit(front):
            result = await self.router.run_continuation(request, deadline)
        self.metrics.observe(result, front)
        return result

    async def release_parent(self, parent_id: str) -> Released:
        """ReleaseParent (not admitted: it frees room, so it must get through a full
        router)."""
        return await self.router.release_parent(parent_id)

    async def prompt_beams(self, front: str, request: BeamsCall,
                           deadline: float | None) -> Result:
        """Beam search over a whole prompt (nothing imported), under its adapter."""
        ids = ids_of(self.router.tokens, request.prompt, "prompt")
        if request.timeout_ms:
            t = time.monotonic() + request.timeout_ms / 1e3
            deadline = t if deadline is None else min(deadline, t)
        with self.admission.admit(front):
            result = await self.router.run_prompt_beams(
                ids, request.beam, request.request_id, deadline, request.adapter)
        self.metrics.observe(result, front)
        return result

    # ---- named KV chunks (router.chunks) ----------------------------------------------
    async def register_chunk(self, front: str, request: ChunkCall,
                             deadline: float | None) -> Chunk:
        """RegisterChunk: admitted (it runs a prefill on P)."""
        with self.admission.admit(front):
            record = await self.router.chunks.register(request, deadline)
        self.metrics.observe_served(front)
        return record.as_chunk()

    async def chunks(self) -> ChunkListing:
        """ListChunks (async: a front may have to read a store first)."""
        return self.router.chunks.listing()

    async def delete_chunk(self, chunk_id: str) -> list[str]:
        """DeleteChunk (not admitted: it frees room)."""
        return await self.router.chunks.delete(chunk_id)

    # ---- control calls (not admitted: they must get through an overloaded router) ----
    async def move(self, request_id: str, to_endpoint: str = "") -> Moved:
        return await self.router.move(request_id, to=to_endpoint)

    async def drain(self, endpoint: str, timeout_ms: int = 0, undo: bool = False) -> Drained:
        return await self.router.drain(endpoint, (timeout_ms or 300_000) / 1e3, undo=undo)

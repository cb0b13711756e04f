"""The one request API under the router's three fronts (``router.service``: gRPC;
``router.http``: OpenAI-compatible HTTP; ``deploy.router_server``: Ray Serve). Every
request, whichever front it came in through, is admitted by the same guard
(:class:`Admission`: ``max_inflight`` over all fronts, refused at once beyond it), planned
and run by the same :class:`~router.core.Router`, counted under its front, and its
failure mapped to one status (``router.errors.status_of``) that each front then writes in
its own form (gRPC status, HTTP error body, Serve's proxy status). It takes and gives
the types of ``router.requests``: each front converts its own wire."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from kvhandoff.types import BeamParams, Path
from router.auth import Credentials
from router.chunks import ChunkList, ChunkRecord
from router.core import Router
from router.errors import OVERLOAD_MESSAGE, RouterError, status_of
from router.metrics import RouterMetrics
from router.parents import ParentRecord
from router.plan import Outcome, Plan, to_result
from router.requests import (
    ChunkCall,
    ContinueCall,
    Drained,
    GenerateCall,
    Moved,
    ParentCall,
    Released,
    Result,
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

    def authorize(self, authorization: str | None, need: str) -> None:
        """Raises the refusal for a caller whose ``authorization`` does not grant
        ``need`` (``router.auth.CLIENT`` or ``OPERATOR``)."""
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

    # ---- requests (admitted) ----------------------------------------------------------
    async def generate(self, front: str, request: GenerateCall, deadline: float | None
                       ) -> AsyncIterator[list[int] | Result]:
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
                            yield item

    def parent_plan(self, request: ParentCall, deadline: float | None) -> Plan:
        """A StartParent request as a Plan (validated, tokenised): stage 1 for P to export
        to a D (COLOCATED: to hold itself)."""
        router = self.router
        router.check_model(request.model)
        path = (Path.HANDOFF if router.decode and request.path != Path.COLOCATED
                else Path.COLOCATED)
        return router.plan(GenerateCall(
            prompt=request.prompt, stage1=request.stage1, path=path,
            request_id=request.request_id, timeout_ms=request.timeout_ms,
            adapter=request.adapter, chunk_ids=request.chunk_ids,
            recompute_share=request.recompute_share), deadline)

    async def parent(self, front: str, plan: Plan
                     ) -> AsyncIterator[list[int] | ParentRecord]:
        """StartParent of a planned request: token batches, then the ParentRecord."""
        with self.admission.admit(front):
            with self.router.chunks.using(plan.chunk_ids):
                async with contextlib.aclosing(self.router.run_parent(plan)) as items:
                    async for item in items:
                        if isinstance(item, ParentRecord):
                            self.metrics.observe_served(front)
                        yield item

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

    async def prompt_beams(self, front: str, prompt_ids: list[int], beam: BeamParams,
                           deadline: float | None, adapter: str = "") -> Result:
        """Beam search over a whole prompt (nothing imported), under ``adapter``."""
        with self.admission.admit(front):
            result = await self.router.run_prompt_beams(prompt_ids, beam, "", deadline,
                                                        adapter)
        self.metrics.observe(result, front)
        return result

    # ---- named KV chunks (router.chunks) ----------------------------------------------
    async def register_chunk(self, front: str, request: ChunkCall,
                             deadline: float | None) -> ChunkRecord:
        """RegisterChunk: admitted (it runs a prefill on P)."""
        with self.admission.admit(front):
            record = await self.router.chunks.register(request, deadline)
        self.metrics.observe_served(front)
        return record

    def chunks(self) -> ChunkList:
        return self.router.chunks.listing()

    async def delete_chunk(self, chunk_id: str) -> list[str]:
        """DeleteChunk (not admitted: it frees room)."""
        return await self.router.chunks.delete(chunk_id)

    # ---- control calls (not admitted: they must get through an overloaded router) ----
    async def move(self, request_id: str, to_endpoint: str = "") -> Moved:
        return await self.router.move(request_id, to=to_endpoint)

    async def drain(self, endpoint: str, timeout_ms: int = 0, undo: bool = False) -> Drained:
        return await self.router.drain(endpoint, (timeout_ms or 300_000) / 1e3, undo=undo)

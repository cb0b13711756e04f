"""``Router``: the router's parts, wired. It owns nothing but the wiring; each part owns
its state:

- ``pool`` (:class:`~router.pool.EnginePool`): the engines and the picks, over their
  snapshots and rotation (``router.snapshots``) and the claims on D's room and the D
  wait queue (``router.decode_queue``);
- ``parents`` (a :class:`~router.parents.ParentStore`): parents kept for continuations;
- ``stages`` (:class:`~router.stages.StageCalls`): the plain engine calls;
- ``desk`` (:class:`~router.moves.MoveDesk`): requests running now, moves and drains
  (which engines are drained: a :class:`~router.rotation.Rotation`);
- ``executor`` (:class:`~router.executor.Executor`): a two-stage request's run;
- ``continuations`` (:class:`~router.continuations.Continuations`): parents, their
  continuations, beams over a whole prompt;
- ``chunks`` (:class:`~router.chunks.Chunks`): named KV chunks held on the Ps (kept in
  a :class:`~router.chunk_registry.ChunkStore`);
- ``warmup`` (:class:`~router.warmup.WarmUp`).

A request's Plan is built by ``router.plan.plan_request`` alone. The fronts (gRPC, HTTP,
Ray Serve) reach the router through ``router.api`` only (an import contract), which
admits, plans, runs and maps errors the same way for each.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Callable

from kvhandoff.model import ModelTokens
from kvhandoff.types import BeamParams, InvalidRequest
from router import placement
from router.chunk_registry import ChunkStore
from router.chunks import Chunks
from router.config import RouterConfig
from router.continuations import Continuations
from router.endpoint import Endpoint
from router.executor import Executor, Items
from router.moves import MoveDesk
from router.parents import ParentRecord, ParentRegistry, ParentStore
from router.plan import Plan, plan_request
from router.pool import EnginePool
from router.requests import (
    ContinueCall,
    Drained,
    GenerateCall,
    Moved,
    ParentCall,
    Released,
    Result,
)
from router.rotation import Rotation
from router.snapshots import connect
from router.stages import StageCalls
from router.warmup import WarmUp


class Router:
    def __init__(self, config: RouterConfig,
                 endpoints: tuple[list[Endpoint], list[Endpoint]] | None = None,
                 new_id: Callable[[], str] | None = None, *,
                 parents: ParentStore | None = None, chunk_store: ChunkStore | None = None,
                 rotation: Rotation | None = None):
        """``endpoints`` (P, D) replace gRPC channels to ``config``'s addresses (the Ray
        Serve router passes deployment handles). ``new_id`` makes the ids of requests
        that name none (Serve's router replicas make ids they own). ``parents``,
        ``chunk_store``, ``rotation``: stores to use instead of this process's own."""
        self.config = config
        self._ids = itertools.count()
        self.new_id = new_id or (lambda: f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}")
        self.tokens = ModelTokens.load(config.model)
        prefill, decode = endpoints if endpoints is not None else connect(config)
        self.pool = EnginePool(config, prefill, decode)
        self.parents: ParentStore = parents if parents is not None else ParentRegistry(
            config.max_parents, config.parent_ttl_s, config.parent_pool_share)
        self.stages = StageCalls(self.tokens, config.capacity_timeout_s)
        self.desk = MoveDesk(self.pool, self.stages, rotation)
        self.executor = Executor(config, self.pool, self.stages, self.desk)
        self.continuations = Continuations(config, self.tokens, self.pool, self.parents,
                                           self.stages, self.executor)
        self.warmup = WarmUp(self.tokens, self.pool, self.stages, self.executor)
        self.chunks = Chunks(config, self.tokens, self.pool, self.stages, chunk_store)

    @property
    def prefill(self) -> list[Endpoint]:
        return self.pool.prefill

    @property
    def decode(self) -> list[Endpoint]:
        return self.pool.decode

    async def close(self) -> None:
        self.warmup.close()
        await self.pool.close()

    def check_model(self, model: str) -> None:
        """InvalidRequest unless ``model`` is empty or names the model served here."""
        if model and model not in self.config.model_names:
            raise InvalidRequest("model", f"{model!r} is not served here (this router "
                                          f"serves {self.config.model_name!r})")

    def adapters(self) -> list[str]:
        """The LoRA adapters the engines in rotation serve."""
        return sorted({name for ep in self.pool.endpoints if ep.capacity is not None
                       for name in placement.adapters_of(ep)})

    def adapter_of_model(self, model: str) -> str:
        """OpenAI's ``model`` as vLLM reads it: the base model (""), or one of the
        engines' LoRA adapters by its name; else InvalidRequest."""
        if not model or model in self.config.model_names:
            return ""
        if model in self.adapters():
            return model
        raise InvalidRequest("model", f"{model!r} is not served here (this router serves "
                                      f"{self.config.model_name!r} and the adapters "
                                      f"{self.adapters() or 'none'})")

    def plan(self, req: GenerateCall | ParentCall, deadline: float | None) -> Plan:
        """``req`` validated (against P's vocabulary and context, once P answered) and
        tokenised once: every later step works on token ids. Its chunks (a registered
        chain) are the prompt's start, and their P is where stage 1 runs."""
        if isinstance(req, ParentCall):
            self.check_model(req.model)
        composition = (self.chunks.compose(req.chunk_ids, req.adapter, req.recompute_share)
                       if req.chunk_ids else None)
        return plan_request(
            req, deadline, tokens=self.tokens,
            prefill_capacity=next((ep.capacity for ep in self.prefill if ep.capacity), None),
            has_decode=bool(self.decode),
            colocated_below_tokens=self.config.colocated_below_tokens,
            new_id=self.new_id, positional=self.config.positional_sampling,
            composition=composition)

    def run(self, plan: Plan) -> Items:
        return self.executor.run(plan)

    def run_parent(self, plan: Plan) -> AsyncIterator[list[int] | ParentRecord]:
        return self.continuations.run_parent(plan)

    async def run_continuation(self, req: ContinueCall, deadline: float | None) -> Result:
        self.check_model(req.model)
        return await self.continuations.run_continuation(req, deadline)

    async def release_parent(self, parent_id: str) -> Released:
        return await self.continuations.release_parent(parent_id)

    async def run_prompt_beams(self, prompt_ids: list[int], beam: BeamParams,
                               request_id: str, deadline: float | None, adapter: str = ""
                               ) -> Result:
        return await self.continuations.run_prompt_beams(prompt_ids, beam, request_id,
                                                         deadline, adapter)

    async def move(self, request_id: str, reason: str = "move",
                   to: str = "") -> Moved:
        return await self.desk.move(request_id, reason, to)

    async def drain(self, address: str, timeout_s: float = 300.0,
                    undo: bool = False) -> Drained:
        return await self.desk.drain(address, timeout_s, undo)

    async def warm_up(self, timeout_s: float = 120.0) -> dict[str, str]:
        return await self.warmup.warm_up(timeout_s)

    async def refresh_capacity(self, endpoints: list[Endpoint] | None = None) -> None:
        await self.pool.refresh_capacity(self.pool.endpoints if endpoints is None
                                         else endpoints)

    async def poll_capacity(self) -> None:
        await self.pool.poll_capacity()

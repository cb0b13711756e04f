"""The router's warm-up: one tiny handoff per (P, D) pair and one tiny move per ordered
pair of Ps before serving, and again in the background for the pairs of an engine that
answers after being down (the pool calls :meth:`WarmUp.pairs_of` through ``on_back``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from kvhandoff.model import ModelTokens
from kvhandoff.types import BeamParams, Path, Stage1Params
from router.endpoint import Endpoint
from router.executor import Executor
from router.plan import Outcome, Plan
from router.pool import EnginePool
from router.requests import Move
from router.stages import StageCalls

logger = logging.getLogger(__name__)

#: How long the warm-up of an engine that is back may keep it from new work, per pair.
BACK_WARM_UP_S = 30.0


class WarmUp:
    def __init__(self, tokens: ModelTokens, pool: EnginePool, stages: StageCalls,
                 executor: Executor):
        self.tokens, self.pool, self.stages, self.executor = tokens, pool, stages, executor
        self._tasks: set[asyncio.Task] = set()

    def close(self) -> None:
        self.pool.on_back = None
        for task in self._tasks:
            task.cancel()

    async def warm_up(self, timeout_s: float = 120.0,
                      pairs: list[tuple[Endpoint, Endpoint]] | None = None) -> dict[str, str]:
        """One tiny handoff per reachable (P, D) pair and one tiny move per ordered pair
        of Ps (``pairs``: those only). On their first handoff D adds P as a NIXL remote
        agent, with P's lease already running, which can take seconds
        (docs/decisions.md, "Router warm-up"). The router pays that before it serves, not
        a client; after the first full warm-up, again in the background for the pairs of
        an engine that answers after being down (restarted). A warm-up that fails is
        logged; the router serves anyway. Returns what happened per pair ("P -> D":
        "imported", "recomputed" or "failed: ..."); unreachable pairs are left out."""
        pool = self.pool
        everything = pairs is None
        if everything:
            pairs = [*itertools.product(pool.prefill, pool.decode),
                     *itertools.permutations(pool.prefill, 2)]
        outcomes: dict[str, str] = {}
        for i, (p, d) in enumerate(pairs):
            if p.capacity is None or d.capacity is None:
                continue
            pair = f"{p.address} -> {d.address}"
            if pool.is_prefill(d):
                outcomes[pair] = await self._warm_up_move(p, d, timeout_s)
            else:
                outcomes[pair] = await self._warm_up_handoff(i, p, d, timeout_s)
            pool.observer.warm_up(p.address, d.address, outcomes[pair].split(":")[0])
        if everything:
            pool.on_back = self._warm_up_later
        return outcomes

    async def _warm_up_handoff(self, i: int, p: Endpoint, d: Endpoint,
                               timeout_s: float) -> str:
        pair, t0 = f"{p.address} -> {d.address}", time.perf_counter()
        plan = Plan(f"warmup-{i}-{uuid.uuid4().hex[:8]}", list(range(10, 50)),
                    list(self.tokens.default_suffix_ids),
                    Stage1Params(max_tokens=2, temperature=0.0),
                    BeamParams(beam_width=1, max_tokens=1), Path.HANDOFF,
                    time.monotonic() + timeout_s, pinned=(p, d))
        try:
            how = "failed: no outcome"
            async for item in self.executor.run(plan):
                if isinstance(item, Outcome):
                    how = "recomputed" if item.failed_decode else "imported"
                    logger.info("warm-up %s: %s in %.1fs", pair, how,
                                time.perf_counter() - t0)
            return how
        except Exception as e:  # logged; serve anyway
            logger.warning("warm-up %s failed after %.1fs: %s", pair,
                           time.perf_counter() - t0, e)
            return f"failed: {e}"

    async def _warm_up_move(self, p: Endpoint, p2: Endpoint, timeout_s: float) -> str:
        """A move's first READ between two Ps, before serving: P samples 2 tokens and
        exports them to P2, which imports them, samples one more and exports it held,
        released at once (nothing stays held until a lease ends)."""
        pair, t0 = f"{p.address} -> {p2.address}", time.perf_counter()
        name = f"warmup-move-{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + timeout_s

        def plan(max_tokens: int) -> Plan:
            return Plan(name, list(range(10, 50)), [], Stage1Params(max_tokens=max_tokens,
                                                                    temperature=0.0),
                        BeamParams(beam_width=1, max_tokens=1), Path.HANDOFF,
                        deadline, pinned=(p, p2))

        try:
            first = plan(2)
            out = Outcome(first, p.address, None)
            handoff = held = None
            async for item in self.stages.stage1(p, p2, first, out, export=True,
                                                 request_id=f"{name}-1"):
                handoff = item if not isinstance(item, list) else handoff
            move = Move()
            async for item in self.stages.stage1(p2, None, plan(3), out, export=True,
                                                 hold=True, request_id=f"{name}-2",
                                                 import_from=handoff, move=move):
                held = item if not isinstance(item, list) else held
            if held is not None:
                await self.stages.release(p2, [held.request_id])
            how = "imported" if move.num_imported_tokens else "recomputed"
            logger.info("warm-up %s: %s in %.1fs", pair, how, time.perf_counter() - t0)
            return how
        except Exception as e:  # logged; serve anyway
            logger.warning("warm-up %s failed after %.1fs: %s", pair,
                           time.perf_counter() - t0, e)
            return f"failed: {e}"

    def pairs_of(self, ep: Endpoint) -> list[tuple[Endpoint, Endpoint]]:
        """The pairs ``ep`` is part of (what to warm up again when it comes back)."""
        pool = self.pool
        if not pool.is_prefill(ep):
            return [(p, ep) for p in pool.prefill]
        others = [p for p in pool.prefill if p is not ep]
        return [*((ep, d) for d in pool.decode), *((ep, p) for p in others),
                *((p, ep) for p in others)]

    def _warm_up_later(self, ep: Endpoint) -> None:
        if not self.pool.decode:
            return
        logger.info("engine %s answers again: no new work until its pairs are warmed up",
                    ep.address)
        ep.warming = True
        task = asyncio.create_task(self._warm_up_back(ep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm_up_back(self, ep: Endpoint) -> None:
        """The pairs of ``ep``, back after being out of rotation, before it takes work
        again: a NIXL connection the outage broke fails its first READ (the warm-up's,
        recomputed) and the next one connects anew."""
        t0 = time.perf_counter()
        try:
            outcomes = await self.warm_up(timeout_s=BACK_WARM_UP_S, pairs=self.pairs_of(ep))
            logger.info("engine %s takes work again after %.1fs of warm-up: %s",
                        ep.address, time.perf_counter() - t0, outcomes)
        except Exception as e:  # logged; it serves anyway
            logger.warning("engine %s takes work again; its warm-up failed after %.1fs: %s",
                           ep.address, time.perf_counter() - t0, e)
        finally:
            ep.warming = False
            self.pool.room_changed()

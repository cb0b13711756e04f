"""The router's warm-up: one tiny handoff per (P, D) pair and one tiny move per ordered
pair of Ps before serving, and again in the background for the pairs of an engine that
answers after being down. Mixed into ``router.core.Router``."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from typing import TYPE_CHECKING

from kvhandoff.types import BeamParams, Stage1Params
from kvhandoff.v1 import common_pb2, engine_pb2, router_pb2
from router.plan import Outcome, Plan

if TYPE_CHECKING:
    from kvhandoff.model import ModelTokens
    from router.capacity import Endpoint

logger = logging.getLogger(__name__)


class WarmUpMixin:
    prefill: list[Endpoint]
    decode: list[Endpoint]
    tokens: ModelTokens
    _rewarm: bool
    _warming: set[asyncio.Task]
    # Also uses ``run`` and ``_stage1`` (router.core.Router).

    async def warm_up(self, timeout_s: float = 120.0,
                      pairs: list[tuple[Endpoint, Endpoint]] | None = None) -> dict[str, str]:
        """One tiny handoff per reachable (P, D) pair (``pairs``: those only). On their
        first handoff D adds P as a NIXL remote agent, with P's lease already running,
        which can take seconds (docs/decisions.md, "Router warm-up"). The router pays that
        before it serves, not
        a client, and again in the background for the pairs of an engine that answers
        after being down (restarted). A warm-up that fails is logged; the router serves
        anyway. Returns what happened per pair ("P -> D": "imported", "recomputed" or
        "failed: ..."); unreachable pairs are left out."""
        everything = pairs is None
        if everything:
            pairs = [*itertools.product(self.prefill, self.decode),
                     *itertools.permutations(self.prefill, 2)]
        outcomes: dict[str, str] = {}
        for i, (p, d) in enumerate(pairs):
            if p.capacity is None or d.capacity is None:
                continue
            pair = f"{p.address} -> {d.address}"
            if any(d is other for other in self.prefill):
                outcomes[pair] = await self._warm_up_move(p, d, timeout_s)
                continue
            t0 = time.perf_counter()
            plan = Plan(f"warmup-{i}-{uuid.uuid4().hex[:8]}", list(range(10, 50)),
                        list(self.tokens.default_suffix_ids),
                        Stage1Params(max_tokens=2, temperature=0.0),
                        BeamParams(beam_width=1, max_tokens=1), common_pb2.PATH_HANDOFF,
                        time.monotonic() + timeout_s, pinned=(p, d))
            try:
                async for item in self.run(plan):
                    if isinstance(item, Outcome):
                        how = "recomputed" if item.failed_decode else "imported"
                        outcomes[pair] = how
                        logger.info("warm-up %s: %s in %.1fs", pair, how,
                                    time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 (logged; serve anyway)
                outcomes[pair] = f"failed: {e}"
                logger.warning("warm-up %s failed after %.1fs: %s", pair,
                               time.perf_counter() - t0, e)
        if everything:
            self._rewarm = True
        return outcomes

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
                        BeamParams(beam_width=1, max_tokens=1), common_pb2.PATH_HANDOFF,
                        deadline, pinned=(p, p2))

        try:
            first = plan(2)
            out = Outcome(first, p.address, None)
            handoff = held = None
            async for item in self._stage1(p, p2, first, out, export=True,
                                           request_id=f"{name}-1"):
                handoff = item if not isinstance(item, list) else handoff
            move = router_pb2.Move()
            async for item in self._stage1(p2, None, plan(3), out, export=True, hold=True,
                                           request_id=f"{name}-2", import_from=handoff,
                                           move=move):
                held = item if not isinstance(item, list) else held
            if held is not None:
                await p2.stub.Release(engine_pb2.ReleaseRequest(request_ids=[held.request_id]),
                                      timeout=timeout_s)
            how = "imported" if move.num_imported_tokens else "recomputed"
            logger.info("warm-up %s: %s in %.1fs", pair, how, time.perf_counter() - t0)
            return how
        except Exception as e:  # noqa: BLE001 (logged; serve anyway)
            logger.warning("warm-up %s failed after %.1fs: %s", pair,
                           time.perf_counter() - t0, e)
            return f"failed: {e}"

    def _warm_up_later(self, ep: Endpoint) -> None:
        if not self.decode:
            return
        if any(ep is p for p in self.prefill):
            others = [p for p in self.prefill if p is not ep]
            pairs = [*((ep, d) for d in self.decode), *((ep, p) for p in others),
                     *((p, ep) for p in others)]
        else:
            pairs = [(p, ep) for p in self.prefill]
        logger.info("engine %s answers again: warming up its pairs", ep.address)
        task = asyncio.create_task(self.warm_up(pairs=pairs))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

"""CapacityRouter: Ray Serve routes each handoff to the D replica that can hold it.

D replicas report their free KV blocks (``EngineServer.record_routing_stats``, polled by
Serve); a Stage2 call carries the blocks it needs (``blocks_needed``). Replicas that fit
come first, most free blocks first; if none fits the call still goes to the one with the
most free blocks, whose scheduler refuses it at admission with RESOURCE_EXHAUSTED (the
standalone router's semantics). Calls without a need use Serve's own order.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


def _free_blocks(replica: RunningReplica) -> int:
    stats: dict[str, Any] = replica.routing_stats or {}
    return int(stats.get("free_blocks", -1))


class CapacityRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        need = int((pending_request.kwargs or {}).get("blocks_needed", 0)) if pending_request else 0
        if not need:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=_free_blocks, reverse=True)
        fitting = [r for r in ranked if _free_blocks(r) >= need]
        if not fitting:
            return [ranked[:1]]
        return [fitting, [r for r in ranked if r not in fitting]]

"""Ray Serve request routers of the application's deployments.

``CapacityRouter`` (Decode): each handoff goes to the D replica that can hold it. D
replicas report their free KV blocks (``EngineServer.record_routing_stats``, polled by
Serve); a Stage2 call carries the blocks it needs (``blocks_needed``). Replicas that fit
come first, most free blocks first; if none fits the call still goes to the one with the
most free blocks, whose scheduler refuses it at admission with RESOURCE_EXHAUSTED (the
standalone router's semantics). Calls without a need use Serve's own order.

``OwnerRouter`` (Router): a call naming a parent or a running request goes to the router
replica that owns its id (``deploy.affinity``); router replicas report their rank
(``RouterServer.record_routing_stats``). Until the owner's rank is known (a replica
starting, or being replaced) the call waits in Serve's queue, within the client's
deadline. A handle call with a ``rank`` keyword goes to that replica (only handles pass
keywords; the gRPC proxy passes the client's message alone). Calls naming neither use
Serve's own order.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deploy.affinity import owner, routing_key


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


class OwnerRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # A handle call may name its replica (``rank=``): the operator's per-replica calls.
        want = (pending_request.kwargs or {}).get("rank")
        key = "" if want is not None else routing_key(pending_request.metadata.call_method,
                                                      pending_request.args)
        if want is None and not key:
            return [candidate_replicas]
        stats = [(r, r.routing_stats or {}) for r in candidate_replicas]
        world = max((int(s.get("world_size", 0)) for _, s in stats), default=0)
        if world == 0:
            # No rank reported yet: one replica owns every id; several wait for the poll.
            return [candidate_replicas] if len(candidate_replicas) == 1 else [[]]
        if want is None:
            want = owner(key, world)
        return [[r for r, s in stats if s.get("rank") == want]]

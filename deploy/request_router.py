"""Ray Serve request routers of the application's deployments.

``CapacityRouter`` (Decode): each handoff goes to the D replica that can hold it. D
replicas report their free KV blocks (``EngineServer.record_routing_stats``, polled by
Serve); a Stage2 call carries the blocks it needs (``blocks_needed``). Replicas that fit
come first, most free blocks first; if none fits the call still goes to the one with the
most free blocks, whose scheduler refuses it at admission with RESOURCE_EXHAUSTED (the
standalone router's semantics). A continuation carries its parent's id (``affinity``):
of the replicas that fit, it goes first to the parent's own (``affinity.rendezvous``),
where its earlier continuations left the parent's KV in the prefix cache. A moved beam
search's resume names the engine it was stopped on (``avoid``): it goes to another
replica (to that one only when no other runs: its engine refuses it, and the router
recomputes the stage 2). A call naming an engine (``engine``: the Stop of a stage 2,
to the replica running it) goes to the replica reporting that engine id, or, if none
does any more, to any (which drops a Stop of a search it does not run). Calls without
a need use Serve's own order. Each change of the running set is told to
``deploy.leaving`` (a stopping D replica moves its searches out).

``OwnerRouter`` (Router): a call naming a parent or a running request goes to the router
replica that owns its id (``deploy.affinity``); router replicas report their rank
(``RouterServer.record_routing_stats``). Until the owner's rank is known (a replica
starting, or being replaced) the call waits in Serve's queue, within the client's
deadline. A handle call with a ``rank`` keyword goes to that replica (only handles pass
keywords; the gRPC proxy passes the client's message alone). Calls naming neither use
Serve's own order.

``PrefillRouter`` (Prefill): a call naming an engine (``engine``: Stop and Release of
what one P replica runs or holds) goes to the replica running it (replicas report their
engine ids), or, if none does any more, to any. A call carrying its prompt (``prefix``:
the adapter and the token ids, as ``HandleStub`` passes them) goes to the P replica
whose prefix cache holds most of it, against its queue, by the standalone router's rule (``router.placement``:
an outstanding request weighs ``LOAD_TOKENS`` cached tokens). It follows each replica's
vLLM KV events as the standalone router follows each engine's
(``router.cache_feed.EngineCaches``): replicas report where they publish them, their
queue and their Ray node (``EngineServer.record_routing_stats``); events on loopback are
followed only from the replica's own node (others: placed by queue alone); CURVE events
need the key (``kv_events_key_file``, from ``request_router_kwargs``). The best replica
comes first, the others after it (Serve takes the next when the first is full).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deploy.affinity import owner, rendezvous, routing_key
from deploy.leaving import replicas_changed
from kvhandoff.ports import is_loopback

logger = logging.getLogger("kvhandoff.deploy")

#: Serve's backoff index for PrefillRouter's queue probes: its first deadline (0.1 s by
#: default) doubled three times, 0.8 s, capped by ``RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_
#: DEADLINE_S``; a loaded node answers late, and a stage 1 runs for seconds.
_PROBE_BACKOFF = 3


def _free_blocks(replica: RunningReplica) -> int:
    stats: dict[str, Any] = replica.routing_stats or {}
    return int(stats.get("free_blocks", -1))


def _engine_of(replica: RunningReplica) -> str:
    return str((replica.routing_stats or {}).get("engine_id", ""))


class CapacityRouter(RequestRouter):
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if replicas:  # a D replica's own handle: it may have left the set (deploy.leaving)
            replicas_changed(replicas[0].replica_id.deployment_id.name,
                             (r.replica_id.unique_id for r in replicas))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        kwargs = (pending_request.kwargs or {}) if pending_request else {}
        engine, avoid = kwargs.get("engine"), kwargs.get("avoid")
        if engine:
            named = [r for r in candidate_replicas if _engine_of(r) == engine]
            return [named] if named else [candidate_replicas]
        if avoid:
            candidate_replicas = ([r for r in candidate_replicas if _engine_of(r) != avoid]
                                  or candidate_replicas)
        need = int(kwargs.get("blocks_needed", 0))
        if not need:
            return [candidate_replicas]
        ranked = sorted(candidate_replicas, key=_free_blocks, reverse=True)
        fitting = [r for r in ranked if _free_blocks(r) >= need]
        if not fitting:
            return [ranked[:1]]
        rest = [r for r in ranked if r not in fitting]
        if kwargs.get("affinity"):
            # A parent's continuations: the first fitting replica in the key's own order
            # (where its earlier ones ran and left the parent's KV cached), then the
            # others by room. Any D may redeem the group's handoff, so one that is gone
            # or full costs a READ from P, never a recompute.
            first, *others = rendezvous(kwargs["affinity"], fitting,
                                        lambda r: r.replica_id.unique_id)
            return [group for group in ([first], others, rest) if group]
        return [fitting, rest]


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


class PrefillRouter(RequestRouter):
    def initialize_state(self, kv_events_key_file: str | None = None, **_: Any) -> None:
        from router.cache_feed import EngineCaches

        keys = None
        if kv_events_key_file:
            from kvhandoff.event_keys import EventKeys

            keys = EventKeys.from_file(kv_events_key_file)
        self.caches = EngineCaches(logger, keys=keys)
        self._node_id: str | None = None

    def _here(self) -> str:
        if self._node_id is None:
            import ray

            self._node_id = ray.get_runtime_context().get_node_id()
        return self._node_id

    def _view(self, replica: RunningReplica) -> SimpleNamespace:
        """The replica as ``router.placement`` scores an engine; its events followed
        (started on its first report that names them, again when they change)."""
        stats: dict[str, Any] = replica.routing_stats or {}
        name = replica.replica_id.unique_id
        endpoint = str(stats.get("kv_events_endpoint", ""))
        host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
        if endpoint and (stats.get("node_id") == self._here() or not is_loopback(host)):
            # Named by its replica id (not an IP): EngineCaches takes the endpoint as
            # reachable, which the node check above has said.
            self.caches.follow(name, SimpleNamespace(
                kv_events_endpoint=endpoint,
                kv_events_replay_endpoint=stats.get("kv_events_replay_endpoint", ""),
                kv_events_curve=bool(stats.get("kv_events_curve")),
                block_size=int(stats.get("block_size", 0)) or 1,
                num_total_blocks=int(stats.get("num_total_blocks", 0))))
        else:
            self.caches.forget(name)
        # Its queue: what Serve's handle knows is running there (kept current as calls
        # are sent and end, asked of the replica when stale: ``_refresh_queues``), else
        # the engine's own count as of its last report (a second or more old: a burst
        # that has ended still weighs against its cache there).
        sent = self._replica_queue_len_cache.get(replica.replica_id)
        outstanding = int(stats.get("outstanding", 0)) if sent is None else sent
        return SimpleNamespace(address=name, replica=replica, outstanding=outstanding,
                               block_size=int(stats.get("block_size", 0)))

    async def _refresh_queues(self, replicas: list[RunningReplica]) -> None:
        """Ask the replicas whose count in the handle is stale (no call sent or ended
        there within ``RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S``) for their queue, as
        Serve's own router does before it chooses: one short actor call each, within
        ``_PROBE_BACKOFF``'s deadline. One that does not answer keeps no count (its
        engine's last report is used)."""
        stale = [r for r in replicas if self._replica_queue_len_cache.get(r.replica_id) is None]
        if stale:
            await self._probe_queue_lens(stale, _PROBE_BACKOFF)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        caches = getattr(self, "caches", None)  # None before Serve's initialize_state
        live = {r.replica_id.unique_id for r in replicas}
        for name in caches.addresses() if caches is not None else ():
            if name not in live:
                caches.forget(name)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        from router import placement

        kwargs = (pending_request.kwargs or {}) if pending_request else {}
        engine = kwargs.get("engine")
        if engine:
            named = [r for r in candidate_replicas
                     if (r.routing_stats or {}).get("engine_id") == engine]
            return [named] if named else [candidate_replicas]
        prefix = kwargs.get("prefix")
        if not prefix or not candidate_replicas:
            return [candidate_replicas]
        adapter, token_ids = prefix
        await self._refresh_queues(candidate_replicas)
        views = [self._view(r) for r in candidate_replicas]
        picker = placement.Picker(filters=(), scorers=(
            placement.cached_prefix(
                lambda v: self.caches.cached_blocks(v.address, token_ids, adapter or None),
                lambda v: v.block_size),
            placement.queue()))
        ranked = [v.replica for _, v in picker.ranked(views)]
        return [ranked[:1], ranked[1:]]

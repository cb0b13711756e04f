"""The engine deployment: one vLLM engine per P or D replica (``EngineServer``), serving
the same calls as ``kvhandoff serve --role prefill|decode`` (the same
:class:`~server.engine_service.EngineServicer` runs them), with protobuf bytes in and out,
over deployment handles instead of a gRPC port."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from ray import serve

from deploy.leaving import LeaveWatch
from engine import EngineConfig
from kvhandoff.model import resolve_model
from kvhandoff.v1 import engine_pb2
from server.engine_service import make_servicer, start_engine

logger = logging.getLogger("kvhandoff.deploy")


class EngineCallError(Exception):
    """An engine replica's refusal, with the gRPC status the standalone server sends."""

    def __init__(self, code_name: str, message: str):
        super().__init__(f"{code_name}: {message}")
        self.code_name, self.message = code_name, message

    def __reduce__(self):  # crosses process boundaries inside Ray's error wrapper
        return (EngineCallError, (self.code_name, self.message))


class _CallContext:
    """The slice of a gRPC servicer context ``EngineServicer`` uses."""

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise EngineCallError(code.name, message)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


@serve.deployment
class EngineServer:
    """One P or D engine. Started in ``__init__`` (Serve marks the replica ready after)."""

    async def __init__(self, role: str, model: str, engine_kwargs: dict[str, Any],
                       side_channel_host: str | None = None, side_channel_port: int = 0,
                       drain_s: float = 0.0):
        self.role = role
        self.drain_s = drain_s
        model_dir = str(resolve_model(model))
        port = None
        if side_channel_port:
            # A fixed range: this replica's rank within its deployment picks its port.
            port = side_channel_port + serve.get_replica_context().rank.rank
        host = side_channel_host or _node_ip()
        if engine_kwargs.get("catalogs"):
            from kvhandoff.builtin.generate import builtin_catalog

            engine_kwargs = {**engine_kwargs, "catalogs": tuple(
                (name, str(builtin_catalog(model_dir)) if path == "builtin" else path)
                for name, path in engine_kwargs["catalogs"])}
        config = EngineConfig(model=model_dir, role=role, side_channel_host=host,
                              side_channel_port=port, **engine_kwargs)
        self.servicer = make_servicer(role, model_dir)
        self.engine = await start_engine(self.servicer, config)
        # Its searches move out only where the engine outlives the calls long enough for
        # the other replicas to read the stopped searches' exports (``drain_s``).
        self.leave_watch = self._watch_leaving() if role == "decode" and drain_s else None
        logger.info("%s replica ready: engine %s, NIXL side channel %s", role,
                    self.engine.engine_id, host)

    def _watch_leaving(self) -> LeaveWatch:
        """D: once Serve stops this replica, its searches move to the others
        (``deploy.leaving``). A handle to its own deployment, whose request router
        (CapacityRouter) follows the running set; its first call starts that."""
        context = serve.get_replica_context()
        engine = self.engine
        watch = LeaveWatch(context.deployment, context.replica_id.unique_id,
                           asyncio.get_running_loop(), self.servicer.running_ids,
                           lambda ids: engine.stop_searches(ids, engine.handoff_target))
        watch.start()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        self._own = handle.capacity.remote()  # any replica's answer; kept, never read
        return watch

    # The keyword arguments after the request (``blocks_needed``, ``prefix``, ``engine``,
    # ``affinity``, ``avoid``) are read by the deployment's request router
    # (``deploy.request_router``) before the call lands here: nothing in the replica
    # uses them.

    async def stage1(self, request: bytes, prefix: tuple = ()) -> AsyncIterator[bytes]:
        req = engine_pb2.Stage1Request.FromString(request)
        async for event in self.servicer.Stage1(req, _CallContext()):
            yield event.SerializeToString()

    async def stage2(self, request: bytes, blocks_needed: int = 0, prefix: tuple = (),
                     affinity: str = "", avoid: str = "") -> AsyncIterator[bytes]:
        """Stage2, streamed as two items: this replica's engine id as the call starts (a
        Stop of the stage 2 names it: ``HandleStub``), then the Stage2Response."""
        yield self.engine.engine_id.encode()
        req = engine_pb2.Stage2Request.FromString(request)
        yield (await self.servicer.Stage2(req, _CallContext())).SerializeToString()

    async def stage2_stream(self, request: bytes, blocks_needed: int = 0,
                            prefix: tuple = (), affinity: str = "") -> AsyncIterator[bytes]:
        req = engine_pb2.Stage2Request.FromString(request)
        async for event in self.servicer.Stage2Stream(req, _CallContext()):
            yield event.SerializeToString()

    async def capacity(self, engine: str = "", avoid: str = "") -> bytes:
        cap = await self.servicer.GetCapacity(engine_pb2.CapacityRequest(), _CallContext())
        return cap.SerializeToString()

    async def stop(self, request: bytes, engine: str = "") -> bytes:
        req = engine_pb2.StopRequest.FromString(request)
        return (await self.servicer.Stop(req, _CallContext())).SerializeToString()

    async def release(self, request: bytes, engine: str = "") -> bytes:
        req = engine_pb2.ReleaseRequest.FromString(request)
        return (await self.servicer.Release(req, _CallContext())).SerializeToString()

    def info(self) -> dict[str, Any]:
        import vllm

        return {"role": self.role, "engine_id": self.engine.engine_id,
                "vllm_version": vllm.__version__,
                "model_fingerprint": self.servicer.model_fingerprint,
                "block_size": self.engine.block_size}

    def _pool_counts(self) -> dict[str, int]:
        """The engine's pool as both the request routers and the autoscaling policy read
        it: free and total KV blocks, and its queue (requests running or waiting)."""
        snap = self.engine.pool()
        return {"free_blocks": snap.num_free_blocks,
                "num_total_blocks": snap.num_total_blocks,
                "outstanding": snap.num_running_reqs + snap.num_waiting_reqs}

    def record_autoscaling_stats(self) -> dict[str, int]:
        """What the application's autoscaling policy (``deploy.autoscale``) sizes P and D
        by; Serve calls it every ``metrics_interval_s`` and averages over
        ``look_back_period_s``."""
        return self._pool_counts()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the request routers route by (Serve polls it): D's free blocks
        (CapacityRouter); P's engine id, queue and where its KV events are published,
        with the Ray node it runs on (PrefillRouter follows them: loopback events only
        from its own node)."""
        import ray

        events = self.engine.kv_events
        return {"engine_id": self.engine.engine_id, **self._pool_counts(),
                "block_size": self.engine.block_size,
                "node_id": ray.get_runtime_context().get_node_id(),
                "kv_events_endpoint": events.endpoint if events else "",
                "kv_events_replay_endpoint": events.replay_endpoint if events else "",
                "kv_events_curve": bool(events and events.keyed)}

    def check_health(self) -> None:
        if self.engine.llm.errored:
            raise RuntimeError(f"engine {self.engine.engine_id} has failed")

    async def __del__(self) -> None:
        """Serve calls it when it stops the replica, once the calls running here have
        ended (no new ones reach it by then). A scale-down must not drop what the engine
        still holds for calls to come, which are not Serve calls: P's exports until D
        reads them (NIXL, engine to engine) and its held parents until their leases end
        (their continuations read them). So the engine runs until its pool is clean, at
        most ``drain_s`` seconds (the deployment's ``graceful_shutdown_timeout_s``
        leaves room for it); what is still held then is dropped, and its continuation
        recomputed (flagged)."""
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        if getattr(self, "leave_watch", None) is not None:
            self.leave_watch.close()
        if self.drain_s > 0:
            snap = await engine.wait_pool_clean(self.drain_s)
            if not snap.is_clean:
                logger.warning("%s stops with KV still held after %.0f s: %s",
                               engine.engine_id, self.drain_s, snap)
        engine.shutdown()

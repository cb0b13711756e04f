"""The Engine gRPC service: one engine (P or D) behind a thin grpc.aio servicer.

Started by ``kvhandoff serve --role prefill|decode``. Binds 127.0.0.1 by default, serves
gRPC health (SERVING once the engine is up) and server reflection. With an engine key
(``kvhandoff.keys``) every Engine call without it is refused UNAUTHENTICATED before it
runs; health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from connector.handoff import ImportRequest
from decode_engine.engine import DecodeEngine, run_beam_stage, run_sample_stage
from engine import EngineConfig, VllmEngine
from kvhandoff.errors import status_for
from kvhandoff.keys import guard_servicer
from kvhandoff.model import ModelTokens, model_fingerprint
from kvhandoff.tls import ServerTLS
from kvhandoff.types import BeamParams, InvalidRequest
from kvhandoff.v1 import engine_pb2, engine_pb2_grpc
from prefill_engine.engine import PINNED, PrefillEngine
from server import convert as engine_pb
from server.metrics import LOOP_LAG, HandoffCounts, serve_metrics
from wire import common
from wire.grpc_server import set_serving, start_server, wait_for_shutdown_signal, watch_loop_lag

logger = logging.getLogger(__name__)

ENGINE_DESCRIPTOR = engine_pb2.DESCRIPTOR.services_by_name["Engine"]
ENGINE_SERVICE = ENGINE_DESCRIPTOR.full_name

class EngineStarting(RuntimeError):
    """The server is up but its engine is still loading."""


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, EngineStarting):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is starting")
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("internal error", exc_info=exc)
    await context.abort(code, message)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, role: str, model_fingerprint: str, think_end_id: int | None):
        #: Set once the engine is up; until then every call is UNAVAILABLE.
        self.engine: Any = None
        self.role = role
        self.model_fingerprint = model_fingerprint
        self.default_stop_ids = (think_end_id,) if think_end_id is not None else ()
        # request_id -> the task serving it, so Abort can cancel it (which aborts the
        # request and its beam requests inside vLLM).
        self._tasks: dict[str, asyncio.Task] = {}
        self.counts = HandoffCounts()

    def running_ids(self) -> list[str]:
        """The request ids of the calls this servicer runs now."""
        return list(self._tasks)

    @contextlib.contextmanager
    def _track(self, request_id: str):
        if self.engine is None:
            raise EngineStarting()
        if not request_id:
            raise InvalidRequest("request_id", "is empty")
        if request_id in self._tasks:
            raise InvalidRequest("request_id", f"{request_id!r} is already running")
        self._tasks[request_id] = asyncio.current_task()
        try:
            yield
        finally:
            self._tasks.pop(request_id, None)

    async def Stage1(self, request: engine_pb2.Stage1Request, context):
        try:
            if self.role != "prefill":
                raise InvalidRequest("role", "stage 1 runs on a prefill engine")
            params = common.stage1_from_pb(request.sampling,
                                              default_stop_ids=self.default_stop_ids)
            handoff = None
            if request.HasField("handoff"):  # a stage 1 moved here from another P
                handoff = ImportRequest.for_beams(
                    engine_pb.handoff_from_pb(request.handoff),
                    BeamParams(beam_width=1, max_tokens=params.max_tokens))
            with self._track(request.request_id):
                async for new, logprobs, result in self.engine.stream_stage1(
                    list(request.prompt_token_ids), params, request.request_id,
                    export=request.export, target=request.target_engine_id,
                    hold=request.hold and (PINNED if request.pin else request.hold_s or True),
                    handoff=handoff,
                    fault=request.fault or None, adapter=request.adapter,
                    blend=engine_pb.blend_from_pb(request),
                ):
                    if result is None:
                        yield engine_pb2.Stage1Event(
                            new_token_ids=new, logprobs=common.logprobs_to_pb(logprobs),
                            engine_id=self.engine.engine_id)
                        continue
                    event = engine_pb2.Stage1Event(
                        finish_reason=result.finish_reason, held_until=result.held_until,
                        num_imported_tokens=result.num_imported_tokens,
                        num_imported_bytes=result.num_imported_bytes,
                        num_computed_tokens=result.num_computed_tokens,
                        num_blended_tokens=result.num_blended_tokens,
                        blend_refused=result.blend_refused,
                        engine_id=self.engine.engine_id)
                    if result.handoff_params:
                        event.handoff.CopyFrom(engine_pb.handoff_to_pb(result.handoff_params))
                        self.counts.exports += 1
                    if handoff is not None:
                        self.counts.imports += 1
                    yield event
        except Exception as e:  # mapped to a status; the engine keeps serving
            if request.HasField("handoff"):
                self.counts.import_failures += 1
            await abort_with(context, e)

    async def Stage2(self, request: engine_pb2.Stage2Request, context):
        try:
            return await self._stage2(request)
        except Exception as e:
            await abort_with(context, e)

    async def Stage2Stream(self, request: engine_pb2.Stage2Request, context):
        """Stage2 with its sampled tokens streamed. The stage runs in its own task (the
        one Abort cancels); a client that goes away cancels it too."""
        try:
            if not request.HasField("sampling"):
                raise InvalidRequest("sampling", "Stage2Stream streams a sampled stage 2")
            batches: asyncio.Queue[list[int]] = asyncio.Queue()
            task = asyncio.create_task(self._stage2(request, batches.put_nowait))
            try:
                while not task.done() or not batches.empty():
                    getter = asyncio.ensure_future(batches.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if getter.done():
                        yield engine_pb2.Stage2Event(new_token_ids=getter.result())
                    else:
                        getter.cancel()
                yield engine_pb2.Stage2Event(result=task.result())
            finally:
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
        except Exception as e:
            await abort_with(context, e)

    async def _stage2(self, request: engine_pb2.Stage2Request,
                      on_tokens=None) -> engine_pb2.Stage2Response:
        """Stage 2 (beam search, or sampled with ``on_tokens`` told of each batch)."""
        beam = common.beam_from_pb(request.beam)
        sampling = None
        if request.HasField("sampling"):
            # A sampled stage 2: empty stop_token_ids means EOS only.
            sampling = common.stage1_from_pb(request.sampling)
            beam = BeamParams(beam_width=1, max_tokens=sampling.max_tokens)
        prompt = list(request.prompt_token_ids)
        if request.fault and not request.HasField("handoff"):
            raise InvalidRequest("fault", "a fault is injected into an import: it needs a "
                                          "handoff")
        moved = None
        if request.HasField("resume"):  # a search stopped on another D goes on here
            if self.engine is None:
                raise EngineStarting()
            if sampling is not None:
                raise InvalidRequest("resume", "a resumed stage 2 is a beam search")
            if request.resume.export.engine_id == self.engine.engine_id:
                # Its blocks here are an export now: another D reads them.
                raise InvalidRequest("resume", "the search was stopped on this engine: it "
                                               "resumes on another")
            moved = engine_pb.stopped_from_pb(request.resume)
            engine_pb.check_stopped(moved, beam, self.engine.vocab_size)
            if moved.prompt != prompt:
                raise InvalidRequest("resume", "prompt_token_ids is not the stopped "
                                               "search's prompt")
            request.handoff.CopyFrom(request.resume.export)
        with self._track(request.request_id):
            if request.HasField("handoff"):
                if self.role != "decode":
                    raise InvalidRequest("handoff", "imports run on a decode engine")
                logger.debug("%s: stage 2 received, P's lease ends in %.2fs",
                             request.request_id,
                             request.handoff.lease_expires_at - time.time())
                # A cancel that reached this server with the call (both waited in the
                # socket of a D that was frozen or busy) is handed to this task as a
                # CancelledError by gRPC's own coroutine, which runs after the code up
                # to our first yield: without this yield the import went to vLLM first,
                # and D read an export nobody wanted (docs/decisions.md, "D never runs
                # the import"). The cancel lands here, before the import is submitted.
                await asyncio.sleep(0)
                try:
                    result = await self.engine.run_stage2(
                        prompt, beam, request.request_id, handoff=ImportRequest.for_beams(
                            engine_pb.handoff_from_pb(request.handoff), beam,
                            fault=request.fault or None),
                        sampling=sampling, on_tokens=on_tokens, adapter=request.adapter,
                        moved=moved)
                except Exception:
                    self.counts.import_failures += 1
                    raise
                self.counts.imports += 1
            elif sampling is not None:
                result = await run_sample_stage(self.engine, prompt, sampling,
                                                request.request_id,
                                                held_parent=request.held_parent,
                                                on_tokens=on_tokens, adapter=request.adapter)
            else:
                result = await run_beam_stage(self.engine, prompt, beam, request.request_id,
                                              held_parent=request.held_parent,
                                              adapter=request.adapter)
        stopped = None
        if result.stopped is not None:
            stopped = engine_pb.stopped_to_pb(result.stopped)
            self.counts.exports += 1
        return engine_pb2.Stage2Response(
            stopped=stopped,
            beams=common.beams_to_pb(result.beams),
            num_imported_tokens=result.num_imported_tokens,
            num_imported_bytes=result.num_imported_bytes,
            num_computed_tokens_first_step=result.num_computed_tokens_first_step,
            num_computed_tokens_total=result.num_computed_tokens_total,
            num_recomputed_beam_tokens=result.num_recomputed_beam_tokens,
            num_beams_short=max(result.num_beams_short, 0),
            num_dropped_beams=result.num_dropped_beams,
            first_step_ms=result.first_step_s * 1e3,
            total_ms=result.elapsed_s * 1e3,
            engine_id=self.engine.engine_id,
        )

    async def GetCapacity(self, request, context) -> engine_pb2.Capacity:
        if self.engine is None:
            await abort_with(context, EngineStarting())
        snap = self.engine.pool()
        events = self.engine.kv_events
        return engine_pb2.Capacity(
            role=self.role,
            engine_id=self.engine.engine_id,
            num_total_blocks=snap.num_total_blocks,
            num_free_blocks=snap.num_free_blocks,
            block_size=snap.block_size,
            num_running_reqs=snap.num_running_reqs,
            num_waiting_reqs=snap.num_waiting_reqs,
            max_model_len=self.engine.max_model_len,
            max_beam_width=self.engine.max_beam_width,
            vocab_size=self.engine.vocab_size,
            model_fingerprint=self.model_fingerprint,
            handoff_target=self.engine.handoff_target,
            num_reserved_blocks=self.engine.num_reserved_blocks,
            beam_fork=self.engine.config.beam_fork,
            catalogs=sorted(self.engine.catalogs),
            catalog_widths=[engine_pb2.CatalogWidths(name=name,
                                                     nodes_at_depth=catalog.nodes_at_depth())
                            for name, catalog in sorted(self.engine.catalogs.items())],
            kv_events_endpoint=events.endpoint if events else "",
            kv_events_replay_endpoint=events.replay_endpoint if events else "",
            kv_events_curve=bool(events and events.keyed),
            adapters=[engine_pb2.AdapterInfo(name=a.name, digest=a.digest)
                      for _, a in sorted(self.engine.adapters.items())],
        )

    async def Release(self, request: engine_pb2.ReleaseRequest, context):
        try:
            if self.role != "prefill":
                raise InvalidRequest("role", "holds are kept by a prefill engine")
            if self.engine is None:
                raise EngineStarting()
            if request.request_ids or request.prefixes:
                await self.engine.release(list(request.request_ids),
                                          list(request.prefixes))
            return engine_pb2.ReleaseResponse()
        except Exception as e:
            await abort_with(context, e)

    async def Stop(self, request: engine_pb2.StopRequest, context):
        """P: stop stage 1s after their next token; D: stop beam searches after their next
        beam step (their Stage2 answers ``stopped``), to move them."""
        try:
            if self.engine is None:
                raise EngineStarting()
            if request.request_ids and self.role == "decode":
                await self.engine.stop_searches(list(request.request_ids),
                                                request.target_engine_id)
            elif request.request_ids:
                await self.engine.stop(list(request.request_ids), request.target_engine_id)
            return engine_pb2.StopResponse()
        except Exception as e:
            await abort_with(context, e)

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        task = self._tasks.get(request.request_id)
        if task is not None:
            task.cancel()
        return engine_pb2.AbortResponse()


def make_servicer(role: str, model_dir: str) -> EngineServicer:
    """The servicer of a P or D on ``model_dir`` (its engine is attached once started)."""
    tokens = ModelTokens.load(model_dir)
    return EngineServicer(role, model_fingerprint(model_dir), tokens.think_end_id)


async def start_engine(servicer: EngineServicer, config: EngineConfig) -> VllmEngine:
    """The one start-up sequence of an engine behind a servicer (``kvhandoff serve`` and
    the Ray Serve deployments): start P or D (~30 s on CPU, off the event loop), run its
    first logprobs requests, then attach it, so the servicer answers only once it can."""
    cls = PrefillEngine if config.role == "prefill" else DecodeEngine
    engine = await asyncio.to_thread(cls.start, config)
    await engine.warmup()
    servicer.engine = engine
    return engine


def add_engine_service(servicer: EngineServicer, server: grpc.aio.Server,
                       engine_key: str | None) -> None:
    """Register ``servicer`` on ``server``, every call guarded by ``engine_key``."""
    engine_pb2_grpc.add_EngineServicer_to_server(
        guard_servicer(servicer, ENGINE_DESCRIPTOR, engine_key), server)


async def start_engine_server(engine: Any, role: str, host: str = "127.0.0.1",
                              port: int = 0, tls: ServerTLS | None = None,
                              engine_key: str | None = None
                              ) -> tuple[grpc.aio.Server, int]:
    """Serve an engine that is already running in this process (the benchmark's)."""
    servicer = make_servicer(role, engine.config.model)
    servicer.engine = engine
    server, health_servicer, bound = await start_server(
        lambda s: add_engine_service(servicer, s, engine_key), ENGINE_SERVICE,
        host, port, tls)
    await set_serving(health_servicer, ENGINE_SERVICE, True)
    return server, bound


async def serve_engine(role: str, config_kwargs: dict[str, Any], host: str, port: int,
                       metrics_port: int | None = None, tls: ServerTLS | None = None,
                       engine_key: str | None = None) -> None:
    """Start the engine, serve until SIGTERM/SIGINT, then shut everything down. Every
    Engine call must present ``engine_key`` (None: any caller; mutual TLS, with ``tls``
    naming a client CA, guards the connection either way)."""
    config = EngineConfig(role=role, **config_kwargs)
    servicer = make_servicer(role, config.model)
    server, health_servicer, bound = await start_server(
        lambda s: add_engine_service(servicer, s, engine_key), ENGINE_SERVICE,
        host, port, tls)
    if metrics_port is not None:
        bound_metrics = serve_metrics(servicer, host, metrics_port)
        print(f"kvhandoff {role} metrics on http://{host}:{bound_metrics}/metrics", flush=True)
    logger.info("%s engine server on %s:%d, starting the engine", role, host, bound)
    lag = asyncio.create_task(watch_loop_lag(LOOP_LAG, role))

    t0 = time.perf_counter()
    engine = await start_engine(servicer, config)
    await set_serving(health_servicer, ENGINE_SERVICE, True)
    logger.info("%s engine %s serving on %s:%d (ready in %.1fs)", role, engine.engine_id,
                host, bound, time.perf_counter() - t0)
    guard = "engine key required" if engine_key else "no engine key"
    print(f"kvhandoff {role} serving on {host}:{bound} ({guard})", flush=True)
    signalled = False
    try:
        signalled = await wait_for_shutdown_signal(lambda: engine.llm.errored)
        if not signalled:
            logger.error("%s engine %s failed (its engine core died; see above): no longer "
                         "serving, exiting so a supervisor can restart it", role,
                         engine.engine_id)
    finally:
        lag.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(grace=2.0)
        engine.shutdown()
    if not signalled:
        raise SystemExit(1)


__all__ = ["EngineServicer", "make_servicer", "serve_engine", "start_engine",
           "start_engine_server"]

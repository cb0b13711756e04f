"""Router overhead: the same two-stage requests through the router and as direct engine
calls (what a client that knew P and D would do: P's Stage1, then D's Stage2 with the
handoff), one at a time on one pair of engines.

The engines are served over gRPC from the benchmark's process; the router runs as its
own ``kvhandoff serve --role router`` process. Stage 1 is greedy and both prefix caches
are emptied before every call, so both paths do the same work and return the same
tokens. Reported: the router's own time per request (``Timings.router_overhead_ms``:
its wall time minus the time it waited on the engines) and, as a cross-check, the
client-observed difference router - direct (noisier: it carries the engines' jitter).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from kvhandoff.ports import free_port
from kvhandoff.types import BeamParams, Stage1Params, continuation_prompt
from kvhandoff.v1 import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from server.engine_service import start_engine_server
from tools.client import RouterClient, make_request
from tools.launch import local_cluster, spawn, stop, wait_serving
from wire import common as engine_pb


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _p95(values: list[float]) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, round(0.95 * (len(values) - 1)))], 3)


async def _direct(p: Any, d: Any, rid: str, prompt: list[int], stage1: Stage1Params,
                  beam: BeamParams, suffix: list[int], think_end_id: int | None,
                  target: str) -> list[list[int]]:
    thinking: list[int] = []
    handoff = None
    async for event in p.Stage1(engine_pb2.Stage1Request(
            request_id=f"{rid}-s1", prompt_token_ids=prompt,
            sampling=engine_pb.stage1_to_pb(stage1), export=True, target_engine_id=target)):
        thinking.extend(event.new_token_ids)
        if event.HasField("handoff"):
            handoff = event.handoff
    assert handoff is not None, "P exported no handoff"
    stage2_prompt = continuation_prompt(prompt + thinking, suffix, think_end_id)
    resp = await d.Stage2(engine_pb2.Stage2Request(
        request_id=f"{rid}-s2", prompt_token_ids=stage2_prompt,
        beam=engine_pb.beam_to_pb(beam), handoff=handoff))
    return [list(b.token_ids) for b in resp.beams]


async def measure_router_overhead(pair: Any, prompts: list[list[int]], *, stage1_tokens: int,
                                  beam: BeamParams, log_dir: Path | None = None,
                                  progress: Any = None) -> dict[str, Any]:
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvhandoff-router-bench-"))
    p_server, p_port = await start_engine_server(pair.p, "prefill")
    d_server, d_port = await start_engine_server(pair.d, "decode")
    p_addr, d_addr = f"127.0.0.1:{p_port}", f"127.0.0.1:{d_port}"
    router = spawn("router", free_port(), ["--model", pair.p.config.model,
                                            "--prefill", p_addr, "--decode", d_addr], log_dir)
    stage1 = Stage1Params(max_tokens=stage1_tokens, temperature=0.0, stop_token_ids=tuple(
        t for t in (pair.think_end_id,) if t is not None))
    overhead, via_router, direct, diffs = [], [], [], []
    same = 0
    try:
        # The router's health turns SERVING once it reached both engines, which answer
        # from this event loop: wait in a thread.
        await asyncio.to_thread(wait_serving, router.address, [router], 120.0)
        async with grpc.aio.insecure_channel(router.address) as rc, \
                grpc.aio.insecure_channel(p_addr) as pc, grpc.aio.insecure_channel(d_addr) as dc:
            rs = router_pb2_grpc.RouterStub(rc)
            ps, ds = engine_pb2_grpc.EngineStub(pc), engine_pb2_grpc.EngineStub(dc)
            for i, prompt in enumerate([prompts[0], *prompts]):  # the first is a warm-up
                req = router_pb2.GenerateRequest(
                    request_id=f"ro-{i}", path=common_pb2.PATH_HANDOFF,
                    prompt_token_ids=common_pb2.TokenIds(ids=prompt),
                    stage1=engine_pb.stage1_to_pb(stage1), beam=engine_pb.beam_to_pb(beam))
                times = {}
                # Alternate the order; both start from empty caches either way.
                for path in (("direct", "router") if i % 2 else ("router", "direct")):
                    await pair.p.empty_prefix_cache()
                    await pair.d.empty_prefix_cache()
                    t0 = time.perf_counter()
                    if path == "router":
                        resp = await rs.Generate(req, timeout=300)
                        router_beams = [list(b.token_ids) for b in resp.beams]
                    else:
                        direct_beams = await _direct(ps, ds, f"ro-direct-{i}", prompt, stage1,
                                                     beam, pair.default_suffix_ids,
                                                     pair.think_end_id, pair.d.handoff_target)
                    times[path] = (time.perf_counter() - t0) * 1e3
                if i == 0:
                    continue
                overhead.append(resp.timings.router_overhead_ms)
                via_router.append(times["router"])
                direct.append(times["direct"])
                diffs.append(times["router"] - times["direct"])
                same += router_beams == direct_beams
                if progress is not None:
                    progress(f"router {i}/{len(prompts)}")
    finally:
        stop([router])
        await p_server.stop(0)
        await d_server.stop(0)
    return {
        "requests": len(overhead),
        "router_overhead_ms_p50": _median(overhead),
        "router_overhead_ms_p95": _p95(overhead),
        "end_to_end_ms_p50_router": _median(via_router),
        "end_to_end_ms_p50_direct": _median(direct),
        "router_minus_direct_ms_p50": _median(diffs),
        "beams_match_direct": f"{same}/{len(overhead)}",
    }


def measure_router_overhead_on_cluster(model: str | None, num_requests: int, *,
                                       log_dir: Path | None = None) -> dict[str, Any]:
    """The router's own time per request as deployed: P, D and the router each their own
    ``kvhandoff serve`` process (``kvhandoff bench --router-only``), requests one at a
    time, the first two as warm-up. Unlike ``measure_router_overhead``, no engine shares
    an event loop with another or with the benchmark."""

    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvhandoff-router-cluster-"))
    overhead, total, recomputed = [], [], 0
    with local_cluster(model, log_dir, decode_mib=64, prefill_mib=64) as cluster, \
            RouterClient(cluster["router"]) as client:
        for i in range(num_requests + 2):
            resp = client.generate(make_request(prompt=list(range(10, 210)), max_tokens=16,
                                                seed=i, beam_width=4, path="handoff"))
            if i >= 2:
                overhead.append(resp.timings.router_overhead_ms)
                total.append(resp.timings.total_ms)
                recomputed += resp.stats.recomputed
    return {
        "requests": len(overhead),
        "router_overhead_ms_p50": _median(overhead),
        "router_overhead_ms_p95": _p95(overhead),
        "router_overhead_ms_max": round(max(overhead), 3) if overhead else None,
        "total_ms_p50": _median(total),
        "handoffs_recomputed": recomputed,
    }

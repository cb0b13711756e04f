"""Load through the router on the real cluster: many two-stage requests at once, then
a burst too big for D's pool. Size: KVHANDOFF_LOAD_REQUESTS (default 48, what CI runs)
and KVHANDOFF_LOAD_CONCURRENCY (default 8); the issue's full size is 500 at 32."""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tools.client import RouterClient, make_request

pytestmark = [pytest.mark.engines, pytest.mark.load]

NUM_REQUESTS = int(os.environ.get("KVHANDOFF_LOAD_REQUESTS", "48"))
CONCURRENCY = int(os.environ.get("KVHANDOFF_LOAD_CONCURRENCY", "8"))
#: Memory a process may keep after the load (allocator caches, compiled kernels).
RSS_MARGIN_MIB = 64
#: A request refused for D's capacity is answered within this: the router's longest wait
#: for room on D (30 s by default) plus stage 1.
REJECTION_S = 45.0


#: At or below this concurrency D holds every request's beams at once: nothing may be
#: refused or recomputed (what CI runs).
D_HOLDS_ALL_CONCURRENCY = 8


def _is_capacity_rejection(result) -> bool:
    return (isinstance(result, grpc.RpcError)
            and result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "decode pool too small" in (result.details() or ""))


def _refused_by_d(result) -> bool:
    """D's admission refused after stage 1 (its message counts D's free blocks): the
    router admitted a request D could not hold, i.e. over-admitted."""
    return _is_capacity_rejection(result) and " free of " in result.details()


def _rss_mib(server) -> float:
    import psutil

    proc = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def _run_all(address: str, requests: list, concurrency: int) -> list:
    def one(req):
        with RouterClient(address) as client:
            t0 = time.perf_counter()
            try:
                return client.generate(req, timeout=600), time.perf_counter() - t0
            except grpc.RpcError as e:
                return e, time.perf_counter() - t0

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, requests))


def _request(i: int, rng: random.Random, path: str = "handoff", **kw):
    prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(20, 160))]
    return make_request(prompt=prompt, max_tokens=rng.randint(4, 24), seed=i, beam_width=4,
                        path=path, request_id=f"load-{path}-{i}", **kw)


def test_load_through_the_router_loses_nothing(cluster, assert_cluster_clean):
    rng = random.Random(11)
    # The warm-up has the load's shape (same concurrency), so the memory baseline holds
    # the allocators' high-water mark for batches that wide: growth after it is a leak.
    warmup = [_request(10_000 + i, rng) for i in range(2 * CONCURRENCY)]
    errors = [(r.code().name, r.details()) for r, _ in _run_all(cluster["router"], warmup,
                                                                CONCURRENCY)
              if isinstance(r, grpc.RpcError) and not _is_capacity_rejection(r)]
    assert not errors, errors
    assert_cluster_clean()
    servers = cluster["servers"]
    baseline = {s.role: _rss_mib(s) for s in servers}

    requests = [_request(i, rng) for i in range(NUM_REQUESTS)]
    t0 = time.perf_counter()
    results = _run_all(cluster["router"], requests, CONCURRENCY)
    elapsed = time.perf_counter() - t0
    # The cluster's D is small on purpose (at concurrency 32 it holds about a third of the
    # beams): the router queues requests for room on it. A refusal for D's capacity (the
    # wait ran out, or D's admission disagreed with the router's count) is a deliberate
    # rejection and must come back in bounded time. Anything else is a failure.
    rejected = [t for r, t in results if _is_capacity_rejection(r)]
    failures = [(req.request_id, r.code().name, r.details()) for req, (r, _) in
                zip(requests, results)
                if isinstance(r, grpc.RpcError) and not _is_capacity_rejection(r)]
    assert not failures, failures
    served = [i for i, (r, _) in enumerate(results) if not isinstance(r, grpc.RpcError)]
    assert served, "nothing was served"
    recomputed = [(requests[i].request_id, results[i][0].stats.handoff_failure) for i in served
                  if results[i][0].stats.recomputed]
    print(f"\nload: {NUM_REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f}s "
          f"({len(served) / elapsed:.2f} served req/s): {len(served)} served, "
          f"{len(rejected)} refused for D's capacity (slowest refusal "
          f"{max(rejected, default=0.0):.1f}s), {len(recomputed)} handoffs recomputed "
          f"{recomputed}")
    assert max(rejected, default=0.0) < REJECTION_S
    if CONCURRENCY <= D_HOLDS_ALL_CONCURRENCY:
        # D holds everything: a refusal or a recompute is a bug, not load.
        by_d = [requests[i].request_id for i, (r, _) in enumerate(results) if _refused_by_d(r)]
        assert not by_d, f"D refused after stage 1 (the router over-admitted): {by_d}"
        assert not rejected, f"{len(rejected)} refused although D holds all of them"
        assert len(served) == NUM_REQUESTS
        # A stalled READ past P's lease is recomputed and flagged (a 2-core host stalls
        # at times: issue 17 owns removing it); anything else, or most of the load going
        # by the fallback, is a failure.
        assert all("KV import from P failed" in why for _, why in recomputed), recomputed
        assert len(recomputed) <= len(served) // 4, recomputed
    assert_cluster_clean()
    after = {s.role: _rss_mib(s) for s in servers}
    for role in baseline:
        assert after[role] <= baseline[role] + RSS_MARGIN_MIB, (role, baseline[role], after[role])

    # A sample, against the colocated reference (same seeds: same stage 1).
    sample = served[::max(1, len(served) // 6)]
    refs = []
    for i in sample:
        ref = requests[i].__class__()
        ref.CopyFrom(requests[i])
        ref.path, ref.request_id = 2, f"load-ref-{i}"  # PATH_COLOCATED
        refs.append(ref)
    ref_results = _run_all(cluster["router"], refs, 2)
    for i, (ref, _) in zip(sample, ref_results):
        got = results[i][0]
        assert list(got.thinking_token_ids) == list(ref.thinking_token_ids)
        assert [list(b.token_ids) for b in got.beams] == [list(b.token_ids) for b in ref.beams]
    assert_cluster_clean()


def test_a_burst_beyond_d_gets_resource_exhausted_and_the_rest_succeed(
        cluster, model_dir, tmp_path, assert_cluster_clean):
    """A router whose queue for D holds two: of eight requests that fit D two at a time,
    two run, two wait for them, and the rest are refused at once."""
    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    router = spawn("router", free_port(),
                    ["--model", model_dir, "--prefill", cluster["prefill"].address,
                     "--decode", cluster["decode"][0].address, "--no-warm-up",
                     "--decode-queue-limit", "2"], tmp_path, "router-burst")
    try:
        wait_serving(router.address, [router])
        # D holds 135 blocks of 32 tokens; each of these needs ~48 (a ~1000-token parent
        # with 8 beams), so two fit at a time.
        rng = random.Random(5)
        requests = []
        for i in range(8):
            prompt = [rng.randrange(10, 1000) for _ in range(1000)]
            requests.append(make_request(prompt=prompt, max_tokens=4, seed=i, beam_width=8,
                                         path="handoff", request_id=f"burst-{i}"))
        results = _run_all(router.address, requests, 8)
    finally:
        stop([router])
    ok = [t for r, t in results if not isinstance(r, Exception)]
    refused = [(r, t) for r, t in results if isinstance(r, Exception)]
    print(f"\nburst: {len(ok)} ok (max {max(ok, default=0.0):.1f}s), {len(refused)} refused "
          f"(max {max((t for _, t in refused), default=0.0):.1f}s)")
    for r, t in refused:
        assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (r.code(), r.details())
        assert "decode queue full" in r.details() and t < 5.0, (r.details(), t)
    # Two run and two wait (at least: one may finish before the last ones arrive).
    assert len(ok) >= 4 and refused, len(ok)
    assert_cluster_clean()

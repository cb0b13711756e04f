"""Load through the router on the real cluster: many two-stage requests at once, a burst
twice D's pool, a D paused with SIGSTOP (slow is not dead), and a burst beyond the queue.
Size: KVHANDOFF_LOAD_REQUESTS (default 48, what CI runs) and KVHANDOFF_LOAD_CONCURRENCY
(default 8); the issue's full size is 500 at 32. With KVHANDOFF_LOAD_REPORT=FILE the main
run appends one JSON line of its figures to FILE (docs/reliability.md's table)."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.utils import assert_identical, metric_sum, scrape_metrics
from tools.client import RouterClient, make_request
from tools.launch import CapacityProbe, paused, percentile, rss_mib

pytestmark = [pytest.mark.engines, pytest.mark.load]

NUM_REQUESTS = int(os.environ.get("KVHANDOFF_LOAD_REQUESTS", "48"))
CONCURRENCY = int(os.environ.get("KVHANDOFF_LOAD_CONCURRENCY", "8"))
#: Memory a process may keep after the load (allocator caches, compiled kernels).
RSS_MARGIN_MIB = 64
#: A request refused for D's capacity is answered within this: the router's longest wait
#: for room on D (30 s by default) plus stage 1.
REJECTION_S = 45.0
#: The negative control's fault (connector.faults): block 0 of D's import zeroed.
FAULT = "zero-block"


#: At or below this concurrency D holds every request's beams at once: nothing may be
#: refused (what CI runs).
D_HOLDS_ALL_CONCURRENCY = 8


def _is_capacity_rejection(result) -> bool:
    return (isinstance(result, grpc.RpcError)
            and result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "decode pool too small" in (result.details() or ""))


def _refused_by_d(result) -> bool:
    """D's admission refused after stage 1 (its message counts D's free blocks): the
    router admitted a request D could not hold, i.e. over-admitted."""
    return _is_capacity_rejection(result) and " free of " in result.details()


def _histogram_quantile(url: str, name: str, q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of histogram ``name``
    (all label sets summed), from a scrape of ``url``."""
    buckets: dict[float, float] = {}
    for (sample, labels), value in scrape_metrics(url).items():
        if sample == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    if not buckets or not buckets[float("inf")]:
        return 0.0
    total = buckets[float("inf")]
    return next(le for le in sorted(buckets) if buckets[le] >= q * total)


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
    warmed = [r for r, _ in _run_all(cluster["router"], warmup, CONCURRENCY)]
    errors = [(r.code().name, r.details()) for r in warmed
              if isinstance(r, grpc.RpcError) and not _is_capacity_rejection(r)]
    assert not errors, errors
    assert not _recomputed([r for r in warmed if not isinstance(r, grpc.RpcError)])
    assert_cluster_clean()
    servers = cluster["servers"]
    baseline = {s.role: rss_mib(s) for s in servers}

    requests = [_request(i, rng) for i in range(NUM_REQUESTS)]
    # The comparisons' negative control: one request (of at least one full imported block)
    # runs with D's import faulted; the same check must fail on it, and only on it.
    faulted = next(i for i, r in enumerate(requests) if len(r.prompt_token_ids.ids) >= 40)
    requests[faulted].fault = FAULT
    t0 = time.perf_counter()
    # GetCapacity answered promptly under load: probed from outside, as the router polls.
    with CapacityProbe([cluster["prefill"], *cluster["decode"]]) as probe:
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
    control_plane = probe.percentiles()
    print(f"GetCapacity round trips under load: {control_plane}")
    assert max(rejected, default=0.0) < REJECTION_S
    if CONCURRENCY <= D_HOLDS_ALL_CONCURRENCY:
        # D holds everything: a refusal or a recompute is a bug, not load.
        by_d = [requests[i].request_id for i, (r, _) in enumerate(results) if _refused_by_d(r)]
        assert not by_d, f"D refused after stage 1 (the router over-admitted): {by_d}"
        assert not rejected, f"{len(rejected)} refused although D holds all of them"
        assert len(served) == NUM_REQUESTS
    # Nothing here asks for the fallback: a recomputed handoff is a defect at any size.
    assert not recomputed, recomputed
    assert_cluster_clean()
    after = {s.role: rss_mib(s) for s in servers}
    if os.environ.get("KVHANDOFF_LOAD_REPORT"):
        latencies = [results[i][1] for i in served]
        report = {
            "requests": NUM_REQUESTS, "concurrency": CONCURRENCY,
            "elapsed_s": round(elapsed, 1), "served": len(served),
            "refused_for_capacity": len(rejected),
            "slowest_refusal_s": round(max(rejected, default=0.0), 1),
            "recomputed": len(recomputed),
            "p50_s": round(percentile(latencies, 0.5), 2),
            "p95_s": round(percentile(latencies, 0.95), 2),
            "rss_mib_before": {k: round(v) for k, v in baseline.items()},
            "rss_mib_after": {k: round(v) for k, v in after.items()},
            "get_capacity": control_plane,
            "loop_lag_p99_s": {s.role: _histogram_quantile(
                s.metrics_url, "kvhandoff_event_loop_lag_seconds", 0.99) for s in servers},
            "pools_clean": True,
        }
        with open(os.environ["KVHANDOFF_LOAD_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    for role in baseline:
        assert after[role] <= baseline[role] + RSS_MARGIN_MIB, (role, baseline[role], after[role])

    # A sample and the faulted request, against the colocated reference (same seeds:
    # same stage 1): the same identity check as every end-to-end test.
    assert faulted in served
    sample = sorted({*served[::max(1, len(served) // 6)], faulted})
    refs = []
    for i in sample:
        ref = requests[i].__class__()
        ref.CopyFrom(requests[i])
        ref.path, ref.request_id, ref.fault = 2, f"load-ref-{i}", ""  # PATH_COLOCATED
        refs.append(ref)
    ref_results = _run_all(cluster["router"], refs, 2)
    for i, (ref, _) in zip(sample, ref_results):
        if i != faulted:
            assert_identical(results[i][0], ref, found_on_d=True)
            continue
        with pytest.raises(AssertionError, match="cum_logprob|beams differ"):
            assert_identical(results[i][0], ref, found_on_d=True)
    assert_cluster_clean()


def _recomputed(responses) -> list[tuple[str, str]]:
    """(request id, reason) of each response whose handoff was recomputed: none of the
    tests here causes a failed handoff, so any is a defect."""
    return [(r.request_id, r.stats.handoff_failure) for r in responses if r.stats.recomputed]


def _long_requests(n: int, name: str) -> list:
    """Requests of ~48 blocks of D's 135 each (a ~1000-token parent, 8 beams): two fit on
    the cluster's D at a time. Each ``name`` has its own prompts: a burst of parents P and
    D have cached runs in a fraction of the time (CI: eight in 0.2 s each, the queue for
    D never filled)."""
    rng = random.Random(name)
    return [make_request(prompt=[rng.randrange(10, 1000) for _ in range(1000)], max_tokens=4,
                         seed=i, beam_width=8, path="handoff", request_id=f"{name}-{i}")
            for i in range(n)]


def test_a_burst_twice_ds_pool_waits_for_room_and_is_served(cluster, assert_cluster_clean):
    """Six requests needing twice D's blocks at once: the router queues them for room on D,
    none is refused (the wait is far below its 30 s bound), none fails and each went by
    handoff (none recomputed)."""
    requests = _long_requests(6, "burst2x")
    results = _run_all(cluster["router"], requests, len(requests))
    failed = [(req.request_id, r.code().name, r.details()) for req, (r, _) in
              zip(requests, results) if isinstance(r, grpc.RpcError)]
    print(f"\nburst of twice D's pool: {len(requests) - len(failed)} served, slowest "
          f"{max(t for _, t in results):.1f}s")
    assert not failed, failed
    recomputed = _recomputed(r for r, _ in results)
    assert not recomputed, recomputed
    assert_cluster_clean()


def _out_of_rotation(metrics_url: str, role: str) -> float:
    return metric_sum(metrics_url, "kvhandoff_router_engine_state_changes_total", role=role,
                      state="out")


def test_a_paused_d_is_slow_not_dead(cluster, model_dir, tmp_path, assert_cluster_clean):
    """D's processes stopped (SIGSTOP) for 6 s with requests in flight and more arriving:
    the router keeps D in rotation (silent for less than --engine-silence-s, 10 s: its
    count of D taken out does not move), every request waits and is served by handoff
    (none recomputed) once D continues. Control: a router told --engine-silence-s 1 takes
    D out and refuses the same kind of request UNAVAILABLE."""
    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    d = cluster["decode"][0]
    taken_out_before = _out_of_rotation(cluster["router_metrics"], "decode")
    control = spawn("router", free_port(),
                    ["--model", model_dir, "--prefill", cluster["prefill"].address,
                     "--decode", d.address, "--no-warm-up", "--engine-silence-s", "1"],
                    tmp_path, "router-control")
    try:
        wait_serving(control.address, [control])
        rng = random.Random(17)
        before = [_request(20_000 + i, rng) for i in range(4)]
        during = [_request(20_100 + i, rng) for i in range(4)]
        results: dict[str, object] = {}

        def send(address: str, reqs: list) -> None:
            for req, res in zip(reqs, _run_all(address, reqs, len(reqs))):
                results[req.request_id] = res

        first = threading.Thread(target=send, args=(cluster["router"], before))
        first.start()
        time.sleep(0.05)  # in flight when D stops
        with paused(d):
            time.sleep(3.5)  # the control router's D has been silent > 1 s by now
            late = threading.Thread(target=send, args=(cluster["router"], during))
            late.start()
            refused, refused_s = _run_all(control.address, [_request(20_200, rng)], 1)[0]
            time.sleep(2.5)
        first.join()
        late.join()
        control_metrics = control.metrics_url
        assert _out_of_rotation(control_metrics, "decode") >= 1
    finally:
        stop([control])
    failed = {rid: (r.code().name, r.details()) for rid, (r, _) in results.items()
              if isinstance(r, grpc.RpcError)}
    print(f"\npaused D: {len(results) - len(failed)} of {len(results)} served (slowest "
          f"{max(t for _, t in results.values()):.1f}s); control router: "
          f"{getattr(refused, 'code', lambda: 'OK')()} after {refused_s:.1f}s")
    assert not failed, failed
    assert len(results) == len(before) + len(during)
    recomputed = _recomputed(r for r, _ in results.values())
    assert not recomputed, recomputed
    assert _out_of_rotation(cluster["router_metrics"], "decode") == taken_out_before
    assert isinstance(refused, grpc.RpcError), "the control router served while D was stopped"
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, (refused.code(), refused.details())
    assert "no decode engine is reachable" in refused.details()
    assert_cluster_clean()


def test_a_burst_beyond_d_gets_resource_exhausted_and_the_rest_succeed(
        cluster, model_dir, tmp_path, assert_cluster_clean):
    """A router whose queue for D holds two: of eight requests that fit D two at a time,
    two run, two wait for them, and the rest are refused at once; those served went by
    handoff (none recomputed). D is paused (SIGSTOP, well below --engine-silence-s) while
    the burst arrives, so the first two hold their claims until every request has been
    placed or refused: on 2 busy cores the burst's requests were seen to arrive spread out
    enough that the first ones finished before the last came (eight served, none refused)."""
    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    router = spawn("router", free_port(),
                    ["--model", model_dir, "--prefill", cluster["prefill"].address,
                     "--decode", cluster["decode"][0].address, "--no-warm-up",
                     "--decode-queue-limit", "2"], tmp_path, "router-burst")
    try:
        wait_serving(router.address, [router])
        requests = _long_requests(8, "burst")
        results: list = []
        burst = threading.Thread(
            target=lambda: results.extend(_run_all(router.address, requests, 8)))
        with paused(cluster["decode"][0]):
            burst.start()
            time.sleep(4.0)
        burst.join()
    finally:
        stop([router])
    ok = [t for r, t in results if not isinstance(r, Exception)]
    recomputed = _recomputed(r for r, _ in results if not isinstance(r, Exception))
    refused = [(r, t) for r, t in results if isinstance(r, Exception)]
    print(f"\nburst: {len(ok)} ok (max {max(ok, default=0.0):.1f}s), {len(refused)} refused "
          f"(max {max((t for _, t in refused), default=0.0):.1f}s)")
    for r, t in refused:
        assert r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (r.code(), r.details())
        # Refused by the router's bounded queue, or (seen once in three full-suite
        # runs, 2026-11-29) by D's admission, the last word on its room ("decode pool
        # too small": the router's claims ran ahead of D's own count while D was
        # paused); either way at once, with the status a client retries.
        assert ("decode queue full" in r.details()
                or "decode pool too small" in r.details()) and t < 5.0, (r.details(), t)
    # Two run and two wait (at least: one may finish before the last ones arrive).
    assert len(ok) >= 4 and refused, len(ok)
    assert not recomputed, recomputed
    assert_cluster_clean()

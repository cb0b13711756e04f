"""The router's Prometheus metrics, on their own registry, served on ``/metrics``."""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvhandoff.types import Path
from router.errors import OVERLOAD_MESSAGE
from router.requests import Result

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

#: The router's ways in (router.api counts each request under its front).
FRONTS = ("grpc", "http", "serve")

#: What the refusals for an ended lease say: D's admission (``connector.handoff``) and the
#: parent registry (``router.parents``).
LEASE_ENDED = ("handoff lease expired", "P's lease on its blocks has ended")


def lease_ended(reason: str) -> bool:
    """A handoff failure (or error message) that says P's lease had ended."""
    return any(text in reason for text in LEASE_ENDED)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvhandoff_router_requests", "Two-stage requests by outcome",
                                ["outcome", "code"], registry=r)
        self.stage_seconds = Histogram("kvhandoff_router_stage_seconds",
                                       "Latency by stage of successful requests", ["stage"],
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self.paths = Counter("kvhandoff_router_path_decisions",
                             "Requests run colocated or with a handoff", ["path"], registry=r)
        self.handoff_bytes = Counter("kvhandoff_router_handoff_bytes",
                                     "KV bytes D imported from P", registry=r)
        self.import_step_seconds = Histogram(
            "kvhandoff_router_import_step_seconds",
            "D's first beam step of a handoff: the NIXL READ plus the tail's compute",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_imported = Counter("kvhandoff_router_tokens_imported",
                                       "Parent tokens D imported over NIXL", registry=r)
        self.tokens_computed_d = Counter(
            "kvhandoff_router_tokens_computed_d",
            "Tokens the stage-2 engine computed for the first beam step", registry=r)
        self.beam_tokens_recomputed = Counter(
            "kvhandoff_router_beam_tokens_recomputed",
            "Context tokens beam steps after the first recomputed on the stage-2 engine "
            "(neither cached nor forked, e.g. evicted between steps)", registry=r)
        self.capacity_rejections = Counter(
            "kvhandoff_router_capacity_rejections",
            "Requests no decode engine could hold (RESOURCE_EXHAUSTED)", registry=r)
        self.recomputed = Counter(
            "kvhandoff_router_handoffs_recomputed",
            "Handoffs that failed and whose stage 2 was recomputed from token ids", registry=r)
        self.overload_rejections = Counter(
            "kvhandoff_router_overload_rejections",
            "Requests refused because the router had max_inflight running, by the front "
            "they came in through", ["front"], registry=r)
        self.front_requests = Counter(
            "kvhandoff_router_front_requests",
            "Requests by the front they came in through (grpc, http, serve) and outcome "
            "(ok, error, cancelled, refused: over max_inflight)", ["front", "outcome"],
            registry=r)
        self.inflight = Gauge("kvhandoff_router_inflight",
                              "Requests running now, by the front they came in through "
                              "(all fronts share --max-inflight)", ["front"], registry=r)
        self.inflight_peak = Gauge("kvhandoff_router_inflight_peak",
                                   "The most requests the router has run at once, all "
                                   "fronts together (never above --max-inflight)", registry=r)
        self.front_inflight_peak = Gauge(
            "kvhandoff_router_front_inflight_peak",
            "The most requests that came in through one front and ran at once", ["front"],
            registry=r)
        self.overhead_seconds = Histogram(
            "kvhandoff_router_overhead_seconds",
            "The router's own time per request (excluding waiting on the engines)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1), registry=r)
        self.moves = Counter(
            "kvhandoff_router_moves",
            "Running requests' stage 1 moved to another engine, by reason (move, drain; "
            "resume: the source P failed)", ["reason"], registry=r)
        self.expired_leases = Counter(
            "kvhandoff_router_expired_leases",
            "Handoffs refused because P's lease on the blocks had ended or was about to (D's "
            "admission, the parent registry); a READ that failed in flight is not counted: "
            "D cannot tell its cause", registry=r)

        self.engine_state_changes = Counter(
            "kvhandoff_router_engine_state_changes",
            "Engines entering (state=in) or leaving (state=out) the router's rotation, by "
            "reason (first answer, answered, silent, unavailable, ...)",
            ["role", "endpoint", "state", "reason"], registry=r)
        self.capacity_late_answers = Counter(
            "kvhandoff_router_capacity_late_answers",
            "GetCapacity calls that timed out (the engine stays in rotation until it has "
            "been silent for --engine-silence-s)", ["role", "endpoint"], registry=r)
        self.warmups = Counter(
            "kvhandoff_router_warmups",
            "Warm-up handoffs (P -> D) and moves (P -> P) the router ran, before serving "
            "and for the pairs of an engine that answers again, by outcome (imported, "
            "recomputed, failed)", ["source", "dest", "outcome"], registry=r)
        self.placements = Counter(
            "kvhandoff_router_placements",
            "Requests placed on an engine, by role and whether its prefix cache held a "
            "prefix of the prompt (hit: by its KV events)", ["role", "endpoint", "hit"],
            registry=r)
        self.placement_hit_blocks = Counter(
            "kvhandoff_router_placement_hit_blocks",
            "Leading prompt blocks the chosen engine held when a request was placed",
            ["role", "endpoint"], registry=r)
        self.capacity_rpc_seconds = Histogram(
            "kvhandoff_router_capacity_rpc_seconds",
            "GetCapacity round trips from the router, answered or not", ["role"],
            buckets=_LATENCY_BUCKETS, registry=r)
        from wire.grpc_server import loop_lag_histogram

        self.loop_lag = loop_lag_histogram(r)

    def track_engines(self, router) -> None:
        """Export ``kvhandoff_router_engine_up{role, endpoint}``: 1 while the router
        routes to that engine (its last capacity snapshot stands), read at each scrape;
        and count its engines' state changes and capacity answers (the pool's
        ``observer``)."""
        self.registry.register(_EngineCollector(router))
        router.pool.observer = self

    # ---- router.capacity.EngineObserver --------------------------------------------------
    def engine_state(self, role: str, address: str, state: str, reason: str) -> None:
        self.engine_state_changes.labels(role, address, state, reason).inc()

    def capacity_answer(self, role: str, address: str, seconds: float, code: str) -> None:
        self.capacity_rpc_seconds.labels(role).observe(seconds)
        if code == "DEADLINE_EXCEEDED":
            self.capacity_late_answers.labels(role, address).inc()

    def warm_up(self, source: str, dest: str, outcome: str) -> None:
        self.warmups.labels(source, dest, outcome).inc()

    def placed(self, role: str, address: str, cached_blocks: int) -> None:
        self.placements.labels(role, address, "yes" if cached_blocks else "no").inc()
        self.placement_hit_blocks.labels(role, address).inc(cached_blocks)

    def serve(self, host: str, port: int) -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port

    def observe(self, resp: Result, front: str | None = None) -> None:
        """A served request's response (``front``: counted under it too)."""
        if front is not None:
            self.front_requests.labels(front, "ok").inc()
        s, t = resp.stats, resp.timings
        path = Path(s.path).name.lower()
        self.requests.labels("ok", "OK").inc()
        self.paths.labels(path).inc()
        self.stage_seconds.labels("stage1").observe(t.stage1_ms / 1e3)
        self.stage_seconds.labels("stage2_first_step").observe(t.stage2_first_step_ms / 1e3)
        self.stage_seconds.labels("stage2").observe(t.stage2_ms / 1e3)
        self.stage_seconds.labels("total").observe(t.total_ms / 1e3)
        self.overhead_seconds.observe(t.router_overhead_ms / 1e3)
        if s.recomputed:
            self.recomputed.inc()
            if lease_ended(s.handoff_failure):
                self.expired_leases.inc()
        for move in resp.moves:
            self.moves.labels(move.reason.split(":")[0] or "move").inc()
        self.tokens_computed_d.inc(s.num_computed_tokens_first_step)
        self.beam_tokens_recomputed.inc(s.num_recomputed_beam_tokens)
        if s.path == Path.HANDOFF:
            self.handoff_bytes.inc(s.num_bytes_moved)
            self.tokens_imported.inc(s.num_imported_tokens)
            self.import_step_seconds.observe(t.stage2_first_step_ms / 1e3)

    def observe_served(self, front: str) -> None:
        """A request served without a GenerateResponse (a parent's stage 1)."""
        self.front_requests.labels(front, "ok").inc()

    def observe_error(self, code: grpc.StatusCode, message: str,
                      front: str | None = None) -> None:
        outcome = "cancelled" if code == grpc.StatusCode.CANCELLED else "error"
        self.requests.labels(outcome, code.name).inc()
        overload = (code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    and message.startswith(OVERLOAD_MESSAGE))
        if front is not None:
            self.front_requests.labels(front, "refused" if overload else outcome).inc()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            if overload:
                self.overload_rejections.labels(front or "grpc").inc()
            else:
                self.capacity_rejections.inc()
        if lease_ended(message):
            self.expired_leases.inc()


class _EngineCollector:
    def __init__(self, router) -> None:
        self.router = router

    def describe(self):
        return []  # collected at each scrape only (names checked there)

    def collect(self):
        up = GaugeMetricFamily("kvhandoff_router_engine_up",
                               "1 while the router routes to the engine (it answered its "
                               "last capacity polls)", labels=["role", "endpoint"])
        for role, endpoints in (("prefill", self.router.prefill),
                                ("decode", self.router.decode)):
            for ep in endpoints:
                up.add_metric([role, ep.address], 0 if ep.capacity is None else 1)
        yield up
        draining = GaugeMetricFamily("kvhandoff_router_engine_draining",
                                     "1 while the engine is drained (Router.Drain): no new "
                                     "work goes to it", labels=["role", "endpoint"])
        for role, endpoints in (("prefill", self.router.prefill),
                                ("decode", self.router.decode)):
            for ep in endpoints:
                draining.add_metric([role, ep.address], int(ep.draining))
        yield draining
        yield from _cache_index_metrics(self.router)
        yield from _chunk_metrics(self.router.chunks)
        reg = self.router.parents
        yield GaugeMetricFamily("kvhandoff_router_parents", "Parents the registry keeps for "
                                "continuations", value=len(reg))
        yield GaugeMetricFamily("kvhandoff_router_parents_held", "Parents whose blocks P "
                                "holds (until their leases end)", value=reg.num_held())
        yield GaugeMetricFamily("kvhandoff_router_parent_blocks_held", "P blocks held "
                                "parents keep (counted against --parent-pool-share)",
                                value=reg.held_blocks())
        evictions = CounterMetricFamily("kvhandoff_router_parent_evictions",
                                        "Parents forgotten (lru, ttl), whose hold on P "
                                        "ended early for newer ones (released), or "
                                        "released by their client (client)",
                                        labels=["reason"])
        for reason in ("lru", "ttl", "released", "client"):
            evictions.add_metric([reason], reg.evictions[reason])
        yield evictions
        conts = CounterMetricFamily("kvhandoff_router_continuations",
                                    "Continuations by outcome (imported: the parent's "
                                    "blocks were read from P; recomputed; not_found; "
                                    "refused)", labels=["outcome"])
        for outcome in ("imported", "recomputed", "not_found", "refused"):
            conts.add_metric([outcome], reg.continuations[outcome])
        yield conts


def _chunk_metrics(chunks):
    """The named KV chunks (``router.chunks``): how many, the blocks they hold on each
    P against its share, the requests that composed them and the chunks evicted."""
    listing = chunks.listing()
    yield GaugeMetricFamily("kvhandoff_router_chunks", "Named KV chunks registered",
                            value=len(listing.chunks))
    for name, doc, values in (
            ("chunk_blocks_held", "P blocks named KV chunks hold", listing.held_blocks),
            ("chunk_share_blocks", "P blocks named KV chunks may hold (--chunk-pool-share)",
             listing.share_blocks)):
        family = GaugeMetricFamily(f"kvhandoff_router_{name}", doc, labels=["endpoint"])
        for address, value in values.items():
            family.add_metric([address], value)
        yield family
    yield CounterMetricFamily("kvhandoff_router_chunk_compositions",
                              "Requests whose prompt started with named KV chunks",
                              value=chunks.compositions)
    yield CounterMetricFamily("kvhandoff_router_chunk_evictions",
                              "Named KV chunks evicted to make room for others",
                              value=listing.evictions)


def _cache_index_metrics(router):
    """Each engine's index of its prefix cache (``router.cache_index``, fed by
    ``router.cache_feed``): its size, and its feed's replays, restarts seen, resyncs
    that could not make it whole, batches it could not read and failures of the feed
    itself."""
    caches = router.pool.caches
    size = GaugeMetricFamily("kvhandoff_router_cache_index_blocks",
                             "Blocks the router's index says the engine's prefix cache "
                             "holds (from its KV events)", labels=["role", "endpoint"])
    counts = {name: CounterMetricFamily(f"kvhandoff_router_cache_index_{name}", doc,
                                        labels=["role", "endpoint"])
              for name, doc in (("replays", "Replays of an engine's KV events asked for "
                                            "(start, gap, engine restart)"),
                                ("incomplete", "Times an engine's index was cleared: its "
                                               "events could not be made whole"),
                                ("restarts", "Engine restarts seen in its KV events"),
                                ("malformed", "Batches of KV events that could not be "
                                              "read (skipped, index cleared)"),
                                ("failures", "Times the feed of an engine's KV events "
                                             "failed and was started again"))}
    for role, endpoints in (("prefill", router.prefill), ("decode", router.decode)):
        for ep in endpoints:
            feed = caches.feed(ep.address) if caches is not None else None
            if feed is None:
                continue
            size.add_metric([role, ep.address], len(feed.index))
            for name, family in counts.items():
                family.add_metric([role, ep.address], getattr(feed.stats, name))
    yield size
    yield from counts.values()

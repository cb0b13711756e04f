"""An engine server's Prometheus metrics: vLLM's own (its stat logger registers them on the
default registry of this process) plus the handoff's: exports, imports, NIXL transfers,
failures and lease expiries, and the pool."""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine import EngineCounters
from wire.grpc_server import loop_lag_histogram

#: ``kvhandoff_event_loop_lag_seconds{loop}`` of the engine server's loop (which also
#: runs vLLM's AsyncLLM output handler).
LOOP_LAG = loop_lag_histogram(REGISTRY)


class HandoffCounts:
    """Counted by the engine servicer."""

    def __init__(self) -> None:
        self.exports = 0
        self.imports = 0
        self.import_failures = 0


class EngineCollector:
    def __init__(self, servicer: Any):
        self.servicer = servicer

    def collect(self):
        s = self.servicer
        engine = s.engine
        c: EngineCounters = engine.counters if engine is not None else EngineCounters()
        labels = {"role": s.role, "engine_id": engine.engine_id if engine is not None else ""}

        def counter(name: str, doc: str, value: float):
            m = CounterMetricFamily(f"kvhandoff_engine_{name}", doc, labels=list(labels))
            m.add_metric(list(labels.values()), value)
            return m

        def gauge(name: str, doc: str, value: float):
            m = GaugeMetricFamily(f"kvhandoff_engine_{name}", doc, labels=list(labels))
            m.add_metric(list(labels.values()), value)
            return m

        n = s.counts
        yield counter("exports", "Parents exported by P under a lease", n.exports)
        yield counter("imports", "Handoffs imported (D: a parent for stage 2; P: a moved "
                      "stage 1)", n.imports)
        yield counter("import_failures", "Handoffs this engine refused or failed to import",
                      n.import_failures)
        yield counter("nixl_transfers", "NIXL READs completed (D)", c.transfers)
        yield counter("nixl_transfer_bytes", "Bytes moved by NIXL READs (D)", c.transfer_bytes)
        yield counter("nixl_transfer_seconds", "Time in NIXL READs (D)", c.transfer_s)
        yield counter("nixl_failed_transfers", "Failed NIXL transfers", c.failed_transfers)
        yield counter("nixl_failed_notifications", "Failed NIXL notifications",
                      c.failed_notifications)
        yield counter("nixl_failed_handshakes", "Failed NIXL handshakes", c.failed_handshakes)
        yield counter("lease_expiries", "Exported blocks released or READs discarded because "
                      "the lease ended", c.expired_leases)
        yield counter("prompt_tokens_computed", "Prompt tokens computed here",
                      c.prompt_tokens_computed)
        yield counter("prompt_tokens_cached", "Prompt tokens from the local prefix cache",
                      c.prompt_tokens_cached)
        yield counter("prompt_tokens_transferred", "Prompt tokens imported from another engine",
                      c.prompt_tokens_transferred)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache "
                      "(vLLM's prefix-cache stats)", c.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      c.prefix_cache_hits)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queried prompt tokens since "
                    "start", c.prefix_cache_hit_rate)
        yield counter("nixl_descriptors", "NIXL descriptors the READs posted after merging "
                      "(D)", c.transfer_descriptors)
        yield counter("faults_injected", "Injected faults (negative controls, only with "
                      "--fault-injection) that took effect here", c.faults_injected)
        yield counter("beam_fork_tokens", "Prompt tokens beam steps copied from a kept beam "
                      "on this engine instead of computing them", c.beam_fork_tokens)
        if engine is not None:
            snap = engine.pool()
            yield gauge("kv_blocks_total", "KV blocks in the pool", snap.num_total_blocks)
            yield gauge("kv_blocks_free", "KV blocks free", snap.num_free_blocks)
            yield gauge("running_requests", "Requests running", snap.num_running_reqs)


def serve_metrics(servicer: Any, host: str, port: int) -> int:
    """Serve this process's metrics; the caller runs ``watch_loop_lag(LOOP_LAG, role)``."""
    REGISTRY.register(EngineCollector(servicer))
    server, _ = start_http_server(port, addr=host, registry=REGISTRY)
    return server.server_port

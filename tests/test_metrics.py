"""The router's Prometheus endpoint: counters move by exactly what the responses say."""

from __future__ import annotations

import grpc
import pytest

from tests.utils import scrape_metrics
from tools.client import make_request

pytestmark = [pytest.mark.engines]


def _delta(before, after, name, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_router_metrics_count_what_the_responses_say(cluster, router_client, assert_cluster_clean):
    url = cluster["router_metrics"]
    before = scrape_metrics(url)
    handoff = router_client.generate(make_request(prompt="metrics please", max_tokens=12, seed=4,
                                                  beam_width=4, path="handoff"))
    colocated = router_client.generate(make_request(prompt="metrics please", max_tokens=12,
                                                    seed=4, beam_width=4, path="colocated"))
    with pytest.raises(grpc.RpcError):
        router_client.generate(make_request(prompt="x", beam_width=0))
    after = scrape_metrics(url)

    assert _delta(before, after, "kvhandoff_router_requests_total", outcome="ok", code="OK") == 2
    assert _delta(before, after, "kvhandoff_router_requests_total", outcome="error",
                  code="INVALID_ARGUMENT") == 1
    assert _delta(before, after, "kvhandoff_router_path_decisions_total", path="handoff") == 1
    assert _delta(before, after, "kvhandoff_router_path_decisions_total", path="colocated") == 1
    assert _delta(before, after, "kvhandoff_router_handoff_bytes_total") == \
        handoff.stats.num_bytes_moved > 0
    assert _delta(before, after, "kvhandoff_router_tokens_imported_total") == \
        handoff.stats.num_imported_tokens > 0
    assert _delta(before, after, "kvhandoff_router_tokens_computed_d_total") == \
        handoff.stats.num_computed_tokens_first_step + colocated.stats.num_computed_tokens_first_step
    assert _delta(before, after, "kvhandoff_router_stage_seconds_count", stage="total") == 2
    assert _delta(before, after, "kvhandoff_router_import_step_seconds_count") == 1
    for role, server in (("prefill", cluster["prefill"]), ("decode", cluster["decode"][0])):
        key = ("kvhandoff_router_engine_up", (("endpoint", server.address), ("role", role)))
        assert after[key] == 1
    # The router's warm-up before it served: one handoff P -> D, imported.
    p, d = cluster["prefill"].address, cluster["decode"][0].address
    key = ("kvhandoff_router_warmups_total",
           (("dest", d), ("outcome", "imported"), ("source", p)))
    assert after.get(key, 0) >= 1, [k for k in after if "warmups" in k[0]]
    assert_cluster_clean()


def test_engine_metrics_show_vllm_and_handoff_counters(cluster, router_client, assert_cluster_clean):
    p_url, d_url = cluster["prefill"].metrics_url, cluster["decode"][0].metrics_url
    p0, d0 = scrape_metrics(p_url), scrape_metrics(d_url)
    resp = router_client.generate(make_request(prompt=list(range(100, 180)), max_tokens=10,
                                               seed=9, beam_width=2, path="handoff"))
    assert_cluster_clean()
    p1, d1 = scrape_metrics(p_url), scrape_metrics(d_url)

    def d(before, after, name):
        keys = [k for k in after if k[0] == name]
        assert keys, f"{name} missing"
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    assert d(p0, p1, "kvhandoff_engine_exports_total") == 1
    assert d(d0, d1, "kvhandoff_engine_imports_total") == 1
    assert d(d0, d1, "kvhandoff_engine_nixl_transfers_total") == 1
    assert d(d0, d1, "kvhandoff_engine_nixl_transfer_bytes_total") == resp.stats.num_bytes_moved
    assert d(d0, d1, "kvhandoff_engine_prompt_tokens_transferred_total") == \
        resp.stats.num_imported_tokens
    # Beam steps 2.. copy their partial last block from the beam they extend (beam fork).
    assert d(d0, d1, "kvhandoff_engine_beam_fork_tokens_total") > 0
    # Prefix-cache lookups from vLLM's stats: P looked the prompt up; D's beam steps after
    # the import find the parent in D's cache.
    assert d(p0, p1, "kvhandoff_engine_prefix_cache_queries_total") >= 80
    assert d(d0, d1, "kvhandoff_engine_prefix_cache_hits_total") > 0
    rate = [v for k, v in d1.items() if k[0] == "kvhandoff_engine_prefix_cache_hit_rate"]
    assert len(rate) == 1 and 0 < rate[0] < 1
    assert d(d0, d1, "kvhandoff_engine_nixl_descriptors_total") >= 1
    # vLLM's own metrics are there too.
    assert any(k[0].startswith("vllm:") for k in d1)

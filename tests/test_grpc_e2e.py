"""End to end over real gRPC on loopback: router, P and D as separate processes
(`kvhandoff serve`), every request through the router's proto contract."""

from __future__ import annotations

import re
import time

import grpc
import pytest

from kvhandoff.v1 import common_pb2, engine_pb2
from tests.conftest import CLUSTER_LEASE_S, engine_stub
from tests.utils import (
    assert_handed_off,
    assert_identical,
    assert_idle_within,
    long_stage1_request,
    metric_sum,
)
from tools.client import make_request

PROMPT = "the user bought a warm coat and hiking boots so we think they like the outdoors"
#: A stage 2 of seconds that fits the cluster's D (135 blocks) whatever length stage 1
#: makes (the router counts the most any can need): one beam of 4000 tokens over a
#: 40-token prompt (43-44 tokens with stage 1's token and the suffix) needs 127 blocks.
#: Each of its 4000 beam steps is an engine step, 2-3 ms here (4 beams of 1000 tokens
#: took ~3 s, too short): ~9 s, long after
#: assert_idle_within's window on engines that a cancel or a deadline did not reach (the
#: tests time it on the cluster and check).
LONG_STAGE2_PROMPT = list(range(300, 340))
LONG_STAGE2 = {"beam_width": 1, "beam_tokens": 4000}
#: Stage-1 tokens of the requests cancelled or past their deadline in stage 1: exactly
#: this many (min_tokens = max_tokens), 2-5 ms each here, so 8 s or more of stage 1.
#: With PROMPT's 21 tokens, the suffix and 4 beams of 3 tokens the router reserves 132 of
#: D's 135 blocks for it (and the 4027 tokens fit the model's 4096).
STAGE1_TOKENS = 4000
#: assert_idle_within's window after a cancel or a deadline, and by how much the work
#: left at that point must outlast it for the idle check to be able to fail.
IDLE_S = 2.5
LEFT_MARGIN_S = 2.0


pytestmark = [pytest.mark.engines]


def test_unary_text_prompt_runs_both_stages_with_a_handoff(router_client, cluster, assert_cluster_clean):
    resp = router_client.generate(make_request(prompt=PROMPT, max_tokens=24, seed=3,
                                               beam_width=4, path="handoff"))
    s = resp.stats
    assert s.path == common_pb2.PATH_HANDOFF
    assert s.decode_endpoint == cluster["decode"][0].address
    assert len(resp.beams) == 4 and all(len(b.token_ids) == 3 for b in resp.beams)
    assert resp.thinking_text and all(isinstance(b.text, str) for b in resp.beams)
    assert s.num_parent_tokens == len(resp.prompt_token_ids) + len(resp.thinking_token_ids)
    assert_handed_off(resp)
    assert s.num_computed_tokens_first_step == len(resp.suffix_token_ids) + 1
    assert s.num_bytes_moved > 0
    assert resp.timings.total_ms >= resp.timings.stage1_ms > 0
    assert_cluster_clean()


def test_token_prompt_handoff_equals_colocated(router_client, assert_cluster_clean):
    ids = list(range(40, 140))
    got = router_client.generate(make_request(prompt=ids, max_tokens=32, seed=5, beam_width=8,
                                              path="handoff"))
    ref = router_client.generate(make_request(prompt=ids, max_tokens=32, seed=5, beam_width=8,
                                              path="colocated"))
    assert list(got.prompt_token_ids) == ids
    assert_identical(got, ref)  # its negative control: tests/test_identity_e2e.py
    # The second stage 1 of the prompt found its full blocks in P's prefix cache (the
    # cluster's one P, named by its engine id).
    assert ref.stats.num_cached_prompt_tokens >= 64, ref.stats
    assert ref.stats.prefill_engine_id == got.stats.prefill_engine_id != ""
    # Beam steps forked every beam's partial block on D: no context recomputed.
    assert got.stats.num_recomputed_beam_tokens == 0
    assert_cluster_clean()


def test_streaming_sends_stage1_tokens_then_the_result(router_client, assert_cluster_clean):
    events = list(router_client.generate_stream(make_request(prompt=PROMPT, max_tokens=40,
                                                             seed=11, path="handoff")))
    token_events = [e for e in events if e.HasField("stage1_tokens")]
    assert events[-1].HasField("result") and len(token_events) == len(events) - 1
    streamed = [t for e in token_events for t in e.stage1_tokens.ids]
    assert streamed == list(events[-1].result.thinking_token_ids)
    assert_handed_off(events[-1].result, found_on_d=True)
    assert len(token_events) >= 2, "tokens should arrive as they are sampled"
    assert_cluster_clean()


@pytest.mark.parametrize("kwargs,words", [
    ({"prompt": []}, "prompt: is empty"),
    ({"prompt": [5, 100000]}, "outside the vocabulary"),
    ({"prompt": [10] * 4100}, "exceeds the model length"),
    ({"beam_width": 0}, "beam.beam_width"),
    ({"beam_width": 513}, "beam.beam_width"),
    ({"max_tokens": 0}, "stage1.max_tokens"),
    ({"beam_tokens": 0}, "beam.max_tokens"),
    ({"temperature": -1.0}, "stage1.temperature"),
    ({"suffix": [1 << 30]}, "suffix"),
])
def test_bad_input_is_invalid_argument_naming_the_field(router_client, assert_cluster_clean,
                                                        kwargs, words):
    req = make_request(**{"prompt": PROMPT, **kwargs})
    with pytest.raises(grpc.RpcError) as err:
        router_client.generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.value.details()
    assert_cluster_clean(timeout_s=5)


def test_d_too_small_is_invalid_argument_with_numbers(router_client, assert_cluster_clean):
    """A request no D can ever hold is permanent: INVALID_ARGUMENT (HTTP 400, no
    Retry-After) naming the blocks it needs and the largest pool, not RESOURCE_EXHAUSTED
    (which OpenAI clients retry)."""
    req = make_request(prompt=[i % 1000 + 10 for i in range(2500)], max_tokens=4, seed=1, beam_width=64,
                       path="handoff")
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        router_client.generate(req, timeout=120)
    # The router knows D's pool: refused before stage 1, without waiting for room.
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(r"needs 1\d\d blocks", err.value.details()), err.value.details()
    assert "holds 135" in err.value.details() and time.monotonic() - t0 < 5
    assert_cluster_clean()


def test_handoff_for_another_prompt_sent_to_d_directly_is_refused(cluster, assert_cluster_clean):
    """The handoff is genuine (signed for this D) but the prompt does not continue its
    parent: the digest check refuses it before any READ. (Tampered handoffs are refused
    by their signature: tests/test_security.py.)"""
    p = engine_stub(cluster["prefill"].address)
    d = engine_stub(cluster["decode"][0].address)
    target = d.GetCapacity(engine_pb2.CapacityRequest(), timeout=10).handoff_target
    prompt = list(range(20, 90))
    events = list(p.Stage1(engine_pb2.Stage1Request(
        request_id="direct-1", prompt_token_ids=prompt, export=True, target_engine_id=target,
        sampling=common_pb2.Stage1Sampling(max_tokens=8, seed=2)), timeout=60))
    handoff = events[-1].handoff
    thinking = [t for e in events for t in e.new_token_ids]
    other = [prompt[0] + 1] + prompt[1:]
    with pytest.raises(grpc.RpcError) as err:
        d.Stage2(engine_pb2.Stage2Request(request_id="direct-2", handoff=handoff,
                                          prompt_token_ids=other + thinking + [3]), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "digest" in err.value.details()
    assert_cluster_clean()


def _long_stage1_request():
    """Exactly ``STAGE1_TOKENS`` stage-1 tokens: seconds of stage 1 on this cluster."""
    return long_stage1_request(PROMPT, STAGE1_TOKENS, temperature=0.0, path="handoff")


def _imports(server) -> float:
    return metric_sum(server.metrics_url, "kvhandoff_engine_imports_total")


@pytest.mark.fault
def test_cancel_during_stage1_aborts_it_and_frees_p(router_client, cluster,
                                                    assert_cluster_clean):
    """Cancelled a second into a stage 1 of seconds: P stops running it within
    ``IDLE_S``, and D never imports it. At the rate its tokens streamed, stage 1 still
    had more than ``IDLE_S + LEFT_MARGIN_S`` to run (checked: a P the cancel did not reach
    would fail the idle check)."""
    p, d = cluster["prefill"], cluster["decode"][0]
    imports_before = _imports(d)
    req = _long_stage1_request()
    stream = router_client.generate_stream(req, timeout=120)
    first = next(stream)
    assert first.HasField("stage1_tokens")
    t0, streamed = time.monotonic(), 0
    for event in stream:  # a second of stage 1's tokens
        streamed += len(event.stage1_tokens.ids)
        if time.monotonic() - t0 >= 1.0:
            break
    stream.cancel()
    rate = max(streamed, 1) / (time.monotonic() - t0)
    left_s = (STAGE1_TOKENS - len(first.stage1_tokens.ids) - streamed) / rate
    assert left_s > IDLE_S + LEFT_MARGIN_S, \
        f"stage 1 had ~{left_s:.1f}s left at the cancel: too little for the idle check"
    assert_idle_within([p, d], IDLE_S)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert_cluster_clean()
    assert _imports(d) == imports_before


def _wait_until_d_runs(cluster, timeout_s: float = 30.0) -> None:
    """Until D reports a stage 2 running (an event, not a sleep that hopes for it)."""
    d = engine_stub(cluster["decode"][0].address)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cap = d.GetCapacity(engine_pb2.CapacityRequest(), timeout=5)
        if cap.num_running_reqs or cap.num_reserved_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(f"D ran no stage 2 within {timeout_s:.0f}s")


def _timed_run(router_client, req) -> tuple[float, float]:
    """Run ``req`` (a stage 1 of one token) to its end: the seconds until its stage-1
    token, and those of stage 2 after it."""
    t0 = time.monotonic()
    stream = router_client.generate_stream(req, timeout=300)
    assert next(stream).HasField("stage1_tokens")  # stage 2 starts now
    stage1_s = time.monotonic() - t0
    events = list(stream)
    assert events[-1].HasField("result")
    return stage1_s, time.monotonic() - t0 - stage1_s


@pytest.mark.fault
def test_cancel_during_stage2_aborts_the_beams_and_frees_both(router_client, cluster,
                                                              assert_cluster_clean):
    """Cancelled once D runs the beams of a stage 2 of seconds: P and D run nothing
    within ``IDLE_S``. The same request run to its end first times stage 2 on this
    cluster: at the cancel more than ``IDLE_S + LEFT_MARGIN_S`` of it was left (checked:
    a D the cancel did not reach would fail the idle check)."""
    req = make_request(prompt=LONG_STAGE2_PROMPT, max_tokens=1, seed=1, path="handoff",
                       **LONG_STAGE2)
    _, stage2_s = _timed_run(router_client, req)
    stream = router_client.generate_stream(req, timeout=120)
    first = next(stream)  # stage 1's only token: stage 2 starts now
    assert first.HasField("stage1_tokens")
    t0 = time.monotonic()
    _wait_until_d_runs(cluster)
    stream.cancel()
    left_s = stage2_s - (time.monotonic() - t0)
    assert left_s > IDLE_S + LEFT_MARGIN_S, \
        f"stage 2 ({stage2_s:.1f}s) had ~{left_s:.1f}s left: too little for the idle check"
    assert_idle_within([cluster["prefill"], *cluster["decode"]], IDLE_S)
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    assert_cluster_clean()


def test_health_and_reflection_on_every_server(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {cluster["router"]: "kvhandoff.v1.Router",
                cluster["prefill"].address: "kvhandoff.v1.Engine",
                cluster["decode"][0].address: "kvhandoff.v1.Engine"}
    for address, service in expected.items():
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            responses = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for r in responses for s in r.list_services_response.service}
            assert service in names and "grpc.health.v1.Health" in names


def test_two_decode_endpoints_with_one_down(cluster, model_dir, tmp_path, assert_cluster_clean):
    """A router given a D that is down and a live one serves every request on the live
    one, by handoff (imported, not recomputed)."""
    from kvhandoff.ports import free_port
    from tools.client import RouterClient
    from tools.launch import spawn, stop, wait_serving

    dead = f"127.0.0.1:{free_port()}"
    live = cluster["decode"][0].address
    router = spawn("router", free_port(), ["--model", model_dir, "--prefill",
                                            cluster["prefill"].address, "--decode", f"{dead},{live}"],
                    tmp_path)
    try:
        wait_serving(router.address, [router], timeout_s=120)
        with RouterClient(router.address) as client:
            for seed in range(3):
                resp = client.generate(make_request(prompt=PROMPT, max_tokens=8, seed=seed,
                                                    path="handoff"))
                assert resp.stats.decode_endpoint == live
                # By handoff, not recomputed (D may hold PROMPT's blocks already).
                assert_handed_off(resp, found_on_d=True)
    finally:
        stop([router])
    assert_cluster_clean()


@pytest.mark.fault
@pytest.mark.parametrize("how", ["grpc_deadline", "timeout_ms"])
def test_deadline_during_stage1_is_deadline_exceeded_and_frees_p(router_client, cluster,
                                                                 assert_cluster_clean, how):
    """A deadline of 1.5 s (the call's, or the request's ``timeout_ms``) in a stage 1 of
    ``STAGE1_TOKENS`` (seconds more of it left): DEADLINE_EXCEEDED, P runs nothing within
    ``IDLE_S`` after, and D never imports it."""
    d = cluster["decode"][0]
    imports_before = _imports(d)
    req = _long_stage1_request()
    timeout = 120.0
    if how == "timeout_ms":
        req.timeout_ms = 1500
    else:
        timeout = 1.5
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        router_client.generate(req, timeout=timeout)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < 10
    assert_idle_within([cluster["prefill"], d], IDLE_S)  # stage 1 had seconds left
    assert_cluster_clean()
    assert _imports(d) == imports_before


@pytest.mark.fault
def test_deadline_during_stage2_is_deadline_exceeded_and_frees_both(router_client, cluster,
                                                                    assert_cluster_clean):
    """A deadline a fifth of the way into a stage 2 of seconds: DEADLINE_EXCEEDED on
    time, and P and D run nothing within ``IDLE_S`` after. The four fifths left outlast
    that by more than ``LEFT_MARGIN_S`` (checked: a D the deadline did not reach would
    fail the idle check)."""
    req = make_request(prompt=LONG_STAGE2_PROMPT, max_tokens=1, seed=2, path="handoff",
                       **LONG_STAGE2)
    # The deadline falls early in stage 2 as this cluster runs it (a fixed deadline
    # outlived stage 2 once D got faster): time one run, then repeat it with the deadline.
    stage1_s, stage2_s = _timed_run(router_client, req)
    left_s = stage2_s * 4 / 5
    assert left_s > IDLE_S + LEFT_MARGIN_S, \
        f"stage 2 took {stage2_s:.1f}s: too short for the idle check after its deadline"
    timeout = stage1_s + stage2_s / 5
    stream = router_client.generate_stream(req, timeout=timeout)
    t0 = time.monotonic()
    assert next(stream).HasField("stage1_tokens")
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (stage1_s, stage2_s)
    assert time.monotonic() - t0 < timeout + 10
    assert_idle_within([cluster["prefill"], *cluster["decode"]], IDLE_S)  # 4/5 of it left
    assert_cluster_clean()


@pytest.mark.beams
def test_beams_in_a_catalog_over_grpc_and_http_equal_colocated_and_fail_when_faulted(
        router_client, cluster, model_dir, assert_cluster_clean):
    """``beam.catalog`` through the router: by handoff, identical to the colocated
    reference (ids and logprobs), every beam an item of the shop; unknown catalogs are
    NOT_FOUND before stage 1 (no D has it; no P for the colocated path) and 404 over
    HTTP; over HTTP (``extra_body`` ``catalog``, the openai client) the beams are items
    too. The negative control: the same handoff with D's import faulted fails the check."""
    import openai
    from transformers import AutoTokenizer

    from kvhandoff.builtin.corpus import shop_items

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    shop = {tuple(tokenizer.convert_tokens_to_ids(item)) for item in shop_items()}
    prompt = "history: kettle tent coat mug lamp phone novel tea\n<think>"
    kw = dict(prompt=prompt, max_tokens=48, seed=4, beam_width=8, catalog="shop")
    got = router_client.generate(make_request(path="handoff", **kw))
    ref = router_client.generate(make_request(path="colocated", **kw))
    assert ref.stats.path == common_pb2.PATH_COLOCATED
    assert_handed_off(got)
    assert_identical(got, ref)
    assert got.beams and all(tuple(b.token_ids) in shop for b in got.beams)
    assert got.num_beams_short == 8 - len(got.beams)
    # The control: the same request unconstrained leaves the shop (the catalog reached
    # the engine's search, not only the router's checks).
    open_ = router_client.generate(make_request(path="handoff", **{**kw, "catalog": None}))
    assert any(tuple(b.token_ids) not in shop for b in open_.beams)
    for path, role in (("handoff", "decode"), ("colocated", "prefill")):
        with pytest.raises(grpc.RpcError) as e:
            router_client.generate(make_request(path=path, **{**kw, "catalog": "nope"}))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert f"no {role} engine has catalog 'nope' (theirs: shop;" in e.value.details()
    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key="unused", max_retries=0)
    text = prompt + " recent tech so</think>\n<|sid_begin|>"
    outs = {catalog: client.completions.create(
        model=model_dir, prompt=text, max_tokens=3, n=16,
        extra_body={"use_beam_search": True, **({"catalog": catalog} if catalog else {})})
        for catalog in ("shop", None)}
    assert len(outs["shop"].choices) == 16
    assert all(tuple(c.model_extra["token_ids"]) in shop for c in outs["shop"].choices)
    assert any(tuple(c.model_extra["token_ids"]) not in shop for c in outs[None].choices)
    with pytest.raises(openai.NotFoundError, match="catalog 'nope'"):
        client.completions.create(model=model_dir, prompt=prompt, max_tokens=3, n=4,
                                  extra_body={"use_beam_search": True, "catalog": "nope"})
    # A prompt no engine holds, so D reads (and the fault corrupts) the whole parent.
    kw["prompt"] = "history: boots map rope torch kayak compass stove tent\n<think>"
    ref = router_client.generate(make_request(path="colocated", **kw))
    faulted = make_request(path="handoff", **kw)
    faulted.fault = "zero-block"
    bad = router_client.generate(faulted)
    assert_handed_off(bad)
    with pytest.raises(AssertionError, match="cum_logprob|beams differ"):
        assert_identical(bad, ref)
    # (Its unfaulted pair is the first prompt's: D's prefix cache now holds this
    # parent's corrupted blocks, and a process cluster cannot empty it.)
    assert_cluster_clean()


@pytest.mark.beams
def test_a_handoff_d_refuses_before_reading_frees_ps_blocks_at_once(router_client, cluster,
                                                                     assert_cluster_clean):
    """D refuses a handoff before its scheduler sees it (here: beams too short for any
    item of the catalog, which only D checks): INVALID_ARGUMENT naming the field, after P
    ran stage 1 and exported. The router tells P to release the export, so P's pool is
    clean within seconds, not at the end of the lease (the control: with the release
    taken out, P still held the blocks at the check)."""
    t0 = time.monotonic()
    req = make_request(prompt=list(range(300, 360)), max_tokens=16, seed=9, beam_width=4,
                       beam_tokens=1, path="handoff", catalog="shop")
    with pytest.raises(grpc.RpcError) as err:
        router_client.generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "shortest item" in err.value.details(), err.value.details()
    assert_cluster_clean(timeout_s=8.0)  # the lease is CLUSTER_LEASE_S (30 s)
    assert time.monotonic() - t0 < CLUSTER_LEASE_S / 2

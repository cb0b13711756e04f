"""Named KV chunks through the router's processes (``router.chunks``): registered once on
P and held there through a flush of its prefix cache, composed as a chain into a
two-stage request that equals the same prompt sent whole (and the negative control: the
chunk's held blocks overwritten), evicted least recently used at the share, deleted with
P's pool back where it was, and every bad input refused with nothing held after."""

from __future__ import annotations

import time

import grpc
import pytest

from kvhandoff.v1 import common_pb2, engine_pb2, router_pb2
from tests.conftest import engine_stub
from tests.utils import assert_identical, metric_sum
from tools.client import make_request

pytestmark = [pytest.mark.engines, pytest.mark.chunks, pytest.mark.timeout(600)]


@pytest.fixture(autouse=True)
def _no_chunks_left(router_client):
    """A test that failed half-way leaves no chunk for the next to find (after the
    file's last test the cluster may be gone already, and its chunks with it)."""
    yield
    try:
        left = router_client.list_chunks(timeout=5).chunks
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return
    for chunk in left:
        if not chunk.under:
            router_client.delete_chunk(chunk.chunk_id)


def _ids(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + k * 131) % 980 for k in range(n)]


def _free_blocks(cluster, expected: int | None = None, timeout_s: float = 10.0) -> int:
    """P's free blocks, once they equal ``expected`` (a Release frees within a step or
    two), or as they are after ``timeout_s``."""
    stub = engine_stub(cluster["prefill"].address)
    deadline = time.monotonic() + timeout_s
    while True:
        free = stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=10).num_free_blocks
        if expected is None or free == expected or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


def _flush(cluster) -> None:
    """Push every unheld block out of P's prefix cache: distinct 1024-token prompts
    (one token sampled each), more blocks than P's pool, straight to P."""
    stub = engine_stub(cluster["prefill"].address)
    cap = stub.GetCapacity(engine_pb2.CapacityRequest(), timeout=10)
    length = 32 * cap.block_size
    for i in range(cap.num_total_blocks * cap.block_size // length + 2):
        prompt = [10 + (i * 977 + k * 31 + k * k) % 980 for k in range(length)]
        for _ in stub.Stage1(engine_pb2.Stage1Request(
                request_id=f"chunks-flush-{time.monotonic_ns()}-{i}", prompt_token_ids=prompt,
                sampling=common_pb2.Stage1Sampling(max_tokens=1, seed=0)), timeout=60):
            pass


def _request(prompt: list[int], seed: int, path: str, chunk_ids=None):
    return make_request(prompt=prompt, max_tokens=8, seed=seed, beam_width=4, beam_tokens=3,
                        path=path, chunk_ids=chunk_ids)


def _composed_and_whole(router_client, cluster, name: str, seed: int, fault: str = ""):
    """A 70-token root and a 100-token chunk under it (chain: 5 full blocks of 32 and
    10 tokens), held through a flush and composed with a 20-token query on the handoff
    path; then, the chunks deleted and P flushed, the same 190 tokens sent whole,
    colocated, nothing cached. ``fault`` overwrites the root's held blocks."""
    system, history, query = _ids(seed, 70), _ids(seed + 1, 100), _ids(seed + 2, 20)
    base = _free_blocks(cluster)
    root = router_client.register_chunk(system, f"{name}-sys", fault=fault)
    under = router_client.register_chunk(history, f"{name}-hist", under=f"{name}-sys")
    assert (root.num_blocks, under.num_blocks, under.num_chain_tokens) == (3, 4, 170)
    assert _free_blocks(cluster, base - 7) == base - 7, "P holds other than the chunks' 7 blocks"
    _flush(cluster)
    got = router_client.generate(_request(query, seed, "handoff",
                                          [f"{name}-sys", f"{name}-hist"]))
    assert list(got.prompt_token_ids) == system + history + query
    # Read from the held blocks: the chain's 5 full blocks, through the flush.
    assert got.stats.num_cached_prompt_tokens == 160, got.stats
    assert router_client.delete_chunk(f"{name}-sys") == [f"{name}-sys", f"{name}-hist"]
    assert _free_blocks(cluster, base) == base, "deleting the chunks did not free them"
    _flush(cluster)
    ref = router_client.generate(_request(system + history + query, seed, "colocated"))
    assert ref.stats.num_cached_prompt_tokens == 0, "the reference found a cache hit"
    return got, ref


def test_a_composed_chain_reads_its_held_blocks_and_equals_the_prompt_sent_whole(
        router_client, cluster, assert_cluster_clean):
    got, ref = _composed_and_whole(router_client, cluster, "exact", seed=11)
    assert_identical(got, ref)
    assert not router_client.list_chunks().chunks
    assert_cluster_clean()


def test_a_chunk_whose_held_blocks_were_overwritten_fails_the_identity(
        router_client, cluster, assert_cluster_clean):
    """The negative control: P overwrites the root chunk's blocks once it holds them
    (the ``stale`` fault); the composed request reads them, and the identity check
    that passes above must fail."""
    got, ref = _composed_and_whole(router_client, cluster, "stale", seed=41, fault="stale")
    with pytest.raises(AssertionError, match="differs|cum_logprob"):
        assert_identical(got, ref)
    _flush(cluster)  # the overwritten blocks leave P's prefix cache
    assert_cluster_clean()


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_chunks_are_evicted_least_recently_used_and_bad_input_holds_nothing(
        router_client, cluster, assert_cluster_clean):
    """P's share for chunks (a quarter of its ~512 blocks) holds two 47-block chunks, not
    three: the third evicts the one used least recently. Every bad call names what is
    wrong, and P holds nothing more after it."""
    p = cluster["prefill"].address
    base = _free_blocks(cluster)
    total = engine_stub(p).GetCapacity(engine_pb2.CapacityRequest(),
                                       timeout=10).num_total_blocks
    listing = router_client.list_chunks()
    assert listing.share_blocks[p] == int(total * 0.25) and listing.held_blocks[p] == 0
    assert 2 * 47 <= int(total * 0.25) < 3 * 47
    metrics = cluster["router_metrics"]
    counted = {name: metric_sum(metrics, f"kvhandoff_router_chunk_{name}_total")
               for name in ("evictions", "compositions")}
    for name, seed in (("a", 21), ("b", 22)):
        assert router_client.register_chunk(_ids(seed, 1500), name).num_blocks == 47
    router_client.generate(_request(_ids(23, 10), 23, "handoff", ["a"]))  # b: least recent
    evictions = listing.evictions
    router_client.register_chunk(_ids(24, 1500), "c")
    listing = router_client.list_chunks()
    assert sorted(c.chunk_id for c in listing.chunks) == ["a", "c"]
    assert listing.evictions == evictions + 1 and listing.held_blocks[p] == 94
    assert _free_blocks(cluster, base - 94) == base - 94, "the evicted chunk was not freed"
    # The router's metrics say the same.
    assert metric_sum(metrics, "kvhandoff_router_chunks") == 2
    assert metric_sum(metrics, "kvhandoff_router_chunk_blocks_held", endpoint=p) == 94
    for name in ("evictions", "compositions"):
        assert metric_sum(metrics, f"kvhandoff_router_chunk_{name}_total") \
            == counted[name] + 1, name

    bad = [
        (lambda: router_client.generate(_request(_ids(25, 10), 25, "handoff", ["b"])),
         grpc.StatusCode.NOT_FOUND, "chunk 'b' is unknown"),
        (lambda: router_client.generate(_request(_ids(25, 10), 25, "handoff", ["a", "c"])),
         grpc.StatusCode.FAILED_PRECONDITION, "not a registered chain"),
        (lambda: router_client.generate(_request(_ids(25, 3000), 25, "handoff", ["a"])),
         grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (lambda: router_client.register_chunk(_ids(26, 10), "d", under="gone"),
         grpc.StatusCode.NOT_FOUND, "chunk 'gone' is unknown"),
        (lambda: router_client.register_chunk(_ids(26, 10), "d", under="a", adapter="x"),
         grpc.StatusCode.FAILED_PRECONDITION, "no adapter (the base model)"),
        (lambda: router_client.register_chunk(_ids(26, 10), "a"),
         grpc.StatusCode.ALREADY_EXISTS, "chunk 'a' exists"),
        (lambda: router_client.register_chunk([], "d"),
         grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
        (lambda: router_client.register_chunk(_ids(26, 10), "bad name"),
         grpc.StatusCode.INVALID_ARGUMENT, "chunk_id"),
        (lambda: router_client.delete_chunk("gone"),
         grpc.StatusCode.NOT_FOUND, "chunk 'gone' is unknown"),
    ]
    for call, code, text in bad:
        got_code, details = _code(call)
        assert (got_code, text in details) == (code, True), (got_code, details)
    assert _free_blocks(cluster, base - 94) == base - 94, "a refused call left blocks held"
    assert router_client.delete_chunk("a") == ["a"] and router_client.delete_chunk("c") == ["c"]
    assert _free_blocks(cluster, base) == base
    assert_cluster_clean()


@pytest.mark.http
def test_chunks_over_http_register_compose_list_and_delete(router_client, cluster,
                                                           assert_cluster_clean):
    """``/v1/chunks`` and a completion whose ``chunks`` (an ``extra_body`` field in
    OpenAI's client) start its prompt."""
    import httpx

    http = cluster["http"]
    system, query = _ids(31, 64), _ids(32, 8)
    made = httpx.post(f"{http}/v1/chunks", json={"chunk_id": "h-sys", "prompt": system},
                      timeout=60).json()
    assert (made["id"], made["num_chain_tokens"], made["num_blocks"]) == ("h-sys", 64, 2)
    assert [c["id"] for c in httpx.get(f"{http}/v1/chunks", timeout=30).json()["data"]] \
        == ["h-sys"]
    done = httpx.post(f"{http}/v1/completions", json={
        "prompt": query, "chunks": ["h-sys"], "max_tokens": 4, "seed": 5}, timeout=60).json()
    assert done["usage"]["prompt_tokens"] == 72, done
    router_client.release_parent(done["id"])
    missing = httpx.post(f"{http}/v1/completions", json={
        "prompt": query, "chunks": ["nope"], "max_tokens": 4}, timeout=60)
    assert missing.status_code == 404 and "chunk 'nope'" in missing.json()["error"]["message"]
    assert httpx.delete(f"{http}/v1/chunks/h-sys", timeout=30).json()["deleted"] == ["h-sys"]
    assert httpx.delete(f"{http}/v1/chunks/h-sys", timeout=30).status_code == 404
    assert_cluster_clean()


def test_chunks_prefilled_apart_compose_approximately_and_say_so(
        router_client, cluster, assert_cluster_clean):
    """Two roots composed in either order with a recompute share: P copies their KV
    (keys moved) and computes the last share of their tokens and the query; the answer
    says approximate, with what was copied. At share 1 nothing is copied: flagged exact
    and identical to the prompt sent whole. Asked of a chain, it is the exact path; bad
    shares and paths are refused, and nothing stays held."""
    import math

    base = _free_blocks(cluster)
    system, doc, query = _ids(51, 64), _ids(52, 96), _ids(53, 12)
    router_client.register_chunk(system, "ap-sys")
    router_client.register_chunk(doc, "ap-doc")
    code, details = _code(lambda: router_client.generate(_request(query, 5, "handoff",
                                                                  ["ap-doc", "ap-sys"])))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "approximate" in details

    def composed(ids, share, path="handoff"):
        return router_client.generate(make_request(
            prompt=query, max_tokens=8, seed=5, beam_width=4, beam_tokens=3, path=path,
            chunk_ids=ids, recompute_share=share))

    got = composed(["ap-doc", "ap-sys"], 0.15)
    assert list(got.prompt_token_ids) == doc + system + query
    loaded = 160 - math.ceil(0.15 * 160)
    assert (got.stats.approximate, got.stats.num_blended_tokens) == (True, loaded), got.stats
    assert got.stats.recomputed_share == pytest.approx(1 - loaded / 160, abs=1e-6)
    assert got.stats.path == common_pb2.PATH_HANDOFF and got.beams
    # All recomputed: nothing copied, not approximate, the same as the prompt whole.
    whole = composed(["ap-sys", "ap-doc"], 1.0)
    assert (whole.stats.approximate, whole.stats.num_blended_tokens) == (False, 0)
    assert whole.stats.recomputed_share == 1.0
    ref = router_client.generate(_request(system + doc + query, 5, "colocated"))
    assert_identical(whole, ref)
    # The control: the same order with nothing recomputed is approximate, and the
    # identity check catches it.
    near = composed(["ap-sys", "ap-doc"], 0.0)
    assert near.stats.approximate and near.stats.num_blended_tokens == 160
    with pytest.raises(AssertionError, match="differs|cum_logprob"):
        assert_identical(near, ref)
    # A parent (StartParent) composed the same way says so too.
    parent_req = router_pb2.ParentRequest(chunk_ids=["ap-doc", "ap-sys"], recompute_share=0.15)
    parent_req.prompt_token_ids.ids.extend(query)
    parent_req.stage1.max_tokens = 4
    (parent,) = [e.parent for e in router_client.stub.StartParent(parent_req, timeout=120)
                 if e.HasField("parent")]
    assert (parent.approximate, parent.num_blended_tokens) == (True, loaded), parent
    router_client.release_parent(parent.parent_id)
    # A chain asked approximately is composed exactly.
    chain = composed(["ap-sys"], 0.15)
    assert not chain.stats.approximate and chain.stats.num_cached_prompt_tokens == 64
    for call, code, text in (
            (lambda: composed(["ap-doc", "ap-sys"], 1.5), grpc.StatusCode.INVALID_ARGUMENT,
             "recompute_share"),
            (lambda: composed([], 0.15), grpc.StatusCode.INVALID_ARGUMENT, "chunk_ids"),
            (lambda: composed(["ap-doc", "ap-sys"], 0.15, "colocated"),
             grpc.StatusCode.INVALID_ARGUMENT, "decode engine")):
        got_code, details = _code(call)
        assert (got_code, text in details) == (code, True), (got_code, details)
    assert router_client.delete_chunk("ap-sys") == ["ap-sys"]
    assert router_client.delete_chunk("ap-doc") == ["ap-doc"]
    assert _free_blocks(cluster, base) == base, "the composition left blocks held"
    assert_cluster_clean()


@pytest.mark.http
def test_an_approximate_composition_over_http(router_client, cluster, assert_cluster_clean):
    """``chunks`` with ``recompute_share`` (extra_body fields): the completion is a parent
    whose answer says approximate; its continuation says so too."""
    import httpx

    http = cluster["http"]
    for name, seed in (("ha-a", 61), ("ha-b", 62)):
        router_client.register_chunk(_ids(seed, 40), name)
    done = httpx.post(f"{http}/v1/completions", json={
        "prompt": _ids(63, 6), "chunks": ["ha-b", "ha-a"], "recompute_share": 0.3,
        "max_tokens": 4, "seed": 5}, timeout=60).json()
    info = done["kvhandoff"]
    assert info["approximate"] is True and info["num_blended_tokens"] == 80 - 24, info
    more = httpx.post(f"{http}/v1/completions", json={
        "prompt": "", "continuation_of": done["id"], "use_beam_search": True, "n": 2,
        "max_tokens": 2}, timeout=60).json()
    assert more["kvhandoff"]["approximate"] is True, more
    router_client.release_parent(done["id"])
    for name in ("ha-a", "ha-b"):
        router_client.delete_chunk(name)
    assert_cluster_clean()

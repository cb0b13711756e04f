"""Bad input at scale (hypothesis) against the real router and D: random field values,
sizes, unicode, huge token lists, unknown enum values, and malformed handoffs sent
straight to D, signed with the cluster's secret so they get past the signature check to
the digest, lease, capacity and READ checks. Every call ends with a well-formed status
(never UNKNOWN or INTERNAL, never a stack trace), no engine dies, no block leaks, and the
valid requests mixed in succeed.

A fresh seed each run (printed; ``KVHANDOFF_FUZZ_SEED=N`` replays a run)."""

from __future__ import annotations

import os
import random
import time

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import seed as fuzz_seed
from hypothesis import strategies as st

from connector.handoff import token_digest
from connector.signing import load_secret, sign
from kvhandoff.ports import free_port
from kvhandoff.v1 import common_pb2, engine_pb2, router_pb2
from server.convert import handoff_from_pb
from tests.conftest import engine_stub

pytestmark = [pytest.mark.engines, pytest.mark.fuzz]

#: Codes a bad request may get; UNKNOWN and INTERNAL would mean an unmapped failure.
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OUT_OF_RANGE}
SEED = int(os.environ.get("KVHANDOFF_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"\nfuzz seed {SEED} (replay: KVHANDOFF_FUZZ_SEED={SEED})")

u32 = st.integers(0, 2**32 - 1)
ids = st.lists(st.integers(-2**31, 2**31 - 1), max_size=64) | st.lists(
    st.integers(0, 2000), min_size=0, max_size=300) | st.just(list(range(5000)))
text = st.text(max_size=300) | st.just("\u202e\x00\ud7ff" * 50) | st.just("x" * 20000)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def generate_requests(draw):
    req = router_pb2.GenerateRequest(request_id=draw(st.text(max_size=200)))
    if draw(st.booleans()):
        req.prompt_text = draw(text)
    else:
        req.prompt_token_ids.ids.extend(draw(ids))
    which = draw(st.sampled_from(["none", "text", "ids"]))
    if which == "text":
        req.suffix_text = draw(text)
    elif which == "ids":
        req.suffix_token_ids.ids.extend(draw(ids))
    s = req.stage1
    for name, strategy in (("max_tokens", st.integers(0, 64) | u32),
                           ("temperature", floats), ("top_p", floats), ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(s, name, draw(strategy))
    s.top_k = draw(st.integers(0, 100) | u32)
    s.stop_token_ids.extend(draw(st.lists(st.integers(-2**31, 2**31 - 1), max_size=4)))
    b = req.beam
    for name, strategy in (("beam_width", st.integers(0, 8) | u32),
                           ("max_tokens", st.integers(0, 4) | u32), ("length_penalty", floats)):
        if draw(st.booleans()):
            setattr(b, name, draw(strategy))
    req.path = draw(st.integers(0, 4))  # 3, 4: unknown enum values
    req.timeout_ms = draw(st.integers(1, 4000))  # requests that are valid still end soon
    return req


@st.composite
def valid_requests(draw):
    """Well-formed requests, which must succeed (a fuzzer that only ever gets errors
    would pass on a server that refuses everything)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    req = router_pb2.GenerateRequest(request_id=f"fuzz-ok-{draw(st.integers(0, 10**9))}")
    req.prompt_token_ids.ids.extend(rng.randrange(10, 1000) for _ in range(rng.randint(1, 200)))
    req.stage1.max_tokens = draw(st.integers(1, 16))
    req.stage1.seed = draw(st.integers(0, 2**32))
    req.beam.beam_width = draw(st.integers(1, 4))
    req.beam.max_tokens = draw(st.integers(1, 3))
    req.path = draw(st.sampled_from([0, 1, 2]))
    return req


def _check_status(err: grpc.RpcError) -> None:
    assert err.code() in ALLOWED, (err.code(), err.details())
    assert err.details() and "Traceback" not in err.details()


def _check_status_or_unreachable(err: grpc.RpcError) -> None:
    """A signed handoff with the right digest reaches the READ, which fails cleanly:
    nothing listens where it says P is."""
    if err.code() == grpc.StatusCode.UNAVAILABLE:
        assert "Traceback" not in (err.details() or "")
        return
    _check_status(err)


def test_fuzzed_generate_requests_get_clean_statuses(router_client, cluster,
                                                    assert_cluster_clean):
    seen: dict[str, int] = {}

    @fuzz_seed(SEED)
    @FUZZ
    @given(generate_requests() | valid_requests())
    # However a seed draws, one request is well-formed and one is not.
    @example(router_pb2.GenerateRequest(
        request_id="fuzz-ok-example", prompt_token_ids=common_pb2.TokenIds(ids=[10, 11, 12]),
        stage1=common_pb2.Stage1Sampling(max_tokens=4, seed=1),
        beam=common_pb2.BeamSearch(beam_width=2, max_tokens=2)))
    @example(router_pb2.GenerateRequest(request_id="fuzz-empty-example"))
    def one(req):
        try:
            router_client.generate(req, timeout=60)
            seen["OK"] = seen.get("OK", 0) + 1
        except grpc.RpcError as e:
            _check_status(e)
            seen[e.code().name] = seen.get(e.code().name, 0) + 1

    one()
    assert seen.get("INVALID_ARGUMENT", 0) > 0, seen
    assert seen.get("OK", 0) > 0, seen
    for server in [cluster["prefill"], *cluster["decode"]]:
        assert server.proc.poll() is None, f"{server.role} died"
    assert_cluster_clean()


@st.composite
def handoffs(draw):
    h = common_pb2.Handoff(
        protocol_version=draw(st.integers(0, 4)), model_fingerprint=draw(st.text(max_size=40)),
        engine_id=draw(st.text(max_size=40)), request_id=draw(st.text(max_size=40)),
        num_parent_tokens=draw(u32), num_computed_tokens=draw(u32),
        token_digest=draw(st.text(max_size=70)), block_size=draw(u32), num_blocks=draw(u32),
        kv_bytes_per_block=draw(st.integers(0, 2**64 - 1)),
        lease_expires_at=draw(st.floats(allow_nan=True, allow_infinity=True)),
        remote_host=draw(st.text(max_size=30)), remote_port=draw(st.integers(0, 65535)),
        tp_size=draw(st.integers(0, 4)), target_engine_id=draw(st.text(max_size=30)),
        signature=draw(st.text(max_size=70)))
    for group in draw(st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=40),
                               max_size=3)):
        h.remote_block_ids.add(ids=group)
    return h


def test_fuzzed_handoffs_sent_straight_to_d_are_refused_cleanly(cluster, model_dir,
                                                               assert_cluster_clean):
    from connector.handoff import PROTOCOL_VERSION
    from kvhandoff.model import model_fingerprint

    fingerprint = model_fingerprint(model_dir)
    d = engine_stub(cluster["decode"][0].address)
    target = d.GetCapacity(engine_pb2.CapacityRequest(), timeout=5).handoff_target
    secret = load_secret(str(cluster["secret_file"]))
    nobody = free_port()  # a loopback port nothing listens on: a READ fails at once
    seen: dict[str, int] = {}
    reached: list[str] = []

    @fuzz_seed(SEED)
    @FUZZ
    # A signed+digest case waits out vLLM's 5 s NIXL handshake with the P nobody is (its
    # base_worker's fixed timeout): one case in five, not in three (about 8 of 40).
    @given(handoffs(), ids, st.sampled_from(["as drawn", "as drawn", "signed", "signed",
                                             "signed+digest"]))
    # However few signed+digest cases a seed draws, one always goes through to the READ.
    @example(common_pb2.Handoff(), list(range(40)), "signed+digest")
    def one(handoff, prompt, how):
        if how != "as drawn":
            # Past the signature check: addressed to this D, on loopback only.
            handoff.target_engine_id = target
            handoff.remote_host, handoff.remote_port = "127.0.0.1", nobody
            if how == "signed+digest":
                # Well-formed but for P's whereabouts: through every check to the READ.
                prompt = [10 + abs(t) % 1000 for t in prompt[:2000]] + [10, 11]
                # Drawn ids may be empty, which D refuses as malformed before the READ.
                handoff.engine_id = f"fuzz-p-{len(handoff.engine_id)}"
                handoff.request_id = f"fuzz-parent-{len(handoff.request_id)}"
                handoff.protocol_version = PROTOCOL_VERSION
                handoff.model_fingerprint = fingerprint
                handoff.num_parent_tokens = len(prompt)
                handoff.num_computed_tokens = len(prompt) - 1
                handoff.token_digest = token_digest(prompt)
                handoff.block_size = 32
                handoff.num_blocks = -(-(len(prompt) - 1) // 32)
                del handoff.remote_block_ids[:]
                handoff.remote_block_ids.add(ids=list(range(handoff.num_blocks)))
                handoff.tp_size = 1
                handoff.dcp_size = handoff.pp_size = 1
                handoff.num_pool_blocks = 1 << 20
                handoff.kv_bytes_per_block = max(handoff.kv_bytes_per_block, 1)
                handoff.exported_at = time.time()
                handoff.lease_expires_at = time.time() + 20
            handoff.signature = ""
            handoff.signature = sign(handoff_from_pb(handoff), secret)
        with pytest.raises(grpc.RpcError) as err:
            d.Stage2(engine_pb2.Stage2Request(
                request_id="fuzz-d", prompt_token_ids=prompt, handoff=handoff,
                beam=common_pb2.BeamSearch(beam_width=2, max_tokens=2)), timeout=60)
        _check_status_or_unreachable(err.value)
        seen[err.value.code().name] = seen.get(err.value.code().name, 0) + 1
        if how == "signed+digest":
            reached.append(f"{err.value.code().name}: {err.value.details()}")

    one()
    assert set(seen) <= {"INVALID_ARGUMENT", "PERMISSION_DENIED", "FAILED_PRECONDITION",
                         "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, seen
    # Signed, well-formed handoffs got past the signature, digest and lease checks to
    # D's capacity check or the READ (which fails: nobody listens where P should be).
    deeper = [r for r in reached if r.startswith(("RESOURCE_EXHAUSTED", "UNAVAILABLE"))]
    assert deeper, (seen, reached)
    print(f"fuzzed handoffs: {seen}; past the signature: {len(reached)}, e.g. {reached[:3]}")
    assert cluster["decode"][0].proc.poll() is None
    assert_cluster_clean()

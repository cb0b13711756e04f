"""vllm#52234's cases end to end ("200 with another prompt's answer after stale KV
references"): P restarted at the same address between its export and D's READ, and a
request id used twice at once. Each ends in an error or a flagged recompute, never a
200 whose tokens differ from the same request run colocated on one engine.

One P, one D and a router of their own (P is killed and started again here, so not the
shared ``cluster``); the tests run in file order: the duplicate ids first, on the first
P, then the restarts. Lease: longer than a restart of P on 2 busy cores, so the restarted
cases reach the READ instead of being refused as expired at admission.

The other cases of the issue are covered elsewhere: the lease ending during the READ
(tests/test_bad_input.py ``test_d_fences_the_read_on_ps_clock``,
tests/test_hosts.py ``test_p_link_down_during_the_read_is_recomputed_and_p_comes_back``),
D restarted mid-import (tests/test_faults.py
``test_d_killed_mid_request_is_recomputed_on_the_other_d``,
``test_a_restarted_d_is_noticed_and_used_again``)."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import subprocess
import threading
import time

import grpc
import pytest

from kvhandoff.v1 import common_pb2, engine_pb2, router_pb2, router_pb2_grpc
from tests.conftest import engine_stub
from tests.utils import assert_identical, assert_servers_clean
from tools.client import RouterClient, make_request

pytestmark = [pytest.mark.engines, pytest.mark.fault, pytest.mark.timeout(900)]

LEASE_S = 120
BEAM = common_pb2.BeamSearch(beam_width=4, max_tokens=3)
SUFFIX = [3]


@pytest.fixture(scope="module")
def trio(model_dir, tmp_path_factory):
    """P, D (signed handoffs) and a router over them, each its own process."""
    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    log_dir = tmp_path_factory.mktemp("stale-kv-logs")
    secret = log_dir / "handoff.secret"
    secret.touch()
    secret.chmod(0o600)
    secret.write_text(secrets.token_hex(32))
    engine = ["--model", model_dir, "--lease-s", str(LEASE_S),
              "--handoff-secret-file", str(secret)]
    servers = {}
    try:
        servers["p"] = spawn("prefill", free_port(), [*engine, "--kv-cache-mib", "64"],
                             log_dir)
        servers["d"] = spawn("decode", free_port(), [*engine, "--kv-cache-mib", "40"],
                             log_dir)
        for name in ("p", "d"):
            wait_serving(servers[name].address, list(servers.values()))
        servers["router"] = spawn("router", free_port(), [
            "--model", model_dir, "--prefill", servers["p"].address,
            "--decode", servers["d"].address], log_dir)
        wait_serving(servers["router"].address, list(servers.values()))
        yield servers
    finally:
        stop(list(servers.values()))


def _engine_id(server) -> str:
    return engine_stub(server.address).GetCapacity(engine_pb2.CapacityRequest(),
                                                   timeout=10).engine_id


def _restart_p(trio) -> None:
    """Kill P's process group and start the same command again: the same gRPC port and
    the same NIXL side-channel port (tools.launch.spawn put both on its command line)."""
    from tools.launch import ServerProcess, wait_serving

    old = trio["p"]
    assert "--side-channel-port" in old.proc.args, old.proc.args
    with contextlib.suppress(ProcessLookupError):
        os.killpg(old.proc.pid, signal.SIGKILL)
    old.proc.wait(timeout=30)
    with open(old.log_path, "a") as log:
        proc = subprocess.Popen(old.proc.args, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    trio["p"] = ServerProcess(old.role, old.address, proc, old.log_path, old.metrics_url)
    wait_serving(old.address, [trio["p"]])


def _prompt(name: str, length: int = 70) -> list[int]:
    rng = random.Random(name)
    return [rng.randrange(10, 1000) for _ in range(length)]


def _export(trio, request_id: str, prompt: list[int]):
    """Stage 1 on P, exported for D: (the handoff, the stage-1 tokens)."""
    target = engine_stub(trio["d"].address).GetCapacity(engine_pb2.CapacityRequest(),
                                                        timeout=10).handoff_target
    events = list(engine_stub(trio["p"].address).Stage1(engine_pb2.Stage1Request(
        request_id=request_id, prompt_token_ids=prompt, export=True, target_engine_id=target,
        sampling=common_pb2.Stage1Sampling(max_tokens=8, temperature=1.0, seed=2)),
        timeout=120))
    return events[-1].handoff, [t for e in events for t in e.new_token_ids]


def _stage2(server, request_id: str, prompt: list[int], handoff=None):
    req = engine_pb2.Stage2Request(request_id=request_id, prompt_token_ids=prompt, beam=BEAM)
    if handoff is not None:
        req.handoff.CopyFrom(handoff)
    return engine_stub(server.address).Stage2(req, timeout=180)


def _beams(resp) -> list[tuple[list[int], float]]:
    return [(list(b.token_ids), b.cum_logprob) for b in resp.beams]


def _assert_same_beams(got, ref) -> None:
    """Beam token ids equal, cumulative logprobs within the harness's bound."""
    from tools.harness import LOGPROB_TOLERANCE

    assert [t for t, _ in _beams(got)] == [t for t, _ in _beams(ref)], "beams differ"
    for (_, a), (_, b) in zip(_beams(got), _beams(ref)):
        assert abs(a - b) <= LOGPROB_TOLERANCE, f"cum_logprob {a} vs {b} (colocated)"


def _colocated(trio, request_id: str, prompt: list[int]):
    """The reference: the same stage 2 computed on P from the tokens (the colocated
    path's engine), nothing imported."""
    ref = _stage2(trio["p"], request_id, prompt)
    assert ref.num_imported_tokens == 0
    return ref


def _at_once(*calls):
    """Run ``calls`` in threads released together: each one's result or RpcError."""
    results: list = [None] * len(calls)
    start = threading.Barrier(len(calls))

    def run(i, call):
        start.wait()
        try:
            results[i] = call()
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def _refused_naming(result, request_id: str) -> bool:
    return (isinstance(result, grpc.RpcError)
            and result.code() == grpc.StatusCode.INVALID_ARGUMENT
            and request_id in result.details())


def _clean(trio) -> None:
    assert_servers_clean([trio["p"], trio["d"]], timeout_s=LEASE_S + 10.0)


# ---- a duplicated request id ------------------------------------------------------------

def test_two_stage_2s_with_one_id_at_once_on_d_never_swap_answers(trio):
    """Two exports of two prompts, both sent to D at once under one request id: each
    call gets its own prompt's beams (as P computes them colocated) or INVALID_ARGUMENT
    naming the id; a refused handoff is still good for a call under another id."""
    # STEP 1: two parents, exported on P for D.
    prompts = {k: _prompt(f"dup-d-{k}") for k in "ab"}
    exported = {k: _export(trio, f"dup-d-{k}-s1", prompts[k]) for k in "ab"}
    full = {k: prompts[k] + exported[k][1] + SUFFIX for k in "ab"}
    # STEP 2: both stage 2s at once, one id.
    results = dict(zip("ab", _at_once(*(
        lambda k=k: _stage2(trio["d"], "dup-d", full[k], exported[k][0]) for k in "ab"))))
    # STEP 3: the references, computed on P (after: D's cache holds nothing of them first).
    refs = {k: _colocated(trio, f"dup-d-{k}-ref", full[k]) for k in "ab"}
    # The control: the two answers tell the prompts apart (a swap would fail STEP 4).
    assert _beams(refs["a"]) != _beams(refs["b"])
    # STEP 4: each its own answer, or refused naming the id (and then read under another).
    for k in "ab":
        got = results[k]
        if _refused_naming(got, "dup-d"):
            got = _stage2(trio["d"], f"dup-d-{k}-again", full[k], exported[k][0])
        assert not isinstance(got, grpc.RpcError), f"{k}: {got}"
        assert got.num_imported_tokens == len(full[k]) - len(SUFFIX) - 1, got
        _assert_same_beams(got, refs[k])
    _clean(trio)


def test_one_id_exported_twice_on_p_reads_each_parent_of_its_own(trio):
    """P exports two prompts one after the other under one request id, and D reads
    both afterwards: each read gives its own prompt's beams, or fails clearly (never
    the other parent's blocks: P keyed its export by the id)."""
    prompts = {k: _prompt(f"dup-p-{k}", 90) for k in "ab"}
    exported = {}
    for k in "ab":
        try:
            exported[k] = _export(trio, "dup-p-s1", prompts[k])
        except grpc.RpcError as e:  # P may refuse the second: it holds the first's
            assert k == "b" and _refused_naming(e, "dup-p-s1"), e
    full = {k: prompts[k] + exported[k][1] + SUFFIX for k in exported}
    results = {k: _stage2(trio["d"], f"dup-p-{k}", full[k], exported[k][0])
               for k in exported}
    refs = {k: _colocated(trio, f"dup-p-{k}-ref", full[k]) for k in exported}
    if len(refs) == 2:
        assert _beams(refs["a"]) != _beams(refs["b"])  # the control: a swap would show
    for k, got in results.items():
        assert got.num_imported_tokens == len(full[k]) - len(SUFFIX) - 1, got
        _assert_same_beams(got, refs[k])
    _clean(trio)


def _router_stub(trio):
    return router_pb2_grpc.RouterStub(grpc.insecure_channel(trio["router"].address))


def _parent_request(request_id: str, prompt: list[int]) -> router_pb2.ParentRequest:
    req = router_pb2.ParentRequest(request_id=request_id, path=common_pb2.PATH_HANDOFF)
    req.prompt_token_ids.ids.extend(prompt)
    req.stage1.max_tokens, req.stage1.temperature, req.stage1.seed = 12, 1.0, 3
    return req


def _start_parent(stub, req) -> router_pb2.Parent:
    parent = None
    for event in stub.StartParent(req, timeout=180):
        if event.HasField("parent"):
            parent = event.parent
    assert parent is not None
    return parent


def _continue(stub, parent_id: str):
    req = router_pb2.ContinueRequest(parent_id=parent_id)
    req.beam.beam_width, req.beam.max_tokens = 4, 3
    return stub.Continue(req, timeout=180)


def _reference(trio, prompt: list[int], max_tokens: int = 12, seed: int = 3):
    with RouterClient(trio["router"].address) as client:
        return client.generate(make_request(prompt=prompt, max_tokens=max_tokens, seed=seed,
                                            beam_width=4, path="colocated"), timeout=180)


def test_two_generates_with_one_id_at_once_never_swap_answers(trio):
    """Two router Generates of two prompts at once under one request id: each equals
    its own prompt run colocated, or is INVALID_ARGUMENT naming the id."""
    prompts = {k: _prompt(f"dup-gen-{k}") for k in "ab"}

    def generate(k):
        with RouterClient(trio["router"].address) as client:
            return client.generate(make_request(prompt=prompts[k], max_tokens=12, seed=3,
                                                beam_width=4, path="handoff",
                                                request_id="dup-gen"), timeout=180)

    results = dict(zip("ab", _at_once(*(lambda k=k: generate(k) for k in "ab"))))
    refs = {k: _reference(trio, prompts[k]) for k in "ab"}
    # The control: comparing a's answer with b's reference fails ("beams differ").
    with pytest.raises(AssertionError, match="differ"):
        assert_identical(refs["a"], refs["b"], imported=False)
    num_answered = 0
    for k in "ab":
        if _refused_naming(results[k], "dup-gen"):
            continue
        assert not isinstance(results[k], grpc.RpcError), f"{k}: {results[k]}"
        assert_identical(results[k], refs[k])
        num_answered += 1
    assert num_answered >= 1, results
    _clean(trio)


def test_two_parents_with_one_id_at_once_never_swap_answers(trio):
    """Two StartParents of two prompts at once under one id: one is refused naming it
    (the router keeps one parent per id), and the continuation of the id is the
    other's: its stage 1 and beams equal that prompt run colocated."""
    stub = _router_stub(trio)
    prompts = {k: _prompt(f"dup-parent-{k}") for k in "ab"}
    results = dict(zip("ab", _at_once(*(
        lambda k=k: _start_parent(stub, _parent_request("dup-parent", prompts[k]))
        for k in "ab"))))
    refused = [k for k in "ab" if _refused_naming(results[k], "dup-parent")]
    assert len(refused) == 1, results
    (kept,) = set("ab") - set(refused)
    parent = results[kept]
    assert list(parent.prompt_token_ids) == prompts[kept]
    got = _continue(stub, "dup-parent")
    ref = _reference(trio, prompts[kept])
    # The control: the refused prompt's answer differs, so a swap would fail below.
    other = _reference(trio, prompts[refused[0]])
    assert [list(b.token_ids) for b in other.beams] != [list(b.token_ids) for b in ref.beams]
    assert_identical(got, ref)
    stub.ReleaseParent(router_pb2.ReleaseParentRequest(parent_id="dup-parent"), timeout=30)
    _clean(trio)


# ---- P restarted at the same address between the export and the READ --------------------

def test_a_handoff_from_a_p_restarted_at_its_address_is_not_imported(trio):
    """STEP 1 (the control) a handoff read from the P that exported it imports and
    equals the colocated reference; STEP 2 P exports another, is killed and started
    again at the same gRPC and side-channel ports (a new engine id), and D's import of
    that handoff fails UNAVAILABLE ("import_failed") instead of reading the new
    process's blocks."""
    # STEP 1: the control, no restart.
    prompt = _prompt("restart-control")
    handoff, thinking = _export(trio, "restart-control-s1", prompt)
    full = prompt + thinking + SUFFIX
    got = _stage2(trio["d"], "restart-control", full, handoff)
    assert got.num_imported_tokens == len(full) - len(SUFFIX) - 1, got
    _assert_same_beams(got, _colocated(trio, "restart-control-ref", full))
    # STEP 2: exported, then P restarted at its address.
    prompt = _prompt("restart")
    handoff, thinking = _export(trio, "restart-s1", prompt)
    old_id = _engine_id(trio["p"])
    assert handoff.engine_id == old_id
    address = trio["p"].address
    _restart_p(trio)
    assert trio["p"].address == address and _engine_id(trio["p"]) != old_id
    assert handoff.lease_expires_at > time.time() + 5, "restart outlived the lease"
    # STEP 3: D's import of the stale handoff fails; nothing is imported.
    full = prompt + thinking + SUFFIX
    with pytest.raises(grpc.RpcError) as err:
        _stage2(trio["d"], "restart", full, handoff)
    # Reason "import_failed" (kvhandoff.errors): UNAVAILABLE, D's message.
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert "KV import from P failed" in err.value.details(), err.value.details()
    _clean(trio)


def test_a_continuation_after_p_restarted_is_recomputed_with_the_reference_beams(trio):
    """Two parents held on P through the router: the first continued before P restarts
    (the control: imported, equal to the reference), the second after P was killed and
    started at its address: recomputed, flagged, its beams equal the colocated
    reference."""
    stub = _router_stub(trio)
    prompts = {k: _prompt(f"restart-parent-{k}") for k in ("control", "stale")}
    parents = {k: _start_parent(stub, _parent_request(f"restart-parent-{k}", prompts[k]))
               for k in prompts}
    for parent in parents.values():
        assert parent.held, parent.not_held_reason
    refs = {k: _reference(trio, prompts[k]) for k in prompts}
    # STEP 1: the control imports.
    assert_identical(_continue(stub, parents["control"].parent_id), refs["control"])
    # STEP 2: P restarted at its address; the router sees it serve again.
    old_id = _engine_id(trio["p"])
    _restart_p(trio)
    assert _engine_id(trio["p"]) != old_id
    assert parents["stale"].lease_expires_at > time.time() + 5, "restart outlived the lease"
    # STEP 3: the stale parent's continuation is recomputed, flagged, with the same beams.
    got = _continue(stub, parents["stale"].parent_id)
    # Any reason will do (D's failed handshake or READ today; a router that noticed the
    # new engine id could drop the parent instead), but the recompute must say one.
    assert got.stats.handoff_failure, got.stats
    assert_identical(got, refs["stale"], recomputed_for="")
    for parent in parents.values():
        stub.ReleaseParent(router_pb2.ReleaseParentRequest(parent_id=parent.parent_id),
                           timeout=30)
    _clean(trio)

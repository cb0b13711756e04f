"""A rolling update, as an operator of a fleet runs one: the new weights reach D's host
first, at the same path, with the same config.json and tokenizer (one layer's weights
another training step's). One router, P on weights A, D on weights B: every handoff is
refused before any READ (D's reason "model"), and the request is recomputed (flagged) or
refused with a clear error, never answered from KV that A computed for B. Then D back on
A: handoffs import again. The control: a D whose identity does not see its weights (its
digest cache says A for B's file) imports A's KV into B and answers 200, which the
test's check refuses.

P and D share one model path: vLLM's own NIXL handshake hashes the path, and the update
keeps it (a copy elsewhere would fail that handshake at the READ, a check of another
thing). P loads A before the path's weights file is replaced by B's (renamed over: P's
mapping keeps A's bytes)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path

import grpc
import pytest

from kvhandoff import digests
from kvhandoff.model import identity_files, model_fingerprint
from tests.test_model_identity_unit import perturbed_copy
from tests.utils import assert_handed_off, assert_servers_clean, metric_sum
from tools.client import RouterClient, make_request

pytestmark = [pytest.mark.engines, pytest.mark.fault, pytest.mark.timeout(1800)]

LEASE_S = 30
POOL_MIB = {"prefill": 64, "decode": 24}
#: Two-stage requests per phase: (prompt, seed).
REQUESTS = [(list(range(60, 140)), 2), (list(range(200, 297)), 3), (list(range(30, 75)), 4)]


def _replace_weights(model: Path, source: Path) -> None:
    """``model``'s weights file becomes a copy of ``source`` (a new file, renamed over the
    old one: an engine that mapped the old file keeps its bytes)."""
    tmp = model / ".model.safetensors.new"
    shutil.copyfile(source, tmp)
    os.replace(tmp, model / "model.safetensors")


def _send(router: str) -> list[object]:
    """Each of REQUESTS as a two-stage request over a handoff: its result, or the
    grpc.RpcError it ended with."""
    outcomes: list[object] = []
    with RouterClient(router) as client:
        for prompt, seed in REQUESTS:
            req = make_request(prompt=prompt, max_tokens=8, seed=seed, beam_width=2,
                               path="handoff")
            try:
                outcomes.append(client.generate(req, timeout=300))
            except grpc.RpcError as e:
                outcomes.append(e)
    return outcomes


def _assert_nothing_imported(outcomes: list[object], fp_a: str, fp_b: str) -> None:
    """Every request recomputed (flagged, nothing imported) or refused with an error that
    names both models: never an answer from KV of the other weights."""
    for out in outcomes:
        if isinstance(out, grpc.RpcError):
            assert out.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.FAILED_PRECONDITION), out
            assert fp_a in out.details() and fp_b in out.details(), out.details()
        else:
            s = out.stats
            assert s.num_imported_tokens == 0, f"imported KV of other weights: {s}"
            assert s.recomputed and fp_b in s.handoff_failure, s


def _router_sees(router_metrics: str, address: str, up: bool, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while metric_sum(router_metrics, "kvhandoff_router_engine_up", endpoint=address) != up:
        assert time.monotonic() < deadline, f"the router never saw {address} up={up}"
        time.sleep(0.2)


def _d_metric(d, name: str) -> float:
    return metric_sum(d.metrics_url, f"kvhandoff_engine_{name}_total")


def _capacity_fingerprint(address: str) -> str:
    from tools.launch import pool_state

    return pool_state(address)[1].model_fingerprint


def _forged_cache(where: Path, model: Path, weights_a: Path) -> None:
    """A digest cache that holds, for ``model``'s weights file as it is now (B's), the
    digest of A's: the identity of a D reading it is blind to the weights."""
    names = identity_files(model)
    digests.FileDigests(where).digest(model, names, "any")
    [stored] = where.glob("*.json")
    data = json.loads(stored.read_text())
    data["files"]["model.safetensors"][3] = hashlib.sha256(weights_a.read_bytes()).hexdigest()
    stored.write_text(json.dumps(data))


def test_a_rolling_update_never_answers_from_kv_of_other_weights(model_dir, tmp_path):
    from kvhandoff.ports import free_port
    from tools.launch import spawn, stop, wait_serving

    # STEP 0: the model path (A's files), B's weights and A's beside it, one digest cache
    # for every server (B's file is written more than RACY_S before D hashes it).
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    weights_b = perturbed_copy(model_dir, tmp_path / "b") / "model.safetensors"
    weights_a = Path(shutil.copyfile(model / "model.safetensors", tmp_path / "a.safetensors"))
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    secret = log_dir / "handoff.secret"
    secret.write_text(secrets.token_hex(32))
    env = {digests.ENV_CACHE: str(tmp_path / "digests")}
    engine = ["--model", str(model), "--lease-s", str(LEASE_S),
              "--handoff-secret-file", str(secret)]
    fp_a = model_fingerprint(model_dir)
    servers = []

    def start_d(log_name: str, port: int, env_d: dict[str, str]):
        d = spawn("decode", port, [*engine, "--kv-cache-mib", str(POOL_MIB["decode"])],
                  log_dir, log_name, env=env_d)
        servers.append(d)
        wait_serving(d.address, [d])
        return d

    try:
        # STEP 1: P loads A.
        p = spawn("prefill", free_port(), [*engine, "--kv-cache-mib",
                                           str(POOL_MIB["prefill"])], log_dir, env=env)
        servers.append(p)
        wait_serving(p.address, [p])
        assert _capacity_fingerprint(p.address) == fp_a
        # STEP 2: the update reaches D's host: the same path holds B; D loads it.
        _replace_weights(model, weights_b)
        d_port = free_port()
        d = start_d("decode-b", d_port, env)
        fp_b = _capacity_fingerprint(d.address)
        assert fp_b != fp_a
        router = spawn("router", free_port(), ["--model", str(model), "--prefill", p.address,
                                               "--decode", d.address], log_dir, env=env)
        servers.append(router)
        wait_serving(router.address, servers)

        # STEP 3: every handoff refused before a READ; no answer from A's KV.
        outcomes = _send(router.address)
        _assert_nothing_imported(outcomes, fp_a, fp_b)
        assert _d_metric(d, "nixl_transfers") == 0 and _d_metric(d, "nixl_transfer_bytes") == 0
        # The router's warm-up handoff too: one refusal more than the requests.
        assert _d_metric(d, "import_failures") >= len(REQUESTS)
        refusal = f"handoff from model {fp_a}, this engine serves {fp_b}"
        assert d.log_path.read_text().count(refusal) >= len(REQUESTS)
        assert_servers_clean([p, d], timeout_s=LEASE_S + 10.0)

        # STEP 4 (the control): D again on B, its identity blind to the weights (its
        # cache says A's digest for B's file): handoffs import A's KV into B, answered
        # 200, and the check of STEP 3 fails.
        stop([d])
        _router_sees(router.metrics_url, d.address, up=False)
        forged = tmp_path / "digests-forged"
        _forged_cache(forged, model, weights_a)
        d = start_d("decode-b-blind", d_port, {digests.ENV_CACHE: str(forged)})
        assert _capacity_fingerprint(d.address) == fp_a  # B's weights, A's name
        _router_sees(router.metrics_url, d.address, up=True)
        outcomes = _send(router.address)
        with pytest.raises(AssertionError, match="imported KV of other weights"):
            _assert_nothing_imported(outcomes, fp_a, fp_b)
        assert _d_metric(d, "nixl_transfers") > 0
        assert_servers_clean([p, d], timeout_s=LEASE_S + 10.0)

        # STEP 5: D back on A: handoffs import again.
        stop([d])
        _router_sees(router.metrics_url, d.address, up=False)
        _replace_weights(model, weights_a)
        d = start_d("decode-a", d_port, env)
        assert _capacity_fingerprint(d.address) == fp_a
        _router_sees(router.metrics_url, d.address, up=True)
        for out in _send(router.address):
            assert not isinstance(out, grpc.RpcError), out
            assert_handed_off(out, found_on_d=True)
            assert out.stats.num_imported_tokens > 0, out.stats
        assert_servers_clean([p, d], timeout_s=LEASE_S + 10.0)
    finally:
        stop(servers)

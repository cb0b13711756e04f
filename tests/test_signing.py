"""Signed handoffs (connector.signing) on a real vLLM Scheduler with our connector, no
model: P signs what it exports for one target D; D refuses, at admission and before any
READ, handoffs that are unsigned, tampered, signed with another secret or addressed to
another engine. The secret never reaches a log line."""

from __future__ import annotations

import logging

import pytest

from connector.params import KEY
from connector.signing import SECRET_ENV, SECRET_FILE_ENV, load_secret, sign, verify
from kvhandoff.types import HandoffError
from tests.utils import (
    make_export_params,
    make_import_request,
    make_scheduler,
    reject_at_admission,
)

pytestmark = [pytest.mark.security]

SECRET = b"kvhandoff-test-secret-0123456789"
D_ENGINE_ID = "decode-test"  # tests.utils.make_vllm_config


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "handoff.secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return str(path)


def _signed(parent, fingerprint, *, target=D_ENGINE_ID, secret=SECRET, **overrides):
    params = make_export_params(parent, model_fingerprint=fingerprint,
                                target_engine_id=target, **overrides)
    params[KEY]["signature"] = sign(params, secret)
    return params


def test_secret_sources_and_minimum_length(tmp_path, secret_file):
    assert load_secret(secret_file, environ={}) == SECRET
    assert load_secret(None, environ={SECRET_FILE_ENV: secret_file}) == SECRET
    assert load_secret(None, environ={SECRET_ENV: SECRET.decode()}) == SECRET
    assert load_secret(None, environ={}) is None
    short = tmp_path / "short"
    short.write_bytes(b"too-short")
    with pytest.raises(ValueError, match="shorter than 16 bytes"):
        load_secret(str(short), environ={})
    with pytest.raises(ValueError, match="cannot read"):
        load_secret(str(tmp_path / "missing"), environ={})


@pytest.mark.parametrize("path,value", [
    ((KEY, "token_digest"), "0" * 64),
    ((KEY, "lease_expires_at"), 4e9),  # a longer lease than P granted
    ((KEY, "num_parent_tokens"), 49),
    ((KEY, "request_id"), "someone-elses-request"),
    ((KEY, "target_engine_id"), "decode-other"),
    (("remote_block_ids",), [[1, 2]]),  # other blocks of P's pool
    (("remote_host",), "10.0.0.9"),
])
def test_any_signed_field_changed_breaks_the_signature(fingerprint, path, value):
    params = _signed(list(range(10, 60)), fingerprint)
    verify(params, SECRET, {D_ENGINE_ID})  # as exported: valid
    target = params
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(HandoffError) as err:
        verify(params, SECRET, {D_ENGINE_ID, "decode-other"})
    assert err.value.reason == "signature"


def test_wire_types_verify_like_ps_own(fingerprint):
    """D gets lists and proto scalars where P held tuples: the signature still holds."""
    from server import convert as engine_pb

    params = _signed(list(range(10, 60)), fingerprint)
    params["remote_block_ids"] = tuple(tuple(g) for g in params["remote_block_ids"])
    params[KEY]["signature"] = sign(params, SECRET)
    wire = engine_pb.handoff_from_pb(engine_pb.handoff_to_pb(params))
    verify(wire, SECRET, {D_ENGINE_ID})


def test_d_admits_a_signed_handoff_for_itself(model_dir, fingerprint, secret_file):
    scheduler = make_scheduler(model_dir, extra_config={"handoff_secret_file": secret_file})
    parent = list(range(10, 60))
    req = make_import_request(parent + [7], _signed(parent, fingerprint))
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert req.request_id in out.kv_connector_metadata.reqs_to_recv  # the READ is set up


def test_d_answers_for_its_handoff_group(model_dir, fingerprint, secret_file):
    scheduler = make_scheduler(model_dir, extra_config={"handoff_secret_file": secret_file,
                                                        "handoff_group": "Decode"})
    parent = list(range(10, 60))
    req = make_import_request(parent + [7], _signed(parent, fingerprint, target="Decode"))
    scheduler.add_request(req)
    assert req.request_id in scheduler.schedule().kv_connector_metadata.reqs_to_recv


@pytest.mark.parametrize("case,reason,message", [
    ("unsigned", "unsigned", "not signed"),
    ("tampered", "signature", "does not match"),
    ("other_secret", "signature", "does not match"),
    ("other_target", "target", "addressed to engine 'decode-7'"),
])
def test_d_refuses_bad_handoffs_before_any_read(model_dir, fingerprint, secret_file, caplog,
                                                 case, reason, message):
    scheduler = make_scheduler(model_dir, extra_config={"handoff_secret_file": secret_file})
    parent = list(range(10, 60))
    if case == "unsigned":
        params = make_export_params(parent, model_fingerprint=fingerprint,
                                    target_engine_id=D_ENGINE_ID)
    elif case == "tampered":
        params = _signed(parent, fingerprint)
        params["remote_block_ids"] = [[0, 1]]
    elif case == "other_secret":
        params = _signed(parent, fingerprint, secret=b"another-secret-of-enough-bytes")
    else:
        params = _signed(parent, fingerprint, target="decode-7")
    with caplog.at_level(logging.DEBUG):
        info = reject_at_admission(scheduler, make_import_request(parent + [7], params), notify_p=False)
    assert info["reason"] == reason and message in info["error"]
    assert SECRET.decode() not in caplog.text


def test_p_signs_its_export_for_the_target(model_dir, secret_file):
    """P's connector signs a finished stage 1 for the D the router named."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from connector.params import TARGET_KEY
    from tests.utils import BLOCK_SIZE

    init_none_hash(sha256)
    scheduler = make_scheduler(model_dir, kv_role="kv_producer",
                               extra_config={"handoff_secret_file": secret_file})
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    sampling.update_from_generation_config({}, 1)
    req = Request(request_id="s1", prompt_token_ids=list(range(10, 50)),
                  sampling_params=sampling, pooling_params=None,
                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    req.kv_transfer_params = {"do_remote_decode": True, TARGET_KEY: "decode-3"}
    scheduler.add_request(req)
    final = None
    for token in (500, 501):
        out = scheduler.schedule()
        eco = scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=["s1"], req_id_to_index={"s1": 0}, sampled_token_ids=[[token]]))
        final = next((o for e in eco.values() for o in e.outputs if o.finish_reason), final)
    params = final.kv_transfer_params
    assert params[KEY]["target_engine_id"] == "decode-3"
    verify(params, SECRET, {"decode-3"})
    with pytest.raises(HandoffError, match="addressed to engine 'decode-3'"):
        verify(params, SECRET, {"decode-4"})

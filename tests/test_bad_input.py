"""Bad input gets a clear error and loses nothing: both engines keep serving and no KV
block leaks. Real engines, real NIXL."""

from __future__ import annotations

import asyncio
import time

import pytest

from connector.handoff import ImportRequest
from connector.params import KEY
from kvhandoff.types import BeamParams, InvalidRequest, Stage1Params, StageError
from tests.conftest import LEASE_S
from tests.utils import make_request
from tools.pipeline import run_handoff

pytestmark = pytest.mark.engines


@pytest.fixture
def still_serving(pair, run, assert_pools_clean):
    """After the test: pools clean, and a good request succeeds end to end."""
    yield
    assert_pools_clean()
    result = run(run_handoff(pair.p, pair.d, make_request(pair, request_id="after-bad-input")))
    assert len(result.stage2.beams) == 4
    assert_pools_clean()


@pytest.mark.parametrize("overrides,field,words", [
    ({"prompt_token_ids": []}, "prompt", "empty"),
    ({"prompt_len": 4090}, "prompt", "exceeds the model length"),
    ({"prompt_token_ids": [5, 99999, 7]}, "prompt", "outside the vocabulary"),
    ({"prompt_token_ids": [5, -1, 7]}, "prompt", "outside the vocabulary"),
    ({"suffix_token_ids": [1 << 20]}, "suffix", "outside the vocabulary"),
])
def test_bad_prompts_are_refused_before_stage_1(pair, run, still_serving, overrides, field, words):
    req = make_request(pair, request_id="bad-prompt", **overrides)
    with pytest.raises(InvalidRequest) as err:
        run(run_handoff(pair.p, pair.d, req))
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("cls,kwargs,field", [
    (BeamParams, {"beam_width": 0}, "beam.beam_width"),
    (BeamParams, {"beam_width": 513}, "beam.beam_width"),
    (BeamParams, {"max_tokens": 0}, "beam.max_tokens"),
    # Found by tests/test_fuzz.py (seed 822988293): 2.98e13 overflowed the beam score,
    # the router answered INTERNAL (OverflowError).
    (BeamParams, {"length_penalty": 2.97846796e13}, "beam.length_penalty"),
    (BeamParams, {"length_penalty": -11.0}, "beam.length_penalty"),
    (BeamParams, {"length_penalty": float("nan")}, "beam.length_penalty"),
    (Stage1Params, {"max_tokens": 0}, "stage1.max_tokens"),
    (Stage1Params, {"temperature": -0.5}, "stage1.temperature"),
    (Stage1Params, {"top_p": 0.0}, "stage1.top_p"),
])
def test_bad_parameters_name_the_field(cls, kwargs, field):
    with pytest.raises(InvalidRequest) as err:
        cls(**kwargs)
    assert err.value.field == field


def _stage1(pair, run, request_id: str, **kw):
    req = make_request(pair, request_id=request_id, **kw)
    s1 = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, f"{request_id}-p", export=True))
    prompt = req.prompt_token_ids + s1.token_ids + req.suffix_token_ids
    return req, s1, prompt


def _stage2_error(pair, run, prompt, beam, params, request_id) -> StageError:
    with pytest.raises(StageError) as err:
        run(pair.d.run_stage2(prompt, beam, request_id,
                              handoff=ImportRequest.for_beams(params, beam)))
    return err.value


@pytest.mark.parametrize("tamper,reason", [
    ("digest", "digest"),
    ("lease", "expired"),
    ("protocol", "protocol"),
    ("model", "model"),
])
def test_tampered_handoffs_are_refused_and_p_releases_its_blocks(pair, run, still_serving,
                                                                tamper, reason):
    req, s1, prompt = _stage1(pair, run, f"tamper-{tamper}")
    params = {**s1.handoff_params, KEY: dict(s1.handoff_params[KEY])}
    if tamper == "digest":
        prompt = [prompt[0] + 1 if prompt[0] + 1 < pair.p.vocab_size else 6] + prompt[1:]
    elif tamper == "lease":
        params[KEY]["lease_expires_at"] = time.time() - 1
    elif tamper == "protocol":
        params[KEY]["protocol_version"] = 999
    else:
        params[KEY]["model_fingerprint"] = "another-model"
    err = _stage2_error(pair, run, prompt, req.beam, params, f"tamper-{tamper}-d")
    assert err.reason == reason, err
    # D refused at admission and told P: P frees now, not at lease expiry.
    snap = run(pair.p.wait_pool_clean(LEASE_S / 2))
    assert snap.is_clean, f"P still holds blocks {snap}"


@pytest.mark.fault
def test_a_handoff_that_arrives_after_its_lease_is_refused(pair, run, still_serving):
    req, s1, prompt = _stage1(pair, run, "late")
    # STEP 1: P holds the parent's blocks, then its lease runs out and it frees them.
    run(asyncio.sleep(LEASE_S + 1))
    assert run(pair.p.wait_pool_clean(5)).is_clean
    # STEP 2: P reuses its blocks: two requests that together cover its whole pool.
    from kvhandoff.types import Stage1Params

    free = pair.p.pool().num_free_blocks
    per_request = min(free // 2, (pair.p.max_model_len - 1) // pair.p.block_size)
    filler = [[10 + (i + k) % 1000 for k in range(per_request * pair.p.block_size - 1)]
              for i in range(2)]

    async def fill():
        await asyncio.gather(*(pair.p.run_stage1(f, Stage1Params(max_tokens=1), f"reuse-{i}",
                                                 export=False) for i, f in enumerate(filler)))

    run(fill())
    # STEP 3: D refuses before any READ of the reused blocks.
    reads = pair.d.counters.transfers
    err = _stage2_error(pair, run, prompt, req.beam, s1.handoff_params, "late-d")
    assert err.reason == "expired" and "lease" in str(err)
    assert pair.d.counters.transfers == reads, "D read blocks P had reused"


@pytest.mark.fault
def test_d_fences_the_read_on_ps_clock(pair, run, still_serving):
    """The worker-side fence: P's own deadline (perf_counter, rebased with the clock
    offset measured at the handshake) is checked just before the READ."""
    req, s1, prompt = _stage1(pair, run, "fence")
    params = dict(s1.handoff_params)
    params["remote_blocks_expiry_time"] = time.perf_counter() + 1.0  # inside the 2 s margin
    err = _stage2_error(pair, run, prompt, req.beam, params, "fence-d")
    assert err.reason == "import_failed"


def test_d_too_small_is_a_capacity_error_with_the_numbers(pair, run, still_serving):
    req, s1, prompt = _stage1(pair, run, "capacity", prompt_len=2500, stage1={"max_tokens": 4})
    beam = BeamParams(beam_width=64, max_tokens=3)
    err = _stage2_error(pair, run, prompt, beam, s1.handoff_params, "capacity-d")
    assert err.reason == "capacity"
    assert "needs" in str(err) and "free of 128" in str(err)


@pytest.mark.parametrize("params,reason", [
    ({"remote_block_ids": [[1]]}, "missing"),
    ({KEY: "not a mapping"}, "malformed"),
    ({KEY: {"protocol_version": 1}, "remote_port": "x"}, "malformed"),
])
def test_garbage_handoff_params_are_refused_by_d(pair, run, still_serving, params, reason):
    err = _stage2_error(pair, run, [10, 11, 12], BeamParams(), params, "junk")
    assert err.reason == reason

"""vllm#52234 on the READ: P's blocks released and reused before D reads them, inside the
lease the handoff names. D reads them (a READ is one-sided), then asks P whether the
export was still held when the READ completed (``connector.liveness``): it was not, so
the import fails and no beams come from another request's KV. Controls: the same flow
without the release imports and equals the colocated reference; with D's question
skipped (the ``skip-live-check`` fault) D answers with beams that are not the
reference's, which is what the check is there to prevent. Real engines, real NIXL."""

from __future__ import annotations

import asyncio

import pytest

from connector.faults import SKIP_LIVE_FAULT
from connector.handoff import ImportRequest
from connector.liveness import ask_live
from connector.params import KEY
from decode_engine.engine import run_beam_stage
from kvhandoff.types import Stage1Params, StageError
from tests.utils import make_request

pytestmark = [pytest.mark.engines, pytest.mark.fault]


def _parent(pair, run, name: str):
    """A parent held on P for D, its stage-2 prompt and the colocated reference's beams."""
    req = make_request(pair, request_id=name, prompt_len=70, prompt_seed=7)
    s1 = run(pair.p.run_stage1(req.prompt_token_ids, req.stage1, f"{name}-p", export=True,
                               hold=True))
    prompt = req.prompt_token_ids + s1.token_ids + req.suffix_token_ids
    reference = run(run_beam_stage(pair.p, prompt, req.beam, f"{name}-ref"))
    return req, s1, prompt, [b.token_ids for b in reference.beams]


def _release_and_reuse(pair, run, s1) -> None:
    """P is told to release the parent (as a router that lost track of a continuation
    in flight, or a replay), frees it, and gives every block of its pool to others."""
    p_request = s1.handoff_params[KEY]["request_id"]
    host, port = s1.handoff_params["remote_host"], s1.handoff_params["remote_port"]
    asked = [(p_request, s1.handoff_params["remote_block_ids"])]
    assert ask_live(host, port, asked) == [True]
    run(pair.p.release([p_request]))
    assert run(pair.p.wait_pool_clean(5)).is_clean
    assert ask_live(host, port, asked) == [False]
    free = pair.p.pool().num_free_blocks
    per_request = min(free // 2, (pair.p.max_model_len - 1) // pair.p.block_size)
    filler = [[10 + (i * 7 + k) % 1000 for k in range(per_request * pair.p.block_size - 1)]
              for i in range(2)]

    async def fill():
        await asyncio.gather(*(pair.p.run_stage1(f, Stage1Params(max_tokens=1),
                                                 f"reuse-{i}", export=False)
                               for i, f in enumerate(filler)))

    run(fill())


def _import(pair, run, req, s1, prompt, name: str, fault: str | None = None):
    return run(pair.d.run_stage2(prompt, req.beam, name, handoff=ImportRequest.for_beams(
        s1.handoff_params, req.beam, fault=fault)))


def test_a_parent_released_and_reused_before_d_reads_is_never_imported(
        pair, run, assert_pools_clean):
    req, s1, prompt, reference = _parent(pair, run, "stale-read")
    _release_and_reuse(pair, run, s1)
    reads = pair.d.counters.transfers
    with pytest.raises(StageError) as err:
        _import(pair, run, req, s1, prompt, "stale-read-d")
    assert err.value.reason == "import_failed", err.value
    # D did read (nothing before the READ could tell), and threw the READ away.
    assert pair.d.counters.transfers > reads
    assert_pools_clean()


def test_control_the_same_parent_not_released_imports_and_equals_the_reference(
        pair, run, assert_pools_clean):
    req, s1, prompt, reference = _parent(pair, run, "live-read")
    result = _import(pair, run, req, s1, prompt, "live-read-d")
    assert result.num_imported_tokens == len(prompt) - len(req.suffix_token_ids) - 1
    assert [b.token_ids for b in result.beams] == reference
    run(pair.p.release([s1.handoff_params[KEY]["request_id"]]))
    assert_pools_clean()


def test_control_without_ps_confirmation_d_imports_another_requests_kv(
        pair, run, assert_pools_clean):
    """The negative control: D's question skipped, the same released-and-reused parent
    is imported and its beams are not the reference's."""
    req, s1, prompt, reference = _parent(pair, run, "unchecked-read")
    _release_and_reuse(pair, run, s1)
    faults = pair.d.counters.faults_injected
    result = _import(pair, run, req, s1, prompt, "unchecked-read-d", fault=SKIP_LIVE_FAULT)
    assert pair.d.counters.faults_injected > faults, "the check was not skipped"
    assert result.num_imported_tokens > 0
    assert [b.token_ids for b in result.beams] != reference
    assert_pools_clean()


def test_a_handoff_naming_another_parents_blocks_is_never_imported(
        pair, run, assert_pools_clean):
    """Two parents held on P; the first's handoff with the second's block ids (in P's
    pool, well-formed, as a P wrong about its own blocks would sign it): P's answer
    after the READ refuses it. Control: the same with D's question skipped imports the
    other parent's KV (beams not the reference's)."""
    req, s1, prompt, reference = _parent(pair, run, "other-blocks")
    other = make_request(pair, request_id="other-blocks-2", prompt_len=70, prompt_seed=9)
    s2 = run(pair.p.run_stage1(other.prompt_token_ids, other.stage1, "other-blocks-2-p",
                               export=True, hold=True))
    theirs = s2.handoff_params["remote_block_ids"]
    ours = s1.handoff_params["remote_block_ids"]
    assert [len(g) for g in theirs] == [len(g) for g in ours] and theirs != ours
    swapped = {**s1.handoff_params, "remote_block_ids": theirs}
    with pytest.raises(StageError) as err:
        run(pair.d.run_stage2(prompt, req.beam, "other-blocks-d",
                              handoff=ImportRequest.for_beams(swapped, req.beam)))
    assert err.value.reason == "import_failed", err.value
    result = run(pair.d.run_stage2(prompt, req.beam, "other-blocks-unchecked",
                                   handoff=ImportRequest.for_beams(swapped, req.beam,
                                                                   fault=SKIP_LIVE_FAULT)))
    assert result.num_imported_tokens > 0
    assert [b.token_ids for b in result.beams] != reference
    run(pair.p.release([s1.handoff_params[KEY]["request_id"],
                        s2.handoff_params[KEY]["request_id"]]))
    assert_pools_clean()

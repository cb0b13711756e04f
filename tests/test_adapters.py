"""LoRA adapters in the handoff (``connector.adapters``), on real engines with vLLM's LoRA
on: a handoff under an adapter equals both stages under it on one engine; D refuses,
before any READ, an import whose adapter is not its request's or whose weights differ
from D's; and the negative control: a D made to skip that check answers what the
request's adapter never computed.

P and D serve the built-in adapters a (seed 1) and b (seed 2); "c" is seed 4 on P and
seed 3 on D (one name, two sets of weights)."""

from __future__ import annotations

import pytest

from kvhandoff.types import BeamParams, Stage1Params, StageError

pytestmark = [pytest.mark.engines, pytest.mark.fleet, pytest.mark.timeout(900)]

LEASE_S = 20


@pytest.fixture(scope="module")
def lora(run, model_dir):
    from kvhandoff.builtin.adapters import builtin_adapter
    from tools.local import local_pair

    def adapters(c_seed: int) -> tuple[tuple[str, str], ...]:
        return tuple((name, str(builtin_adapter(model_dir, seed)))
                     for name, seed in (("a", 1), ("b", 2), ("c", c_seed)))

    cm = local_pair(model_dir, lease_s=LEASE_S, fault_injection=True,
                    prefill_overrides={"adapters": adapters(4),
                                       "kv_cache_memory_bytes": 24 << 20},
                    decode_overrides={"adapters": adapters(3),
                                      "kv_cache_memory_bytes": 24 << 20})
    pair = run(cm.__aenter__())
    try:
        yield pair
    finally:
        run(cm.__aexit__(None, None, None))


def _request(pair, name: str, adapter: str = ""):
    from tools.pipeline import TwoStageRequest

    return TwoStageRequest(
        request_id=name, prompt_token_ids=list(range(100, 400)),
        suffix_token_ids=list(pair.default_suffix_ids),
        stage1=Stage1Params(max_tokens=8, temperature=0.0), beam=BeamParams(beam_width=4,
                                                                          max_tokens=3),
        think_end_id=pair.think_end_id, adapter=adapter)


def _beams(result) -> list[tuple[list[int], float]]:
    return [(list(b.token_ids), b.cum_logprob) for b in result.stage2.beams]


def _same(a, b) -> bool:
    return [t for t, _ in a] == [t for t, _ in b] and all(
        abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a, b))


def _empty_caches(run, pair) -> None:
    run(pair.p.empty_prefix_cache(LEASE_S + 5))
    run(pair.d.empty_prefix_cache(LEASE_S + 5))


def test_a_handoff_under_an_adapter_equals_one_engine_under_it(run, lora):
    """Under a, under b and under none: handoff equal to colocated (tokens and
    cumulative logprobs within 1e-5), D computed only the suffix and one token, and the
    adapter mattered (a's beams are not the base model's, nor b's)."""
    from tools.pipeline import run_colocated, run_handoff

    got = {}
    for adapter in ("a", "b", ""):
        _empty_caches(run, lora)
        ref = run(run_colocated(lora.p, _request(lora, f"col-{adapter}", adapter)))
        _empty_caches(run, lora)
        out = run(run_handoff(lora.p, lora.d, _request(lora, f"hand-{adapter}", adapter)))
        assert out.stage1.token_ids == ref.stage1.token_ids, adapter
        assert _same(_beams(out), _beams(ref)), (adapter, _beams(out), _beams(ref))
        assert out.stage2.num_computed_tokens_first_step == len(out.suffix_token_ids) + 1
        got[adapter] = (ref.stage1.token_ids, _beams(ref))
    assert got["a"] != got[""] and got["a"] != got["b"], got


@pytest.mark.parametrize("exported,imported,why", [
    ("a", "b", "computed under adapter 'a' and this request runs under adapter 'b'"),
    ("a", "", "computed under adapter 'a' and this request runs under no adapter"),
    ("", "a", "computed under no adapter (the base model) and this request runs under "
              "adapter 'a'"),
    ("c", "c", "adapter 'c' differs between the engines"),
])
def test_d_refuses_an_import_under_another_adapter_before_any_read(
        run, lora, exported, imported, why):
    """Refused at D's admission ("adapter": INVALID_ARGUMENT at the servers): D read and
    computed nothing, P's exported blocks come back at once (not at the lease's end),
    and both engines go on serving."""
    from kvhandoff.errors import status_for
    from tools.pipeline import run_handoff

    _empty_caches(run, lora)
    reads = lora.d.counters.transfers
    with pytest.raises(StageError) as refused:
        run(run_handoff(lora.p, lora.d, _request(lora, f"bad-{exported}-{imported}",
                                                 exported), d_adapter=imported))
    assert refused.value.reason == "adapter" and why in str(refused.value), refused.value
    assert status_for(refused.value)[0].name == "INVALID_ARGUMENT"
    assert lora.d.counters.transfers == reads  # no READ
    # P was told to free the parent: its pool is clean well before the lease ends.
    assert run(lora.p.wait_pool_clean(LEASE_S / 2)).is_clean, lora.p.pool()
    assert run(lora.d.wait_pool_clean(5)).is_clean, lora.d.pool()


def test_a_d_that_skips_the_check_answers_what_the_adapter_never_computed(run, lora):
    """Negative control (fault ``accept-any-adapter``): a parent exported under a and
    imported into a stage 2 under b with the check skipped. D serves, and its beams are
    not those of the same stage 2 under b computed from token ids on D (what a stage 2
    under b over that parent is): the KV was a's."""
    from decode_engine.engine import run_beam_stage
    from tools.pipeline import run_handoff

    _empty_caches(run, lora)
    wrong = run(run_handoff(lora.p, lora.d, _request(lora, "neg-hand", "a"), d_adapter="b",
                            fault="accept-any-adapter"))
    assert wrong.stage2.num_imported_tokens > 0  # D did import a's KV
    _empty_caches(run, lora)
    prompt = wrong.parent_token_ids + wrong.suffix_token_ids
    right = run(run_beam_stage(lora.d, prompt, _request(lora, "x").beam, "neg-b-from-ids",
                               adapter="b"))
    wrong_beams = _beams(wrong)
    right_beams = [(list(b.token_ids), b.cum_logprob) for b in right.beams]
    assert not _same(wrong_beams, right_beams), (wrong_beams, right_beams)


def test_the_harness_adapter_cases_pass_and_its_negative_control_fails(run, lora):
    """``kvhandoff verify --adapters`` on this pair: under a, b and none identical to one
    engine (and to vLLM's beam_search under the same adapter); the two imports under
    another adapter refused. With the fault that makes D skip the check, those two
    fail, named (D must refuse; the beams are not those of the adapter it ran under),
    and the others stay identical (the fault cannot touch an import under its own
    adapter)."""
    from tools.harness import Harness, adapter_cases, format_table

    harness = Harness(lora.p, lora.d, tokenizer=lora.tokenizer,
                      think_end_id=lora.think_end_id, eos_id=lora.eos_id,
                      suffix_ids=lora.default_suffix_ids)
    cases = adapter_cases()
    report = run(harness.run(cases, model_dir=str(lora.model_dir)), timeout=900)
    print(format_table(report))
    assert report.ok, format_table(report)
    assert {c.name for c in report.cases if c.refused} == {
        c.name for c in cases if c.adapters_differ}
    assert all(c.beams_match_vllm for c in report.cases if not c.refused)
    faulty = run(harness.run(cases, model_dir=str(lora.model_dir),
                             fault="accept-any-adapter"), timeout=900)
    print(format_table(faulty))
    assert sorted(faulty.caught) == sorted(c.name for c in cases if c.adapters_differ)
    for c in faulty.cases:
        if c.fault_applies:
            assert any("it must refuse" in f for f in c.failures), c.failures
            assert any(f.startswith(("beams differ", "cumulative logprobs differ"))
                       for f in c.failures), c.failures
        else:
            assert c.ok, c.failures
    assert faulty.pools_clean, faulty.pool_details


def test_a_parent_held_on_p_is_copied_only_into_a_stage_2_under_its_adapter(run, lora):
    """The one-engine path: a parent held on P under a. A stage 2 under a copies it
    (computes the suffix and one token); one under b must not (its KV is a's): P
    computes the whole prompt under b, and the beams equal b's from token ids on D."""
    from decode_engine.engine import run_beam_stage
    from tools.pipeline import stage2_prompt

    _empty_caches(run, lora)
    req = _request(lora, "held", "a")
    s1 = run(lora.p.run_stage1(req.prompt_token_ids, req.stage1, "held-a", export=False,
                               hold=True, adapter="a"))
    prompt, suffix = stage2_prompt(req, s1)
    try:
        under_b = run(run_beam_stage(lora.p, prompt, req.beam, "held-into-b",
                                     held_parent="held-a", adapter="b"))
        under_a = run(run_beam_stage(lora.p, prompt, req.beam, "held-into-a",
                                     held_parent="held-a", adapter="a"))
    finally:
        run(lora.p.release(["held-a"]))
    ref_b = run(run_beam_stage(lora.d, prompt, req.beam, "ref-b", adapter="b"))
    assert under_a.num_computed_tokens_first_step == len(suffix) + 1
    assert under_b.num_computed_tokens_first_step == len(prompt)
    assert _same([(list(b.token_ids), b.cum_logprob) for b in under_b.beams],
                 [(list(b.token_ids), b.cum_logprob) for b in ref_b.beams])
    assert run(lora.p.wait_pool_clean(10)).is_clean, lora.p.pool()


def test_a_beam_search_moved_under_an_adapter_goes_on_under_it(run, lora):
    """A search stopped under adapter a on D exports its prompt's KV under a (the
    handoff names a and its digest); the engine it moves to imports it into a search
    under a only, and ends with the beams of the search left on D, which are not the
    base model's. Under b the import is refused (its KV was computed under a). The
    engine it moves to here is the pair's P, which runs beam search too (the colocated
    path): this pair serves the adapters on P and D only."""
    from connector.handoff import ImportRequest
    from connector.params import KEY
    from decode_engine.engine import run_beam_stage
    from kvhandoff.types import StageError

    _empty_caches(run, lora)
    prompt = list(range(100, 400)) + list(lora.default_suffix_ids)
    beam = BeamParams(beam_width=4, max_tokens=6, ignore_eos=True)
    out = run(run_beam_stage(lora.d, prompt, beam, "amove", adapter="a", stop_at=3))
    stopped = out.stopped
    assert stopped is not None and stopped.export[KEY]["adapter"] == "a"

    def resume(adapter: str, rid: str):
        params = ImportRequest.for_beams(stopped.export, beam).to_params()
        return run(run_beam_stage(lora.p, stopped.prompt, beam, rid, adapter=adapter,
                                  moved=stopped,
                                  first_step_extra_args={"kv_transfer_params": params}))

    moved = resume("a", "amove-a")
    # Checked before any READ (a refusal also ends the export's lease: so after a).
    with pytest.raises(StageError, match="adapter"):
        resume("b", "amove-b")
    unmoved = run(run_beam_stage(lora.d, prompt, beam, "amove-u", adapter="a"))
    base = run(run_beam_stage(lora.d, prompt, beam, "amove-base"))
    as_pairs = [(list(b.token_ids), b.cum_logprob) for b in moved.beams]
    assert _same(as_pairs, [(list(b.token_ids), b.cum_logprob) for b in unmoved.beams])
    assert not _same(as_pairs, [(list(b.token_ids), b.cum_logprob) for b in base.beams])
    _empty_caches(run, lora)
    for engine in (lora.p, lora.d):
        snap = run(engine.wait_pool_clean(LEASE_S + 5))
        assert snap.is_clean, snap

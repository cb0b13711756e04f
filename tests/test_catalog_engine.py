"""Beams constrained to a catalog on real engines: the built-in model and its shop
(``--catalog shop=builtin``), by handoff (P's export read by D over NIXL) and on one
engine, against the reference written apart from the fast path
(``tools/harness/constrained.py``, full-vocabulary logprobs from the same engine kind).
The unit level: ``tests/test_catalog.py``."""

from __future__ import annotations

import pytest

from connector.handoff import ImportRequest
from decode_engine.engine import run_beam_stage
from kvhandoff.builtin.corpus import shop_items
from kvhandoff.types import BeamParams, Stage1Params
from tools.harness import LOGPROB_TOLERANCE
from tools.harness.cases import history_prompt
from tools.harness.constrained import constrained_beam_search, engine_logprobs

pytestmark = [pytest.mark.beams, pytest.mark.engines]


def _parent(pair, run, key: str) -> tuple[list[int], object]:
    """A corpus-like prompt, its stage 1 on P (exported), and the stage-2 prompt."""
    prompt = history_prompt(120, key, pair.tokenizer)
    s1 = run(pair.p.run_stage1(prompt, Stage1Params(
        max_tokens=48, temperature=1.0, seed=3, stop_token_ids=(pair.think_end_id,)),
        f"{key}-p", export=True))
    return prompt + s1.token_ids + pair.default_suffix_ids, s1


def _shop(pair) -> set[tuple[int, ...]]:
    return {tuple(pair.tokenizer.convert_tokens_to_ids(item)) for item in shop_items()}


def _same(got, ref) -> None:
    assert [b.token_ids for b in got] == [b.token_ids for b in ref]
    for a, b in zip(got, ref):
        assert abs(a.cum_logprob - b.cum_logprob) <= LOGPROB_TOLERANCE, (a, b)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("width", [4, 32, 256])
def test_constrained_beams_equal_the_reference_by_handoff_and_on_one_engine(
        pair, run, assert_pools_clean, width):
    """Token ids exact and cumulative logprobs within the harness's bound, three ways:
    handed off to D, on one engine, and the reference; every beam an item of the shop;
    W=256 (more than the shop can give after three tokens) returns fewer and says how
    many. The unconstrained search on the same parent leaves the shop (so the check
    means something), and the same handoff with D's import faulted (block 0 zeroed)
    leaves the reference (the negative control, end to end)."""
    stage2, s1 = _parent(pair, run, f"catalog-{width}")
    beam = BeamParams(beam_width=width, max_tokens=3, catalog="shop")
    local = run(run_beam_stage(pair.p, stage2, beam, f"cat-l{width}"))
    reference = run(constrained_beam_search(
        engine_logprobs(pair.p, pair.p.vocab_size, f"cat-r{width}"), stage2,
        [list(i) for i in _shop(pair)], beam, pair.eos_id)).beams
    _same(local.beams, reference)
    results = [local]
    if width <= 32:  # D's pool (128 blocks) holds 32 slots, not the shop's 192
        handed = run(pair.d.run_stage2(stage2, beam, f"cat-h{width}", handoff=ImportRequest
                                       .for_beams(s1.handoff_params, beam)))
        assert handed.num_imported_tokens == len(stage2) - len(pair.default_suffix_ids) - 1
        _same(handed.beams, reference)
        results.append(handed)
    shop = _shop(pair)
    for result in results:
        assert result.beams and all(tuple(b.token_ids) in shop for b in result.beams)
        assert result.num_beams_short == width - len(result.beams)
    if width == 4:
        # Six tokens where items have three: every beam ends by EOS at step 4, and the
        # slots end there (step 0, then three slot steps: the scheduler caps them),
        # with the reference's beams.
        long = BeamParams(beam_width=width, max_tokens=6, catalog="shop")
        early = run(run_beam_stage(pair.p, stage2, long, "cat-early"))
        _same(early.beams, run(constrained_beam_search(
            engine_logprobs(pair.p, pair.p.vocab_size, "cat-r-early"), stage2,
            [list(i) for i in shop], long, pair.eos_id)).beams)
        assert all(b.finish_reason == "stop" and len(b.token_ids) == 4 for b in early.beams)
        assert early.step_computed_tokens[1:] == [width] * 3
    if width == 256:  # more than the shop keeps alive: 192 slots, fewer beams
        assert 0 < len(local.beams) < width and local.step_computed_tokens[-1] == 192
    if width == 32:
        free = run(run_beam_stage(pair.p, stage2, BeamParams(beam_width=width, max_tokens=3),
                                  f"cat-u{width}"))
        assert any(tuple(b.token_ids) not in shop for b in free.beams)
        # The same parent again (P's prefix cache and the same seed), read afresh.
        run(pair.d.empty_prefix_cache())
        again, s1 = _parent(pair, run, f"catalog-{width}")
        assert again == stage2
        faulted = run(pair.d.run_stage2(stage2, beam, "cat-fault", handoff=ImportRequest.for_beams(
            s1.handoff_params, beam, fault="zero-block")))
        with pytest.raises(AssertionError):
            _same(faulted.beams, reference)
    assert_pools_clean()


def test_an_unknown_catalog_and_a_too_short_search_are_refused_before_the_import(
        pair, run, assert_pools_clean):
    """NOT_FOUND (reason "catalog") naming the engine's catalogs, and INVALID_ARGUMENT for
    beams shorter than the shop's items; P's export is still readable after both (D
    read nothing) and the engines serve on."""
    from kvhandoff.errors import status_for
    from kvhandoff.types import InvalidRequest, StageError

    stage2, s1 = _parent(pair, run, "catalog-refused")
    for beam, kind, match in [
            (BeamParams(beam_width=4, max_tokens=3, catalog="nope"), StageError,
             "no catalog 'nope' on this engine \\(it has \\['shop'\\]\\)"),
            (BeamParams(beam_width=4, max_tokens=2, catalog="shop"), InvalidRequest,
             "2 is shorter than the shortest item of catalog 'shop' \\(3 tokens\\)")]:
        with pytest.raises(kind, match=match) as e:
            run(pair.d.run_stage2(stage2, beam, "cat-bad",
                                  handoff=ImportRequest.for_beams(s1.handoff_params, beam)))
        assert status_for(e.value)[0].name == ("NOT_FOUND" if kind is StageError
                                                else "INVALID_ARGUMENT")
    beam = BeamParams(beam_width=4, max_tokens=3, catalog="shop")
    ok = run(pair.d.run_stage2(stage2, beam, "cat-after",
                               handoff=ImportRequest.for_beams(s1.handoff_params, beam)))
    assert ok.num_imported_tokens > 0 and ok.beams
    assert_pools_clean()


def test_a_catalog_with_a_token_outside_the_vocabulary_refuses_the_start(tmp_path, model_dir):
    """At start, before vLLM: the file and line are named (no engine is started)."""
    from engine.catalog import CatalogError
    from engine.config import EngineConfig
    from engine.vllm_engine import load_catalogs

    path = tmp_path / "items.txt"
    path.write_text("1000 1008 1022\n1000 1008 99999\n")
    config = EngineConfig(model=model_dir, role="decode", catalogs=(("bad", str(path)),))
    with pytest.raises(CatalogError, match=f"{path}, line 2: token id 99999"):
        load_catalogs(config)

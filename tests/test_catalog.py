"""Beams constrained to a catalog, unit level: the trie (``engine.catalog``), its
file's checks, and the in-engine search (the real processor driven as vLLM drives it,
``tests/test_beam_slots.py``'s scripted engine) against the reference written apart from
it (``tools/harness/constrained.py``) on a scripted model with ties. The real engine:
``tests/test_catalog_engine.py``."""

from __future__ import annotations

import asyncio
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest

from connector.params import CATALOGS_KEY
from engine.catalog import CatalogError, build, load, parse_spec
from kvhandoff.budget import live_slots
from kvhandoff.types import BeamParams
from tests.test_beam_slots import EOS, VOCAB, ScriptedEngine, ours, scripted_logits
from tools.harness.constrained import constrained_beam_search

pytestmark = pytest.mark.beams


def _items(seed: int, n: int, lengths=(3,), codes: int = 6) -> list[list[int]]:
    """``n`` distinct items over a few codes (tokens 2..VOCAB), of the given lengths."""
    rng = random.Random(seed)
    vocab = [t for t in range(2, VOCAB) if t != EOS]
    books = [rng.sample(vocab, codes) for _ in range(max(lengths))]
    items: set[tuple[int, ...]] = set()
    while len(items) < n:
        length = rng.choice(lengths)
        items.add(tuple(rng.choice(books[i]) for i in range(length)))
    return [list(i) for i in sorted(items, key=lambda i: rng.random())]


def test_the_trie_holds_exactly_the_items():
    items = _items(0, 150, lengths=(2, 3, 4))
    catalog = build("c", items, VOCAB)
    prefixes = {tuple(i[:k]) for i in items for k in range(len(i) + 1)}
    whole = {tuple(i) for i in items}
    assert catalog.num_items == len(whole)
    assert (catalog.min_item_len, catalog.max_item_len) == (2, 4)
    rng = random.Random(1)
    probes = list(prefixes) + [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(0, 4)))
                               for _ in range(300)]
    for probe in probes:
        node = catalog.walk(list(probe))
        assert (node >= 0) == (probe in prefixes), probe
        assert catalog.holds(list(probe)) == (probe in whole), probe
    nodes = np.array([catalog.walk(list(p)) for p in probes])
    rows, tokens = catalog.allowed(nodes)
    for r, probe in enumerate(probes):
        nxt = sorted({i[len(probe)] for i in items
                      if len(i) > len(probe) and tuple(i[:len(probe)]) == probe})
        assert tokens[rows == r].tolist() == nxt, probe
    # Its widths by depth (what the router counts slots by) are its prefixes' counts.
    widths = [sum(len(p) == d for p in prefixes) for d in range(1, 5)]
    assert catalog.nodes_at_depth() == widths
    assert [catalog.max_live(t) for t in range(1, 5)] == [max(widths[:t]) for t in range(1, 5)]
    assert live_slots(64, catalog.nodes_at_depth(), 2) == min(64, max(widths[:2]))
    assert live_slots(64, None, 2) == 64


@pytest.mark.parametrize("line,match", [
    ("1 2 99999", "line 2: token id 99999 is outside the vocabulary"),
    (f"3 {EOS} 4", f"line 2: EOS \\({EOS}\\) inside an item"),
    ("3 x 4", "line 2: not token ids"),
])
def test_a_bad_item_is_refused_with_its_line(tmp_path, line, match):
    path = tmp_path / "items.txt"
    path.write_text(f"# a comment\n{line}\n2 3 4\n")
    with pytest.raises(CatalogError, match=re.escape(f"catalog 'shop': {path}, ") + match):
        load("shop", path, VOCAB, EOS)
    path.write_text("# nothing\n\n")
    with pytest.raises(CatalogError, match="lists no items"):
        load("shop", path, VOCAB, EOS)
    with pytest.raises(CatalogError, match="cannot read"):
        load("shop", tmp_path / "missing.txt", VOCAB, EOS)
    with pytest.raises(CatalogError, match="NAME=PATH"):
        parse_spec("shop")
    assert parse_spec("shop=/a=b") == ("shop", "/a=b")


def _engine(tmp_path, items, copies=True) -> ScriptedEngine:
    path = tmp_path / "items.txt"
    path.write_text("".join(" ".join(map(str, i)) + "\n" for i in items))
    config = SimpleNamespace(additional_config={CATALOGS_KEY: {"shop": str(path)}},
                             model_config=SimpleNamespace(
                                 hf_config=SimpleNamespace(eos_token_id=EOS),
                                 get_vocab_size=lambda: VOCAB))
    return ScriptedEngine(copies=copies, vllm_config=config)


def reference(prompt, items, params):
    from vllm.v1.sample.sampler import Sampler

    async def next_logprobs(tokens):
        return Sampler.compute_logprobs(scripted_logits(tokens).unsqueeze(0))[0].tolist()

    ref = asyncio.run(constrained_beam_search(next_logprobs, prompt, items, params, EOS))
    return [(b.token_ids, b.cum_logprob) for b in ref.beams], ref.dropped


#: (width, beam tokens, length penalty, ignore_eos, item lengths, items)
CASES = [(1, 3, 1.0, False, (3,), 60), (4, 3, 1.0, False, (3,), 60),
         (4, 4, 0.5, False, (2, 3, 4), 80), (8, 5, 1.0, False, (2, 3), 50),
         (32, 3, 1.0, False, (3,), 200), (32, 4, 1.0, True, (3, 4), 150),
         (16, 3, 2.0, False, (3,), 9),
         # Beams still inside longer items at the last step (dropped, counted); items
         # that end before T with EOS ignored (complete at their leaf).
         (8, 3, 1.0, False, (2, 4), 80), (8, 5, 1.0, True, (2, 3), 40)]


@pytest.mark.parametrize("width,tokens,penalty,ignore_eos,lengths,n", CASES)
def test_in_engine_constrained_beams_equal_the_reference(tmp_path, width, tokens, penalty,
                                                         ignore_eos, lengths, n):
    """Token ids, order and cumulative logprobs, bit for bit, on a model whose logits tie
    at every step; every beam a whole item (plus EOS where the model ended it); a
    catalog too small for W returns fewer, and the search says how many it left out."""
    for seed in range(3):
        items = _items(seed, n, lengths)
        prompt = [3 + seed, 4, width, tokens]
        params = BeamParams(beam_width=width, max_tokens=tokens, length_penalty=penalty,
                            ignore_eos=ignore_eos, catalog="shop")
        got, outcome = ours(prompt, params, _engine(tmp_path, items))
        want, dropped = reference(prompt, items, params)
        assert got == want, (seed, params)
        assert outcome.num_dropped == dropped, (seed, params)
        whole = {tuple(i) for i in items}
        for beam, _ in got:
            assert tuple(beam[:-1] if beam[-1] == EOS else beam) in whole, beam
        ran = len(outcome.slot_steps["select_ms"])
        assert len(got) <= width and outcome.step_computed_tokens[1:] == [width] * ran
        assert ran <= tokens
        if n < width:
            assert len(got) < width


def test_the_cases_leave_the_catalog_unconstrained_and_have_eos_beams(tmp_path):
    """The comparison above means something: unconstrained, the same model's beams leave
    the catalog; constrained, some beams end by EOS, some are dropped, and with EOS
    ignored some items shorter than T are returned."""
    items = _items(0, 60, (3,))
    whole = {tuple(i) for i in items}
    free, _ = ours([3, 4, 4, 3], BeamParams(4, 3))
    assert any(tuple(b) not in whole for b, _ in free)
    ended = [b for seed in range(3) for b, _ in
             ours([3 + seed, 4, 8, 5], BeamParams(8, 5, catalog="shop"),
                  _engine(tmp_path, _items(seed, 50, (2, 3))))[0] if b[-1] == EOS]
    assert ended
    _, outcome = ours([3, 4, 8, 3], BeamParams(8, 3, catalog="shop"),
                      _engine(tmp_path, _items(0, 80, (2, 4))))
    assert outcome.num_dropped > 0
    short, _ = ours([3, 4, 8, 5], BeamParams(8, 5, ignore_eos=True, catalog="shop"),
                    _engine(tmp_path, _items(0, 40, (2, 3))))
    assert any(len(b) < 5 for b, _ in short)


def test_a_search_makes_no_more_slots_than_the_catalog_keeps_alive(tmp_path):
    """Nine items of three tokens keep at most nine beams alive: a W=16 search makes 9
    slots (``max_live``), and its beams equal the reference's."""
    from decode_engine.beam import beam_search

    items = _items(0, 9)
    engine = _engine(tmp_path, items)
    catalog = build("shop", items, VOCAB)
    params = BeamParams(16, 3, catalog="shop")
    out = asyncio.run(beam_search(engine.generate, [3, 4, 16], params, eos_token_id=EOS,
                                  request_id="r", max_live=catalog.max_live(3)))
    assert catalog.max_live(3) == 9 and len(engine.slots) == 9
    assert [(b.token_ids, b.cum_logprob) for b in out.beams] == \
        reference([3, 4, 16], items, params)[0]


def test_without_the_block_copies_constrained_beams_differ(tmp_path):
    """Negative control: the slots' KV not replaced by their parents' leaves the
    reference on most cases."""
    differ = 0
    for width, tokens, penalty, ignore_eos, lengths, n in CASES:
        items = _items(0, n, lengths)
        params = BeamParams(width, tokens, length_penalty=penalty, ignore_eos=ignore_eos,
                            catalog="shop")
        prompt = [3, 4, width, tokens]
        got, _ = ours(prompt, params, _engine(tmp_path, items, copies=False))
        differ += got != reference(prompt, items, params)[0]
    assert differ >= 3


def test_an_unknown_catalog_fails_the_group(tmp_path):
    from kvhandoff.types import StageError

    with pytest.raises(StageError, match="no catalog 'other' here"):
        ours([3, 4], BeamParams(4, 3, catalog="other"), _engine(tmp_path, _items(0, 20)))


def test_a_search_whose_beams_all_ended_stops_there(tmp_path):
    """Items of two tokens, EOS not ignored, T = 6: after two tokens every beam is at a
    leaf, whose only candidate is EOS, so every beam completes at step 3 and the slots
    end there (step 0 and two slot steps, not six steps), with the reference's beams.
    With EOS ignored the leaves complete at step 3 too (a whole item with nothing after
    it)."""
    for ignore_eos in (False, True):
        items = _items(5, 30, (2,))
        prompt = [7, 4, 8, 6]
        params = BeamParams(beam_width=8, max_tokens=6, ignore_eos=ignore_eos,
                            catalog="shop")
        engine = _engine(tmp_path, items)
        got, outcome = ours(prompt, params, engine)
        assert got == reference(prompt, items, params)[0]
        assert engine.steps_run == 3 and len(outcome.slot_steps["select_ms"]) == 2
        assert outcome.step_computed_tokens[1:] == [8] * 2
        assert all(len(beam) == (2 if ignore_eos else 3) for beam, _ in got)

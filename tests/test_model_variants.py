"""Models that are not the built-in one (``kvhandoff.builtin.shapes.VARIANTS``): generated
with the geometry, architecture and dtype they claim, and the harness on one of them on
real engines, with a fault it must catch."""

from __future__ import annotations

import json

import pytest

from kvhandoff.builtin.shapes import VARIANT_SHAPES
from kvhandoff.model import DTYPE_BYTES, kv_bytes_per_block, model_dtype, resolve_model


@pytest.mark.parametrize("name", sorted(VARIANT_SHAPES))
def test_a_variant_is_generated_with_the_geometry_it_claims(name):
    from safetensors import safe_open

    shape = VARIANT_SHAPES[name]
    path = resolve_model(name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [shape.architecture]
    assert (config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (shape.num_attention_heads, shape.num_key_value_heads,
                                    shape.dims_per_head)
    assert config["tie_word_embeddings"] == shape.tie_word_embeddings
    assert model_dtype(path) == shape.torch_dtype
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
    assert str(embed.dtype) == f"torch.{shape.torch_dtype}"
    assert ("lm_head.weight" in names) != shape.tie_word_embeddings
    biased = "model.layers.0.self_attn.k_proj.bias" in names
    assert biased == (shape.architecture == "Qwen2ForCausalLM")
    kv_block = (2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.dims_per_head
                * 32 * DTYPE_BYTES[shape.torch_dtype])
    assert kv_bytes_per_block(path, 32, DTYPE_BYTES[model_dtype(path)]) == kv_block


def test_the_variants_differ_from_the_builtin_model_where_a_handoff_can_break(model_dir):
    """Between them: another head size, grouped and multi-query attention, tied
    embeddings, another architecture and bf16."""
    builtin = json.loads((resolve_model(model_dir) / "config.json").read_text())
    shapes = VARIANT_SHAPES.values()
    assert {s.dims_per_head for s in shapes} - {builtin["head_dim"]}
    assert any(s.num_attention_heads // s.num_key_value_heads == 4 for s in shapes)
    assert any(s.num_key_value_heads == 1 for s in shapes)
    assert any(s.tie_word_embeddings for s in shapes)
    assert {s.architecture for s in shapes} - set(builtin["architectures"])
    assert "bfloat16" in {s.torch_dtype for s in shapes}


#: The harness's cases that the geometry matters to most: a parent with a partial last
#: block at W = 32, one just past a block boundary, a long think, a move to D at a block
#: boundary.
VARIANT_CASES = ("n66-edge-w32", "n257-edge-w4", "p100-think-w32-s1", "move-at-32-w4")


@pytest.mark.engines
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["qwen2-gqa-tied", "llama-mqa-bf16"])
def test_the_harness_on_a_variant_is_identical_and_catches_a_fault(run, name):
    """P and D on a model that is not ours (its own dtype, D's pool sized for it): the
    harness's cases pass against the colocated reference and vLLM's beam_search, each
    within its measured noise, and a zeroed block 0 in D's import fails the case it
    can corrupt."""
    from tools.harness import Harness, default_cases, format_table
    from tools.harness.main import pair_settings
    from tools.local import local_pair

    path = resolve_model(name)
    cm = local_pair(str(path), lease_s=30, fault_injection=True, **pair_settings(path))
    pair = run(cm.__aenter__(), timeout=300)
    try:
        harness = Harness(pair.p, pair.d, tokenizer=pair.tokenizer,
                          think_end_id=pair.think_end_id, eos_id=pair.eos_id,
                          suffix_ids=pair.default_suffix_ids)
        cases = [c for c in default_cases() if c.name in VARIANT_CASES]
        report = run(harness.run(cases, model_dir=str(path)), timeout=600)
        print(format_table(report))
        assert [c.name for c in report.cases] == list(VARIANT_CASES)
        assert [c.name for c in report.cases if not c.ok] == [], format_table(report)
        assert report.pools_clean, report.pool_details
        faulted = run(harness.run(cases[:1], model_dir=str(path), fault="zero-block"),
                      timeout=300)
        print(format_table(faulted))
        (c,) = faulted.cases
        assert c.fault_applies and not c.ok and any("beams differ" in f or "cumulative" in f
                                                    for f in c.failures), c.failures
        assert faulted.pools_clean, faulted.pool_details
    finally:
        run(cm.__aexit__(None, None, None), timeout=300)

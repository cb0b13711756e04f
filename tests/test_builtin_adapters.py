"""The built-in adapters (``kvhandoff.builtin.adapters``) and an engine's reading of an
adapter directory (``connector.adapters``), without engines: the files vLLM's LoRA
loader reads (PEFT's names and shapes for the built-in model), with a B that is not
zero (a zero B would leave the model unchanged and every "the adapter changes the
outputs" meaningless); the digest that tells two adapters of one name apart; the
directories an engine refuses at its start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvhandoff.builtin.adapters import RANK, write_adapter

pytestmark = pytest.mark.fleet


def test_the_adapter_is_one_vllms_peft_reader_takes(model_dir, tmp_path):
    from safetensors.torch import load_file
    from vllm.lora.peft_helper import PEFTHelper

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    out = write_adapter(Path(model_dir), tmp_path / "a", seed=1)
    helper = PEFTHelper.from_local_dir(str(out), max_position_embeddings=None)
    assert helper.r == RANK and sorted(helper.target_modules) == ["q_proj", "v_proj"]
    tensors = load_file(str(out / "adapter_model.safetensors"))
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads", heads)
    assert len(tensors) == 4 * cfg["num_hidden_layers"]
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    v = "base_model.model.model.layers.0.self_attn.v_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (RANK, hidden)
    assert tensors[f"{q}.lora_B.weight"].shape == (heads * head_dim, RANK)
    assert tensors[f"{v}.lora_B.weight"].shape == (kv * head_dim, RANK)
    assert all(t.abs().sum() > 0 for t in tensors.values())
    other = load_file(str(write_adapter(Path(model_dir), tmp_path / "b", seed=2)
                          / "adapter_model.safetensors"))
    assert not all((tensors[k] == other[k]).all() for k in tensors)  # two adapters differ


def test_an_adapter_is_named_by_its_files_and_bad_directories_fail_at_load(model_dir,
                                                                          tmp_path):
    from connector.adapters import AdapterError, load, load_all, max_lora_rank
    from kvhandoff.builtin.adapters import builtin_adapter, resolve

    one = builtin_adapter(model_dir, 1)
    assert builtin_adapter(model_dir, 1) == one and resolve(model_dir, "builtin:1") == str(one)
    a, b = load_all((("a", str(one)), ("b", str(builtin_adapter(model_dir, 2))))).values()
    assert (a.lora_id, b.lora_id, a.rank) == (1, 2, RANK) and a.digest != b.digest
    assert load("again", one, 3).digest == a.digest  # the files name it, not the name
    assert max_lora_rank({"a": a}) == 8
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load("x", tmp_path / "empty", 1)
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load("x", tmp_path / "empty", 1)
    with pytest.raises(ValueError, match="builtin:SEED wants a number"):
        resolve(model_dir, "builtin:x")

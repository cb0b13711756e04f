"""``tools.adapter_probe``'s adapter, without engines: the files vLLM's LoRA loader
reads (PEFT's names and shapes for the built-in model), with a B that is not zero (a
zero B would leave the model unchanged and the probe's "the adapter changes the
outputs" meaningless). The probe itself starts two LoRA engines: run by hand (figures in
docs/decisions.md, "Adapters: what vLLM 0.32 offers")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.adapter_probe import RANK, write_adapter

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

"""LoRA adapters for the built-in model, made here (none can be downloaded): random
rank-8 adapters of its q and v projections in PEFT's format, the same bytes for the same
seed. ``--adapter NAME=builtin:SEED`` serves one; the tests and the adapter probe use
them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvhandoff.builtin.generate import cache_dir

RANK = 8


def write_adapter(model_dir: str | Path, out: Path, seed: int) -> Path:
    """A random LoRA adapter for the Llama at ``model_dir`` (q_proj and v_proj, rank 8,
    B non-zero so that it changes the outputs: PEFT's initial B = 0 would not), as vLLM
    reads PEFT's files."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, width in (("q_proj", heads * head_dim), ("v_proj", kv_heads * head_dim)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, RANK, generator=g) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
         "target_modules": ["q_proj", "v_proj"]}))
    return out


def builtin_adapter(model_dir: str | Path, seed: int) -> Path:
    """The built-in adapter of ``seed`` for ``model_dir``, written once into the cache
    (keyed by the model's config and the seed; written aside, then renamed)."""
    import hashlib

    config = (Path(model_dir) / "config.json").read_bytes()
    key = hashlib.sha256(config + f"/lora/{seed}".encode()).hexdigest()[:12]
    path = cache_dir() / "adapters" / f"lora-{seed}-{key}"
    if not (path / "adapter_config.json").is_file():
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        write_adapter(model_dir, tmp, seed)
        try:
            tmp.replace(path)
        except OSError:  # another process wrote it first: theirs has the same bytes
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return path


def resolve(model_dir: str | Path, path: str) -> str:
    """``--adapter``'s PATH: ``builtin:SEED`` names a built-in adapter, else a
    directory."""
    if path.startswith("builtin:"):
        seed = path.partition(":")[2]
        if not seed.isdigit():
            raise ValueError(f"--adapter PATH builtin:SEED wants a number, not {path!r}")
        return str(builtin_adapter(model_dir, int(seed)))
    return path

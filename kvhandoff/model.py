"""What the rest of the project asks of a model directory: which one a ``--model`` names
(:func:`resolve_model`: a local Hugging Face directory, or a built-in model generated on
first use by :mod:`kvhandoff.builtin.generate`, imported only then), its special
tokens' ids (:class:`ModelTokens`), its dtype, its KV bytes per block and its identity
(:func:`model_identity`: weights, config and tokenizer digested; its short form
:func:`model_fingerprint` is what handoffs carry)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.builtin.tokens import DEFAULT_SUFFIX_TEXT, THINK_END
from kvhandoff.digests import file_digests


def resolve_model(model: str | None) -> Path:
    """``None`` or ``"builtin"`` gives the built-in model, ``"bench"`` the bench model, a
    name of :data:`~kvhandoff.builtin.shapes.VARIANTS` that variant; anything else must be a local Hugging
    Face model directory."""
    if model in (None, "", "builtin"):
        from kvhandoff.builtin.generate import builtin_model_dir

        return builtin_model_dir()
    if model == "bench":
        from kvhandoff.builtin.generate import bench_model_dir

        return bench_model_dir()
    from kvhandoff.builtin.shapes import VARIANTS

    if model in VARIANTS:
        from kvhandoff.builtin.generate import variant_model_dir

        return variant_model_dir(model)
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: not a model directory (no config.json)")
    return path


#: Bytes per element of the dtypes a model may be run in.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_dtype(model_dir: str | Path) -> str:
    """The dtype a model directory was saved in (its config's ``torch_dtype``, or
    ``dtype`` in newer configs), float32 when it names none we run."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if dtype in DTYPE_BYTES else "float32"


def kv_bytes_per_block(model_dir: str | Path, block_size: int, dtype_bytes: int = 4) -> int:
    """KV bytes one block of ``block_size`` tokens takes for a Llama-like model directory
    (K and V, every layer) with ``dtype_bytes`` per element, read from its config."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * block_size * dtype_bytes


@dataclass
class ModelTokens:
    """Token ids of the model's special tokens and the default continuation suffix."""

    tokenizer: Any
    think_end_id: int | None
    eos_id: int | None
    default_suffix_ids: list[int]

    @classmethod
    def load(cls, model_dir: Path) -> ModelTokens:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        think_end = tok.convert_tokens_to_ids(THINK_END)
        if think_end is None or think_end == tok.unk_token_id:
            think_end = None
        return cls(
            tokenizer=tok,
            think_end_id=think_end,
            eos_id=tok.eos_token_id,
            default_suffix_ids=tok.encode(DEFAULT_SUFFIX_TEXT, add_special_tokens=False),
        )


#: Besides the weights, the identity covers the config and the files that say what a
#: token id means (a handoff carries ids). Not ``generation_config.json``: it holds
#: sampling defaults, which no KV and no id's meaning depends on.
IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                  "merges.txt", "tokenizer.model")
#: Weight files by suffix (what vLLM's loaders read: safetensors, PyTorch, GGUF), and
#: the shards' indexes (``*.index.json``).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TAG = "kvhandoff model identity v1"


def identity_files(model_dir: str | Path, *, weights: bool = True) -> list[str]:
    """The names of ``model_dir``'s files its identity covers (those present)."""
    path = Path(model_dir)
    names = {p.name for p in path.iterdir()
             if weights and (p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(".index.json"))}
    names.update(n for n in IDENTITY_FILES if (path / n).exists())
    return sorted(names)


def model_identity(model_dir: str | Path, *, load_format: object = "auto") -> str:
    """SHA-256 (hex) of what computed a model's KV: its weights, config and tokenizer.

    Each weight file is hashed whole, bytes as stored, rather than tensor by tensor:
    every tensor's bytes are in its file, so a retrained or perturbed checkpoint cannot
    give the same digest, and it reads any format vLLM loads (safetensors, ``.bin``,
    GGUF) without parsing it. What it costs: the same tensors saved again with another
    header or sharding differ too, which refuses a handoff that would have been valid
    (a recompute, never a wrong import). Computed once and cached by each file's stat
    (:mod:`kvhandoff.digests`). With ``load_format`` "dummy" vLLM draws the weights
    instead of reading them: the files' weights are left out and the identity says so.
    A path without ``config.json`` (not a model directory) is identified by its name."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return hashlib.sha256(str(model_dir).encode()).hexdigest()
    dummy = getattr(load_format, "value", load_format) == "dummy"
    return file_digests().digest(path, identity_files(path, weights=not dummy),
                                 f"{_TAG}{' dummy weights' if dummy else ''}")


def model_fingerprint(model_dir: str | Path, *, load_format: object = "auto") -> str:
    """The short form of :func:`model_identity` (16 hex digits) that a handoff and an
    engine's capacity carry, compared when P and D meet."""
    return model_identity(model_dir, load_format=load_format)[:16]

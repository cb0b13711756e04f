"""What the rest of the project asks of a model directory: which one a ``--model`` names
(:func:`resolve_model`: a local Hugging Face directory, or a built-in model generated on
first use by :mod:`kvhandoff.builtin.generate`, imported only then), its special
tokens' ids (:class:`ModelTokens`), its dtype, its KV bytes per block and its
fingerprint."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvhandoff.builtin.tokens import DEFAULT_SUFFIX_TEXT, THINK_END


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


def model_fingerprint(model_dir: str | Path) -> str:
    """A short digest of a model directory's config, compared when P and D meet."""
    path = Path(model_dir)
    config = path / "config.json"
    data = config.read_bytes() if config.is_file() else str(model_dir).encode()
    return hashlib.sha256(data).hexdigest()[:16]

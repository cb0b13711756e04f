"""Generating the built-in models, on first use.

Nothing is downloaded. On first use a model directory is generated into a cache
directory (``$KVHANDOFF_CACHE`` or ``~/.cache/kvhandoff``) and reused afterwards:

- ``tokenizer.json``: a byte-level BPE trained on a fixed, seeded synthetic corpus, with
  ``<think>``, ``</think>``, ``<|sid_begin|>``, ``<|sid_end|>`` as single special tokens
  and the 24 semantic-id tokens of :mod:`kvhandoff.builtin.corpus` as single ordinary tokens;
- ``config.json``: ``LlamaForCausalLM``, float32, small enough for two CPU cores;
- ``model.safetensors``: the built-in model is *trained* (:mod:`kvhandoff.builtin.train`, a fixed
  seed, about a minute here) on the two-stage corpus, so its thinking and its semantic
  ids depend on the prompt and stage 1 ends by ``</think>`` because it learned to. The
  bench model has seeded random weights at a realistic scale (see
  :func:`_seeded_weights`).

vLLM's dummy loader draws weights from U(-1e-3, 1e-3): logits come out nearly flat,
beams tie, and a token-exact comparison stops meaning anything.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Literal

from kvhandoff.builtin.corpus import SID_TOKENS, tokenizer_lines
from kvhandoff.builtin.shapes import (
    BENCH_SHAPE,
    BUILTIN_SHAPE,
    DEFAULT_SEEDING,
    VARIANTS,
    ModelShape,
    Seeding,
    seeded_weights,
)
from kvhandoff.builtin.tokens import (
    BOS,
    BUILTIN_MODEL_NAME,
    EOS,
    SID_BEGIN,
    SID_END,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
)
from kvhandoff.builtin.train import TrainConfig, train

logger = logging.getLogger(__name__)

#: How a generated model gets its weights: trained on the corpus, or drawn from a seed.
Weights = Literal["trained", "seeded"]

_SEED = 20261122



_WORDS = (
    "the user asked for items like these so we think about taste price season colour "
    "brand size style fit material recent views clicks carts orders reviews rating "
    "similar related popular new classic cheap premium light heavy warm cool outdoor "
    "indoor kitchen garden travel sport music book film game phone laptop camera shoe "
    "shirt coat bag watch lamp chair table bed sofa toy gift coffee tea snack fruit "
    "because therefore however maybe likely probably first second then next finally "
    "prefers avoids bought returned liked shared saved compared searched browsed "
    "morning evening weekend holiday summer winter spring autumn budget value quality "
    "recommend candidate ranking score signal history profile intent context session"
).split()


def cache_dir() -> Path:
    """Where generated models live."""
    root = os.environ.get("KVHANDOFF_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvhandoff"
    )
    return Path(root)


def _corpus(num_lines: int = 6000) -> list[str]:
    rng = random.Random(_SEED)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), str(rng.randint(0, 999)))
        lines.append(" ".join(words) + rng.choice([".", ",", "?", "!", "\n"]))
    return lines


def build_tokenizer(out_dir: Path, vocab_size: int) -> int:
    """Train the byte-level BPE tokenizer into ``out_dir``; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SID_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + tokenizer_lines(_SEED), trainer=trainer)
    tok.add_tokens(list(SID_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[THINK_START, THINK_END, SID_BEGIN, SID_END],
    )
    fast.save_pretrained(str(out_dir))
    return len(fast)


def _llama_config(shape: ModelShape, vocab_size: int, bos_id: int, eos_id: int) -> dict:
    return {
        "architectures": [shape.architecture],
        "model_type": shape.model_type,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.dims_per_head,
        "vocab_size": vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": shape.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": shape.torch_dtype,
        "initializer_range": 0.02,
    }


def _build(out_dir: Path, shape: ModelShape, weights: Weights, seeding: Seeding) -> None:
    from transformers import AutoTokenizer

    vocab_size = build_tokenizer(out_dir, shape.vocab_size)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = _llama_config(shape, vocab_size, ids[BOS], ids[EOS])
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if weights == "trained":
        result = train(str(out_dir), TrainConfig(seed=_SEED))
        logger.info("Trained %s: final loss %.3f in %.0fs", out_dir.name, result["loss"],
                    result["seconds"])
    else:
        from safetensors.torch import save_file

        # Logit offsets (the seeding's) that give </think> and EOS about 1% and 0.3% per
        # step on the bench model: stage 1 usually ends within ~100 tokens.
        tensors = seeded_weights(shape, vocab_size, {ids[THINK_END]: seeding.think_bias,
                                                     ids[EOS]: seeding.eos_bias}, _SEED,
                                 seeding)
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def _ensure(name: str, shape: ModelShape, weights: Weights,
            seeding: Seeding = DEFAULT_SEEDING) -> Path:
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time; others wait and reuse its result.
    with open(target.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        logger.info("Generating model %s into %s", name, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            _build(tmp, shape, weights, seeding)
            tmp.rename(target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def builtin_model_dir() -> Path:
    """The built-in model (trained on the two-stage corpus), generated on first use."""
    return _ensure(BUILTIN_MODEL_NAME, BUILTIN_SHAPE, "trained")


def bench_model_dir() -> Path:
    """The ~100M-parameter benchmark model (seeded weights, ~450 MB), generated on first
    use."""
    return _ensure("kvhandoff-bench-100m-v2", BENCH_SHAPE, "seeded")


def variant_model_dir(name: str) -> Path:
    """A model of :data:`~kvhandoff.builtin.shapes.VARIANTS` (seeded weights, the built-in tokenizer),
    generated on first use."""
    shape, seeding = VARIANTS[name]
    return _ensure(f"kvhandoff-{name}-v2", shape, "seeded", seeding)



def builtin_catalog(model_dir: str | Path) -> Path:
    """The built-in shop's catalog for ``model_dir`` (``corpus.shop_items`` as its
    tokenizer's ids, one item per line), written once next to the cached models."""
    from transformers import AutoTokenizer

    from kvhandoff.builtin.corpus import shop_items

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lines = []
    for item in shop_items():
        ids = tokenizer.convert_tokens_to_ids(item)
        if tokenizer.unk_token_id in ids or None in ids:
            raise ValueError(f"{model_dir}: the built-in catalog needs the built-in "
                             f"tokenizer's semantic-id tokens ({item} are not all tokens)")
        lines.append(" ".join(map(str, ids)))
    text = "# the built-in shop: <a*><b*><c*> semantic ids, one item per line\n"
    text += "\n".join(lines) + "\n"
    path = cache_dir() / "catalogs" / f"shop-{hashlib.sha256(text.encode()).hexdigest()[:12]}.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path



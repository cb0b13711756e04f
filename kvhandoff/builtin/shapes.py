"""What a generated model is: its shape (architecture, geometry, dtype), how its seeded
weights are drawn, and the shapes of the built-in, bench and variant models
(:mod:`kvhandoff.model` generates, caches and resolves them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

_BIAS_CHANNEL_VALUE = 4.0


#: Architectures a generated model can have (Hugging Face names).
Architecture = Literal["LlamaForCausalLM", "Qwen2ForCausalLM"]
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelShape:
    """Dimensions, architecture and dtype of a generated model. Qwen2 differs from Llama
    by biases on q, k and v; ``head_dim`` None = ``hidden_size / num_attention_heads``."""

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 8192
    architecture: Architecture = "LlamaForCausalLM"
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    torch_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.architecture not in _MODEL_TYPES:
            raise ValueError(f"architecture must be one of {sorted(_MODEL_TYPES)}")

    @property
    def model_type(self) -> str:
        """The config's ``model_type`` for its architecture."""
        return _MODEL_TYPES[self.architecture]

    @property
    def dims_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Seeding:
    """How seeded weights are drawn (:func:`_seeded_weights`): the embeddings' scale, a
    gain on what each layer writes to the residual stream, and the logit offsets of
    ``</think>`` and EOS (in units of the normalised bias channel) that end stage 1."""

    embed_std: float = 1.0
    layer_gain: float = 1.0
    think_bias: float = 0.6
    eos_bias: float = 0.66


#: The bench model's seeding, and every seeded model's unless it names its own.
DEFAULT_SEEDING = Seeding()

#: The built-in model: 4 layers of 2 KV heads of 64 (128 KiB per 32-token fp32 block, as
#: the tests' pool sizes assume), narrow enough to train in about a minute on 2 cores.
BUILTIN_SHAPE = ModelShape(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
)

#: A ~100M-parameter shape for benchmarks, with seeded weights: realistic compute, and
#: logits peaked enough that beams do not tie (vLLM's dummy weights give flat logits).
BENCH_SHAPE = ModelShape(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=1024,
)

#: Models of other architectures and geometries than the built-in one, seeded like the
#: bench model (``kvhandoff verify --model NAME``: the harness on models that are not
#: ours). Each differs from the built-in Llama (fp32, 2 heads of 64, no grouping, untied)
#: in what a KV handoff depends on: head size, KV heads per query head, the KV dtype.
VARIANTS: dict[str, tuple[ModelShape, Seeding]] = {
    # Qwen2 (q/k/v biases), 8 heads of 32 over 2 KV heads (GQA 4:1), tied embeddings.
    # Tied rows are read back by the last layer: small embeddings and louder layers keep
    # the next token from being the current one (p 0.02 instead of 1.0), larger offsets
    # give </think> 1-3 % per step as in the others.
    "qwen2-gqa-tied": (ModelShape(hidden_size=256, intermediate_size=688,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, architecture="Qwen2ForCausalLM",
                                  tie_word_embeddings=True),
                       Seeding(embed_std=0.3, layer_gain=3.0, think_bias=3.0, eos_bias=1.2)),
    # Llama in bfloat16 (what GPU users run), 2 heads of 128 over one KV head (MQA).
    "llama-mqa-bf16": (ModelShape(hidden_size=256, intermediate_size=688,
                                  num_hidden_layers=4, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=128,
                                  torch_dtype="bfloat16"),
                       Seeding(think_bias=1.0, eos_bias=0.8)),
}
#: Their shapes, by name.
VARIANT_SHAPES = {name: shape for name, (shape, _) in VARIANTS.items()}



def seeded_weights(shape: ModelShape, vocab_size: int, bias_rows: dict[int, float],
                   seed: int, seeding: Seeding = DEFAULT_SEEDING):
    """Random weights drawn from a fixed seed, peaked enough that beams do not tie.
    Channel 0 of the residual stream is a constant "bias channel" (every embedding holds
    ``_BIAS_CHANNEL_VALUE`` there and no layer writes it), so the output row of a token
    in ``bias_rows`` raises that token's logit by a fixed offset. With tied embeddings the
    output rows are the embeddings: the offset rides on channel 0 of the token's
    embedding, and the final norm scales the other channels as an untied head would."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter = shape.hidden_size, shape.intermediate_size
    q = shape.num_attention_heads * shape.dims_per_head
    kv = shape.num_key_value_heads * shape.dims_per_head
    qwen = shape.architecture == "Qwen2ForCausalLM"

    def normal(*size: int, std: float) -> torch.Tensor:
        return torch.randn(*size, generator=g) * std

    w: dict[str, torch.Tensor] = {}
    embed_std, layer_gain = seeding.embed_std, seeding.layer_gain
    embed = normal(vocab_size, h, std=embed_std)
    embed[:, 0] = _BIAS_CHANNEL_VALUE
    w["model.embed_tokens.weight"] = embed
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = normal(q, h, std=h**-0.5)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h, std=h**-0.5)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h, std=h**-0.5)
        if qwen:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = normal(size, std=0.1)
        o_proj = normal(h, q, std=layer_gain * 0.5 * q**-0.5)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        down = normal(h, inter, std=layer_gain * 0.5 * inter**-0.5)
        # Layers never write the bias channel, so it reaches the final norm intact.
        o_proj[0, :] = 0.0
        down[0, :] = 0.0
        w[p + "self_attn.o_proj.weight"] = o_proj
        w[p + "mlp.down_proj.weight"] = down
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    head_std = 2.5 * h**-0.5
    if shape.tie_word_embeddings:
        norm = torch.full((h,), head_std / embed_std)
        norm[0] = 1.0
        for token_id, bias in bias_rows.items():
            embed[token_id, 0] += bias
        w["model.norm.weight"] = norm
    else:
        w["model.norm.weight"] = torch.ones(h)
        lm_head = normal(vocab_size, h, std=head_std)
        lm_head[:, 0] = 0.0
        for token_id, bias in bias_rows.items():
            lm_head[token_id, 0] = bias
        w["lm_head.weight"] = lm_head
    dtype = getattr(torch, shape.torch_dtype)
    return {k: v.to(dtype).contiguous() for k, v in w.items()}

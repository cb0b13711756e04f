"""One token's keys and values in a layer's KV cache, whatever the attention backend's
block interior, and keys moved to other positions (RoPE applied again by the delta).

vLLM's CPU attention packs each block's keys per ISA (``cpu_attn_reshape_and_cache``;
``vec``, ``vec16``, ``amx``, ``neon`` differ), and no op reads them back, so a token is
not a row of the tensor. :class:`TokenKV` learns where the backend's own writer
(``impl.do_kv_cache_update``, what the forward pass writes with) puts each element: it
writes index digits into a one-block scratch cache and reads them back, once per layout.
Reads and writes are then gathers and scatters by those offsets. A layout that is not a
permutation of the written elements (a quantised cache) is refused at the probe.

:class:`Rerotation` turns a key cached at position ``p`` into the key at ``p + delta``:
RoPE rotations compose (``R(p + d) = R(d) R(p)``) for the plain, linear and llama3
frequency schedules, so the model's own cos/sin table at ``|delta|`` (sine negated for a
negative delta) is all it needs. Schedules that scale by the sequence (YaRN's mscale,
dynamic NTK) do not compose: refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

#: Element dtypes a probe can read back exactly (digits below 64 are exact in each).
_PROBED_DTYPES = ("torch.float32", "torch.bfloat16", "torch.float16")
_DIGIT_BASE = 64
#: Architectures whose attention applies neox-style RoPE to the cached keys.
NEOX_ROPE_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
})
#: RoPE schedules whose rotations compose by position.
COMPOSABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3"})

#: ``writer(key, value, kv_cache, slot_mapping)``: the backend's cache write (keys and
#: values ``[tokens, kv_heads, head_size]``).
Writer = Callable[[Any, Any, Any, Any], None]


class LayoutError(RuntimeError):
    """The cache layout cannot be read token by token."""


class TokenKV:
    """Token reads and writes for caches shaped ``[blocks, ...]`` with ``block_size``
    tokens a block (the kernel's block), laid out as ``writer`` lays them out."""

    def __init__(self, writer: Writer, block_shape: tuple[int, ...], dtype: Any,
                 device: Any, block_size: int, num_kv_heads: int, head_size: int):
        import torch

        if str(dtype) not in _PROBED_DTYPES:
            raise LayoutError(f"KV cache dtype {dtype} cannot be read token by token")
        self.block_size = block_size
        self.block_numel = math.prod(block_shape)
        shape = (block_size, num_kv_heads, head_size)
        scratch = torch.zeros((1, *block_shape), dtype=dtype, device=device)
        slots = torch.arange(block_size, dtype=torch.long, device=device)
        index = torch.arange(math.prod(shape), device=device).view(shape)
        num_digits = max(1, math.ceil(math.log(index.numel(), _DIGIT_BASE)))
        offsets = []
        for side in (0, 1):  # keys, values
            code = torch.zeros(scratch.numel(), dtype=torch.long, device=device)
            written = None
            for k in range(num_digits):
                digit = ((index // _DIGIT_BASE ** k) % _DIGIT_BASE + 1).to(dtype)
                zero = torch.zeros_like(digit)
                scratch.zero_()
                writer(*((digit, zero) if side == 0 else (zero, digit)), scratch, slots)
                got = scratch.view(-1).float().round().long()
                if written is None:
                    written = got > 0
                code += (got - 1).clamp(min=0) * _DIGIT_BASE ** k
            assert written is not None
            where = written.nonzero().squeeze(1)
            found = code[where]
            if len(where) != index.numel() or len(torch.unique(found)) != index.numel():
                raise LayoutError(
                    f"the backend's cache write is not a permutation of a block's "
                    f"{'keys' if side == 0 else 'values'} ({len(where)} elements written "
                    f"for {index.numel()})")
            offset = torch.empty(index.numel(), dtype=torch.long, device=device)
            offset[found] = where
            offsets.append(offset.view(shape))
        self._key_offsets, self._value_offsets = offsets

    def _rows(self, cache: Any) -> Any:
        import torch

        if not cache[0].is_contiguous() or cache[0].numel() != self.block_numel:
            raise LayoutError(f"KV cache blocks of shape {tuple(cache.shape)} and strides "
                              f"{cache.stride()} are not contiguous")
        return torch.as_strided(cache, (cache.shape[0], self.block_numel),
                                (cache.stride(0), 1))

    def _blocks(self, rows: Any, slots: Any) -> tuple[Any, Any, Any, Any]:
        """The whole blocks ``slots`` fall in (``[m, block_numel]``, a copy), their ids,
        and each slot's row among them and offset in its block."""
        import torch

        blocks, row = torch.unique(slots // self.block_size, sorted=True,
                                   return_inverse=True)
        return rows.index_select(0, blocks), blocks, row, slots % self.block_size

    def _tokens(self, data: Any, offsets: Any) -> Any:
        """Blocks' data as tokens: ``[m, block_size, kv_heads, head_size]``. One small
        gather per block (the offsets of one block), not one index per element."""
        return data.index_select(1, offsets.view(-1)).view(len(data), *offsets.shape)

    def read(self, cache: Any, slots: Any) -> tuple[Any, Any]:
        """Keys and values at ``slots`` (block * block_size + offset), each
        ``[len(slots), kv_heads, head_size]`` in the cache's dtype."""
        data, _, row, offset = self._blocks(self._rows(cache), slots)
        return (self._tokens(data, self._key_offsets)[row, offset],
                self._tokens(data, self._value_offsets)[row, offset])

    def write(self, cache: Any, slots: Any, keys: Any, values: Any) -> None:
        """Write ``keys`` and ``values`` at ``slots``; every other element is kept (the
        blocks are read, changed and written back whole)."""
        rows = self._rows(cache)
        data, blocks, row, offset = self._blocks(rows, slots)
        for offsets, new in ((self._key_offsets, keys), (self._value_offsets, values)):
            tokens = self._tokens(data, offsets)
            tokens[row, offset] = new.to(cache.dtype)
            data.index_copy_(1, offsets.view(-1), tokens.view(len(data), -1))
        rows.index_copy_(0, blocks, data)


class Rerotation:
    """Keys rotated by a position delta, with the model's own RoPE table."""

    def __init__(self, cos_sin_cache: Any):
        #: ``[max_position, rotary_dim]``: cos then sin of ``position * inv_freq``.
        self._table = cos_sin_cache.float()
        self.rotary_dim = int(cos_sin_cache.shape[1])

    @staticmethod
    def check_model(model_config: Any) -> dict[str, Any]:
        """``model_config``'s RoPE parameters; LayoutError where its keys' positions
        cannot be moved (another RoPE style or schedule)."""
        architecture = (getattr(model_config.hf_config, "architectures", None) or ["?"])[0]
        if architecture not in NEOX_ROPE_ARCHITECTURES:
            raise LayoutError(f"keys of {architecture} cannot be moved: its RoPE style is "
                              f"not known here (known: {sorted(NEOX_ROPE_ARCHITECTURES)})")
        rope = dict(getattr(model_config.hf_text_config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in COMPOSABLE_ROPE_TYPES:
            raise LayoutError(f"RoPE schedule {rope_type!r} does not compose by position; "
                              f"keys can be moved under {sorted(COMPOSABLE_ROPE_TYPES)}")
        return rope

    @classmethod
    def for_model(cls, vllm_config: Any) -> Rerotation:
        """The rotation of the model's attention (``check_model`` first), its table
        built as the model builds it."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope

        model_config = vllm_config.model_config
        rope = cls.check_model(model_config)
        with set_current_vllm_config(vllm_config):
            emb = get_rope(model_config.get_head_size(),
                           model_config.hf_text_config.max_position_embeddings,
                           is_neox_style=True, rope_parameters=rope or None,
                           dtype=torch.float32)
        return cls(emb.cos_sin_cache)

    def apply(self, keys: Any, deltas: Any) -> Any:
        """``keys`` ``[n, heads, head_size]`` each rotated by its ``deltas[i]``
        (neox style: the rotary dimensions' halves pair up), in float32."""
        keys = keys.float()
        table = self._table.to(keys.device)[deltas.abs()]
        half = self.rotary_dim // 2
        cos = table[:, None, :half]
        sin = table[:, None, half:] * deltas.sign()[:, None, None].float()
        x1, x2 = keys[..., :half], keys[..., half:self.rotary_dim]
        out = keys.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:self.rotary_dim] = x2 * cos + x1 * sin
        return out

"""Approximate composition: a prompt's first tokens take their KV from chunks held on
this engine that were prefilled at other positions (or under other context), with the
keys moved to their new positions; the rest of the prompt is computed.

A stage 1 sent with ``kv_transfer_params[BLEND_KEY] = {"parts": [[source,
source_start, length, position], ...], "num_loaded": L}`` names, for each part, a
request held here (a pinned chunk, ``connector.beam_fork``'s kept requests), the range
of its tokens to copy and where they go in the prompt. Parts tile the prompt from 0; the
connector loads its first ``L`` tokens (at most the prompt's length - 1) from them, and
vLLM computes the rest, which attend to the loaded KV: the recomputed tail::

    prompt:  | chunk a (delta 0) | chunk b (delta +n)   |.. recomputed ..| query |
             |<--------- loaded: L tokens ---------->|<----- computed ------>|

Each loaded token's value is copied and its key rotated by ``delta = position - source
position`` (``connector.token_kv``). What is not recomputed never attended to the chunks
before it: the result is approximate, and the router says so. Its blocks hash under the
request's cache salt (the router's), so neither this engine's prefix cache nor the D
that imports them serves them to a request without the same salt.

Who owns the blocks: the sources stay held (a pinned chunk is released only by
Release; a Release arriving in the same step frees them after this step's copies). The
loaded tokens are counted as the connector's (vLLM's external tokens), loaded
synchronously in the step that schedules the request, before its forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from connector.adapters import adapter_of
from connector.blend_spec import BlendPart, parse_parts
from connector.params import BlendReport
from connector.step_orders import BlendCopies

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from connector.beam_fork import KeptRequest

logger = logging.getLogger(__name__)

#: Why this process's worker cannot make the copies (its layout probe or RoPE table
#: failed at start; None: it can). On CPU the worker runs in the engine-core process,
#: beside the scheduler side, which refuses every composition then (``availability``
#: admits CPU attention only). A registry, and the only one between the two sides: vLLM
#: builds each side of the connector on its own and hands neither the other, and the
#: worker learns this when vLLM registers its KV caches, before any step's worker
#: metadata could carry it to a composition arriving first.
_worker_unavailable: str | None = None


class BlendScheduler:
    """Scheduler side: which prompt tokens a composed stage 1 loads from held chunks,
    and the copies into its blocks once they are allocated."""

    def __init__(self, block_size: int, kept: Mapping[str, KeptRequest],
                 unavailable: str = ""):
        self._block_size = block_size
        self._kept = kept  # the beam fork's held requests, by name (read only)
        #: Why this engine cannot move keys ("": it can): every composition is refused.
        self.unavailable = unavailable
        self._pending: dict[str, tuple[list[BlendPart], int]] = {}
        self._blended: dict[str, BlendReport] = {}  # by request id
        self._copies: list[BlendCopies] = []

    @staticmethod
    def availability(vllm_config: Any) -> str:
        """Why this engine cannot move keys ("": it can): its model's RoPE, or a
        quantised cache (``connector.token_kv``)."""
        from vllm.platforms import current_platform

        from connector.token_kv import LayoutError, Rerotation

        if not current_platform.is_cpu():
            # The worker reads caches that lead with the block dimension, as CPU
            # attention's do; other backends' layouts are not checked yet.
            return "approximate compositions run on CPU attention only, so far"
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            return f"a {cache_dtype} KV cache cannot be read token by token"
        try:
            Rerotation.check_model(vllm_config.model_config)
        except LayoutError as e:
            return str(e)
        return ""

    def match(self, request: Request, spec: Mapping[str, Any], num_computed: int) -> int:
        """Tokens past ``num_computed`` (prefix hits under the same salt) to load; 0
        with the reason logged and reported where the spec cannot be honoured (a
        source gone, other tokens, another adapter): the tokens are then computed."""
        try:
            unavailable = self.unavailable or _worker_unavailable
            if unavailable:
                raise ValueError(unavailable)
            if not request.cache_salt:
                raise ValueError("its blocks would not be salted (no cache salt)")
            parts, num_loaded = parse_parts(spec)
            self._check(request, parts)
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("%s: approximate composition refused, computing its prompt: %s",
                           request.request_id, e)
            # Prefix hits under its salt (a run before a preemption, or an identical
            # composition) still hold copied KV: counted, so the answer stays flagged.
            self._blended[request.request_id] = BlendReport(
                num_computed if request.cache_salt else 0, str(e))
            return 0
        num_loaded = min(num_loaded, request.num_prompt_tokens - 1)
        # Prefix hits under the salt hold what an identical composition loaded.
        self._blended[request.request_id] = BlendReport(num_loaded)
        if num_loaded <= num_computed:
            return 0
        self._pending[request.request_id] = (parts, num_loaded)
        return num_loaded - num_computed

    def _check(self, request: Request, parts: list[BlendPart]) -> None:
        prompt = request.prompt_token_ids or []
        for part in parts:
            source = self._kept.get(part.source)
            if source is None or not source.held:
                raise ValueError(f"{part.source} is not held here")
            if source.adapter != adapter_of(request):
                raise ValueError(f"{part.source} was computed under another adapter")
            end = part.source_start + part.length
            if end > len(source.token_ids) or (
                    source.token_ids[part.source_start:end]
                    != list(prompt[part.position:part.position + part.length])):
                raise ValueError(f"{part.source}'s tokens {part.source_start}:{end} are "
                                 f"not the prompt's at {part.position}")

    def scheduled(self, request: Request, block_ids: list[int], num_external: int,
                  rotate: bool) -> None:
        """``request`` got its blocks (``block_ids``, its first KV group's, from token
        0): queue the copies of its ``num_external`` loaded tokens for the next step."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None or num_external <= 0:
            return
        parts, num_loaded = pending
        bs = self._block_size
        dest = np.arange(num_loaded - num_external, num_loaded)
        source_pos = np.empty_like(dest)
        source_slots = np.empty_like(dest)
        for part in parts:
            within = (dest >= part.position) & (dest < part.position + part.length)
            if not within.any():
                continue
            pos = dest[within] - part.position + part.source_start
            blocks = np.asarray(self._kept[part.source].block_ids[0])
            source_pos[within] = pos
            source_slots[within] = blocks[pos // bs] * bs + pos % bs
        dest_slots = np.asarray(block_ids)[dest // bs] * bs + dest % bs
        self._copies.append(BlendCopies(source_slots.tolist(), dest_slots.tolist(),
                                        (dest - source_pos).tolist(), rotate))

    def take_copies(self) -> list[BlendCopies]:
        """This step's copies (the worker's from here)."""
        copies, self._copies = self._copies, []
        return copies

    def finished(self, request: Request) -> BlendReport | None:
        """What ``request`` blended (None: it named no composition), for its output."""
        self._pending.pop(request.request_id, None)
        return self._blended.pop(request.request_id, None)


class BlendWorker:
    """Worker side: token copies with keys moved, through each layer's own layout."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any):
        self._vllm_config = vllm_config
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self._num_kv_heads = int(getattr(spec, "num_kv_heads", 0))
        self._head_size = int(getattr(spec, "head_size", 0))
        self._caches: list[tuple[str, Any]] = []  # (layer name, tensor), distinct tensors
        self._kernel_block_size = 0
        self._layouts: dict[tuple[Any, ...], Any] = {}  # TokenKV by block shape, dtype
        self._rotation: Any = None

    def register(self, kv_caches: dict[str, Any], kernel_block_size: int) -> None:
        """The engine's KV caches, once at start (``register_kv_caches``, after vLLM
        built the attention backends): each layout probed and the RoPE table built now;
        a failure is logged and makes the scheduler side refuse every composition."""
        global _worker_unavailable
        seen = set()
        for name, tensor in kv_caches.items():
            if isinstance(tensor, (list, tuple)) or tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            self._caches.append((name, tensor))
        self._kernel_block_size = kernel_block_size
        if BlendScheduler.availability(self._vllm_config):
            return  # refused on the scheduler side already
        from connector.token_kv import LayoutError, Rerotation

        try:
            self._rotation = Rerotation.for_model(self._vllm_config)
            for name, cache in self._caches:
                self._layout(name, cache)
        except (LayoutError, KeyError, AttributeError, RuntimeError) as e:
            _worker_unavailable = f"this engine cannot read its KV cache by token: {e}"
            logger.warning("Approximate compositions off: %s", _worker_unavailable)

    def apply(self, copies: list[BlendCopies]) -> None:
        """Make this step's copies, every layer, before the forward pass."""
        import torch

        if not copies:
            return
        if self._rotation is None or _worker_unavailable:
            raise RuntimeError(f"approximate-composition copies scheduled on a worker that "
                               f"cannot make them: {_worker_unavailable or 'no RoPE table'}")
        device = self._caches[0][1].device
        src = torch.tensor([s for c in copies for s in c.source_slots], device=device)
        dst = torch.tensor([s for c in copies for s in c.dest_slots], device=device)
        deltas = torch.tensor([d if c.rotate else 0 for c in copies for d in c.deltas],
                              device=device)
        moved = bool(deltas.any())
        for name, cache in self._caches:
            layout = self._layout(name, cache)
            keys, values = layout.read(cache, src)
            if moved:
                keys = self._rotation.apply(keys, deltas)
            layout.write(cache, dst, keys, values)

    def _layout(self, name: str, cache: Any) -> Any:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention.attention import Attention

        from connector.token_kv import TokenKV

        key = (tuple(cache.shape[1:]), cache.dtype)
        layout = self._layouts.get(key)
        if layout is None:
            layer = get_layers_from_vllm_config(self._vllm_config, Attention, [name])[name]

            def writer(k: Any, v: Any, kv_cache: Any, slots: Any) -> None:
                layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots)

            layout = self._layouts[key] = TokenKV(
                writer, tuple(cache.shape[1:]), cache.dtype, cache.device,
                self._kernel_block_size, self._num_kv_heads, self._head_size)
        return layout

"""The KV pools the probe READs between, and what is checked in them.

Two layouts, each seen as one ``uint8`` view per layer, ``[pool_blocks, page_bytes]``,
whose row stride is where the layouts differ:

- ``layer_outer``: vLLM 0.32's CUDA FlashAttention pool, one tensor per layer
  ``[num_blocks, kv_heads, block, 2 * head_dim]``: a layer's view is its tensor, stride
  one page;
- ``blocks_outer``: vLLM's BLHNC, one tensor ``[num_blocks, layers, kv_heads, block,
  2 * head_dim]``: block ``b``'s row holds every layer's page side by side, a layer's
  view strided by the row (``layers * page`` bytes).

vLLM's descriptors over either are the same rule (:func:`block_descs`): one per block
per layer, region-major, at ``view base + b * stride``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Llama-3-8B's KV geometry (32 layers, 8 KV heads of 128, bf16) in blocks of 16 tokens.
LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block": 16, "dtype_bytes": 2}

LAYER_OUTER = "layer_outer"
BLOCKS_OUTER = "blocks_outer"
LAYOUTS = {LAYER_OUTER: "[num_blocks, kv_heads, block, 2*head_dim] per layer",
           BLOCKS_OUTER: "[num_blocks, layers, kv_heads, block, 2*head_dim], one tensor"}

#: The READ modes ``--modes`` picks among, and the layout each reads (``one_desc`` and
#: ``copy``, the baselines, always run).
MODES = {"vllm_descs": LAYER_OUTER, "runs": LAYER_OUTER, "runs_blocks_outer": BLOCKS_OUTER}

#: What D's destination blocks hold before each READ: never a pattern byte (those are
#: below 251), so a piece the READ left unread fails the check.
CLEAR = 0xFF


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    block: int
    dtype_bytes: int
    #: Blocks in each process's pool (per layer).
    pool_blocks: int

    @property
    def page_bytes(self) -> int:
        """One block of one layer: K and V of every KV head (vLLM's page size)."""
        return 2 * self.kv_heads * self.head_dim * self.block * self.dtype_bytes

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block)


def device(name: str) -> tuple[Any, str, int]:
    """(torch device, NIXL memory type, device id) for ``cuda`` or ``cpu``."""
    import torch

    if name == "cuda":
        return torch.device("cuda", 0), "VRAM", 0
    return torch.device("cpu"), "DRAM", 0


def sync(dev: Any) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def pattern(layer: int, block: Any, offset: int) -> Any:
    """The byte the owner writes into every byte of (layer, block): a value below 251
    that differs between neighbouring blocks and layers."""
    return (layer * 31 + block * 7 + 1 + offset) % 251


def block_descs(bases: list[int], stride: int, geo: Geometry, dev_id: int) -> np.ndarray:
    """Descriptors of every block of every layer region, region-major, as vLLM's
    ``_build_fa_local`` makes them: row ``layer * pool_blocks + b`` is
    ``(bases[layer] + b * stride, page bytes, dev_id)``, a ``(layers * pool_blocks, 3)``
    uint64 array."""
    rows = []
    for base in bases:
        addrs = np.uint64(base) + np.arange(geo.pool_blocks, dtype=np.uint64) * np.uint64(stride)
        rows.append(np.stack([addrs, np.full_like(addrs, geo.page_bytes),
                              np.full_like(addrs, dev_id)], axis=1))
    return np.concatenate(rows).astype(np.uint64)


def region_major(geo: Geometry, blocks: np.ndarray) -> np.ndarray:
    """Indices into :func:`block_descs` of ``blocks`` in every layer, region-major
    (vLLM's ``_get_block_descs_ids``)."""
    return np.concatenate([layer * geo.pool_blocks + blocks for layer in range(geo.layers)])


@dataclass
class Pool:
    """One process's pool in one layout: the allocations (what NIXL registers) and a
    ``uint8`` view per layer, ``[pool_blocks, page_bytes]``."""

    layout: str
    tensors: list[Any]
    views: list[Any]

    @property
    def bases(self) -> list[int]:
        """Each layer's view's address (block 0 of that layer)."""
        return [v.data_ptr() for v in self.views]

    @property
    def stride(self) -> int:
        """Bytes from one block of a layer to the next."""
        return int(self.views[0].stride(0))

    def regions(self, dev_id: int) -> list[tuple[int, int, int, str]]:
        """The allocations as NIXL's ``register_memory`` takes them."""
        return [(t.data_ptr(), t.nbytes, dev_id, "") for t in self.tensors]

    def fill(self, offset: int) -> None:
        """Every byte of (layer, block) := :func:`pattern` (layer, block, offset)."""
        import torch

        for layer, view in enumerate(self.views):
            values = pattern(layer, torch.arange(view.shape[0], device=view.device), offset)
            view[:] = values.to(torch.uint8)[:, None]

    def clear(self, blocks: np.ndarray | None = None) -> None:
        """Every byte of ``blocks`` (default: every block) in every layer := :data:`CLEAR`."""
        import torch

        index = slice(None) if blocks is None else torch.as_tensor(
            blocks, device=self.views[0].device)
        for view in self.views:
            view[index] = CLEAR

    def check(self, src: np.ndarray, dst: np.ndarray, what: str) -> None:
        """Every byte of this pool's block ``dst[i]`` of every layer is P's pattern for
        ``src[i]`` (offset 0), and every other block still holds :data:`CLEAR` (the pool
        cleared before the READs); raises RuntimeError otherwise: a READ that moved the
        wrong blocks, left a piece unread or wrote past its destination fails here."""
        import torch

        dev = self.views[0].device
        src_t, dst_t = torch.as_tensor(src, device=dev), torch.as_tensor(dst, device=dev)
        others = torch.ones(self.views[0].shape[0], dtype=torch.bool, device=dev)
        others[dst_t] = False
        for layer, view in enumerate(self.views):
            got = view[dst_t]
            want = pattern(layer, src_t, 0).to(torch.uint8)[:, None]
            if not bool((got == want).all()):
                wrong = int((got != want).any(dim=1).sum())
                raise RuntimeError(f"{what}: layer {layer}: {wrong} of {len(dst)} blocks "
                                   "read hold other bytes than the P blocks they were "
                                   "read from")
            written = int((view[others] != CLEAR).any(dim=1).sum())
            if written:
                raise RuntimeError(f"{what}: layer {layer}: {written} blocks outside the "
                                   "READ's destination were written")


def make_pool(geo: Geometry, dev: Any, layout: str) -> Pool:
    """An uninitialised pool of ``geo`` in ``layout`` on ``dev``, bf16 (or any type of
    ``dtype_bytes``: only the bytes matter here)."""
    import torch

    dtype = {2: torch.bfloat16, 4: torch.float32}[geo.dtype_bytes]
    page = (geo.kv_heads, geo.block, 2 * geo.head_dim)
    if layout == LAYER_OUTER:
        tensors = [torch.empty((geo.pool_blocks, *page), dtype=dtype, device=dev)
                   for _ in range(geo.layers)]
        views = [t.view(torch.uint8).view(geo.pool_blocks, -1) for t in tensors]
    elif layout == BLOCKS_OUTER:
        tensors = [torch.empty((geo.pool_blocks, geo.layers, *page), dtype=dtype, device=dev)]
        rows = tensors[0].view(torch.uint8).view(geo.pool_blocks, geo.layers, geo.page_bytes)
        views = [rows[:, layer] for layer in range(geo.layers)]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return Pool(layout, tensors, views)

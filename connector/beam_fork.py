"""Beam fork: a request copies the partial last block of a kept request it extends
instead of recomputing it. A part of the connector's scheduler and of its worker.

vLLM's prefix cache shares only full blocks, so each beam slot (``decode_engine.beam_slots``)
would recompute the partial last block of the parent it starts from (up to
``block_size`` tokens per slot). Stage 2's step 0 sent with ``kv_transfer_params[BEAM_KEY]``
= ``{"id": name, "keep": True}`` keeps its blocks when it ends; a slot with
``{"fork_from": name, "fork_children": W}`` loads the tokens its local prefix-cache hit
does not cover by a block copy from the kept request, so it computes one token::

    kept request:  | full blocks (prefix-cached, shared) | partial block P |
    child:         | same full blocks (cache hit)        | copy of P | + 1 new token

Who owns the blocks: a kept request's blocks stay allocated (vLLM's delay-free) until it
is released, which happens once its ``k`` children were scheduled, or after
``beam_fork_hold_s`` (its children never came: the search failed or was cancelled). The
worker reports a released request as "finished sending" and the scheduler frees it.

A child copies only from a kept request computed under its own LoRA adapter (the
prefix cache's hashes keep adapters apart; the copy must too). A parent held on its own
engine (the one-engine path of continuations) is a kept request
with ``hold_s``: released only when that time ends, whatever its children. Its full
blocks stay hashed in the prefix cache (held blocks are never evicted) and its children
copy the partial last one, so a continuation computes ``len(suffix) + 1`` tokens however
much else went through the cache meanwhile.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connector.adapters import adapter_of
from connector.handoff import is_made_slot
from connector.params import BEAM_KEY

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from connector.stats import ContinuationStats
    from connector.step_orders import StepOrders

logger = logging.getLogger(__name__)


def beam_params(request: Request) -> dict[str, Any] | None:
    """The request's beam-fork parameters (None: not a beam step)."""
    params = request.kv_transfer_params
    return params.get(BEAM_KEY) if params else None


@dataclass(slots=True)
class KeptRequest:
    """A finished beam-step request whose blocks wait for its children to copy from."""

    request_id: str  # vLLM's internal id: what the worker reports to free the blocks
    token_ids: list[int]  # the tokens its KV covers
    block_ids: tuple[list[int], ...]
    expires_at: float  # time.monotonic()
    num_children: int | None = None  # announced by its first child
    num_forked: int = 0
    held: bool = False  # a parent held for continuations: released at expires_at only
    adapter: str = ""  # the LoRA adapter its KV was computed under ("": none)


class BeamForkScheduler:
    """Scheduler side, a part of ``ContinuationConnectorScheduler``: the kept requests
    (by beam name), the children waiting for their copies, and each step's copies and
    releases for the worker (``StepOrders.fork_copies``, ``fork_release``)."""

    def __init__(self, block_size: int, stats: ContinuationStats, enabled: bool,
                 hold_s: float):
        self._block_size = block_size
        self._stats = stats
        #: Whether this engine forks at all (off: every beam step computes its tokens).
        self.enabled = enabled
        self._hold_s = hold_s
        #: Kept requests by beam name (read by ``connector.blend``: its sources).
        self.kept: dict[str, KeptRequest] = {}
        self._pending: dict[str, tuple[str, int]] = {}  # child -> (source, tokens)
        self._copies: list[tuple[int, int]] = []  # (source block, child block)
        self._release: set[str] = set()  # beam names

    @classmethod
    def from_config(cls, extra: Any, num_kv_groups: int, block_size: int,
                    stats: ContinuationStats) -> BeamForkScheduler:
        """From the connector's extra config (``beam_fork``, ``beam_fork_hold_s``); one
        KV cache group only."""
        return cls(block_size, stats,
                   enabled=bool(extra.get_from_extra_config("beam_fork", True))
                   and num_kv_groups == 1,
                   hold_s=float(extra.get_from_extra_config("beam_fork_hold_s", 10.0)))

    def match(self, request: Request, beam: dict[str, Any], num_computed: int) -> int:
        """Tokens a beam child can copy from its kept source (0: compute them)."""
        source = self.kept.get(beam["fork_from"])
        if source is None or source.adapter != adapter_of(request):
            # Its KV is another adapter's (connector.adapters): computed here instead.
            return 0
        # The last prompt token is computed here, to sample from it.
        num_tokens = min(len(source.token_ids), request.num_prompt_tokens - 1)
        if num_tokens <= num_computed or (
            request.prompt_token_ids[:num_tokens] != source.token_ids[:num_tokens]
        ):
            return 0
        self._pending[request.request_id] = (beam["fork_from"], num_tokens)
        return num_tokens - num_computed

    def scheduled(self, request: Request, beam: dict[str, Any], blocks: Any,
                  num_external_tokens: int) -> None:
        """A child got its blocks: queue the copies, count it against its source."""
        pending = self._pending.pop(request.request_id, None)
        source = self.kept.get(beam["fork_from"])
        if source is None:
            return
        if pending is not None and num_external_tokens > 0:
            num_tokens = pending[1]
            first = (num_tokens - num_external_tokens) // self._block_size
            last = -(-num_tokens // self._block_size)
            child_blocks = blocks.get_block_ids()[0]
            self._copies.extend(
                zip(source.block_ids[0][first:last], child_blocks[first:last])
            )
            if not is_made_slot(request.request_id):
                # vLLM's front end counts external tokens of the requests it knows: a
                # slot made in the engine is not one of them (``EngineCounters``
                # subtracts these from its external tokens).
                self._stats.record_fork_tokens(num_external_tokens)
        if source.held:
            return
        if source.num_children is None:
            source.num_children = max(int(beam.get("fork_children") or 1), 1)
        source.num_forked += 1
        if source.num_forked >= source.num_children:
            self._release.add(beam["fork_from"])

    def forget(self, request_id: str) -> None:
        """A request finished: a copy it was matched for and never scheduled is dropped."""
        self._pending.pop(request_id, None)

    def keep(self, request: Request, beam: dict[str, Any], block_ids: Any) -> bool:
        """Keep a finished beam step's blocks for its children; True if kept."""
        from vllm.v1.request import RequestStatus

        if not (
            self.enabled
            and beam.get("keep")
            and beam.get("id")
            and request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            and any(block_ids)
        ):
            return False
        hold_s = float(beam.get("hold_s") or 0.0)
        self.kept[beam["id"]] = KeptRequest(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids[: request.num_computed_tokens]),
            block_ids=tuple(list(group) for group in block_ids),
            expires_at=time.monotonic() + (hold_s or self._hold_s),
            held=hold_s > 0,
            adapter=adapter_of(request),
        )
        if hold_s > 0:
            logger.debug("Holding parent %s here for %.1fs: %d tokens in %d blocks",
                         beam["id"], hold_s, request.num_computed_tokens,
                         len(block_ids[0]))
        return True

    def release_held(self, name: str) -> bool:
        """End the hold of a parent held here now (the engine's Release); False if
        ``name`` is no parent held here."""
        kept = self.kept.get(name)
        if kept is None or not kept.held:
            return False
        self._release.add(name)
        return True

    def held_names(self) -> list[str]:
        """The names of the parents held here."""
        return [name for name, kept in self.kept.items() if kept.held]

    def take_orders(self) -> tuple[list[tuple[int, int]], list[str]]:
        """Each step: the block copies and the releases due, for the worker."""
        now = time.monotonic()
        for name, kept in self.kept.items():
            if now >= kept.expires_at and name not in self._release:
                if kept.held:
                    logger.debug("Held parent %s released: its hold ended", name)
                    self._release.add(name)
                    continue
                logger.warning(
                    "Releasing beam request %s: %d of %s children forked from it within "
                    "%.1fs", name, kept.num_forked, kept.num_children, self._hold_s
                )
                self._release.add(name)
        copies = self._copies
        release = [self.kept.pop(name).request_id for name in self._release]
        self._copies, self._release = [], set()
        return copies, release


def block_views(kv_caches: dict[str, Any], num_blocks: int) -> list[tuple[Any, int]]:
    """Each distinct KV tensor with its block dimension (the one of size ``num_blocks``),
    in layer order.

    Holds for vLLM 0.32's attention layouts (CPU and CUDA FlashAttention:
    ``[blocks, kv_heads, block_size, 2*head]``; older ones ``[2, blocks, ...]``). A layout where the
    dimension is ambiguous fails the engine's start with what to do about it.
    """
    views: list[tuple[Any, int]] = []
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in kv_caches.items():
        tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
        for t in tensors:
            key = (t.data_ptr(), tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            dims = [i for i, size in enumerate(t.shape) if size == num_blocks]
            if len(dims) != 1:
                raise RuntimeError(
                    f"beam fork: cannot tell the block dimension of KV cache {name} "
                    f"(shape {tuple(t.shape)}, {num_blocks} blocks); start the engine "
                    "with beam_fork disabled (kv_connector_extra_config beam_fork=false)"
                )
            views.append((t, dims[0]))
    return views


class BeamForkWorker:
    """Worker side, a part of ``ContinuationConnectorWorker``: the block copies and the
    releases its scheduler side orders, through views of the KV cache it owns (which the
    harness's injected faults write through too: ``connector.faults``)."""

    def __init__(self, num_blocks: int, enabled: bool):
        self._num_blocks = num_blocks
        #: Whether this engine forks (off: no copies are ever ordered).
        self.enabled = enabled
        self._kv_views: list[tuple[Any, int]] = []
        self._kernel_blocks_per_block = 1
        # Gather buffers of block copies, by (dtype, device, block shape): the largest
        # step's copies, held while the engine runs.
        self._copy_buffers: dict[tuple[Any, ...], Any] = {}
        self._released: set[str] = set()

    @classmethod
    def from_config(cls, extra: Any, num_blocks: int) -> BeamForkWorker:
        return cls(num_blocks, enabled=bool(extra.get_from_extra_config("beam_fork", True)))

    @property
    def kv_views(self) -> list[tuple[Any, int]]:
        """(tensor, block dimension) for each distinct KV cache tensor, in layer order
        (empty until :meth:`register_kv_views`)."""
        return self._kv_views

    @property
    def kernel_blocks_per_block(self) -> int:
        """The attention kernel's blocks per logical block."""
        return self._kernel_blocks_per_block

    def register_kv_views(self, kv_caches: dict[str, Any], physical_per_logical: int) -> None:
        """Once, when vLLM registers the KV caches."""
        # The attention kernel may split a logical block into several.
        self._kernel_blocks_per_block = physical_per_logical
        self._kv_views = block_views(kv_caches, self._num_blocks * physical_per_logical)

    def on_step(self, orders: StepOrders) -> None:
        """Each step, before the forward pass: the copies ordered, and the releases
        (reported by :meth:`report_releases` after it)."""
        if orders.fork_copies:
            self._copy_blocks(orders.fork_copies)
        self._released.update(orders.fork_release)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy kept requests' blocks into their children's, every layer."""
        import torch

        if not self._kv_views:
            raise RuntimeError("beam fork copies requested but this worker has no KV views")
        device = self._kv_views[0][0].device
        ratio = self._kernel_blocks_per_block
        src = torch.tensor([s * ratio + j for s, _ in copies for j in range(ratio)],
                           dtype=torch.long, device=device)
        dst = torch.tensor([d * ratio + j for _, d in copies for j in range(ratio)],
                           dtype=torch.long, device=device)
        for tensor, dim in self._kv_views:
            tensor.index_copy_(dim, dst, self._gathered(tensor, dim, src))

    def _gathered(self, tensor: Any, dim: int, index: Any) -> Any:
        """``tensor.index_select(dim, index)``, into a buffer kept for the next step where
        the block dimension leads: a fresh one each step (tens of MiB at W=512) cost
        more in page faults than the copy itself."""
        import torch

        if dim != 0:
            return tensor.index_select(dim, index)
        key = (tensor.dtype, tensor.device, tuple(tensor.shape[1:]))
        buffer = self._copy_buffers.get(key)
        if buffer is None or buffer.shape[0] < len(index):
            buffer = self._copy_buffers[key] = torch.empty(
                (len(index), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        out = buffer[:len(index)]
        torch.index_select(tensor, 0, index, out=out)
        return out

    def report_releases(self, results: Any) -> Any:
        """Released kept requests are reported as "finished sending": the scheduler frees
        their blocks."""
        if self._released:
            results.finished_sending.update(self._released)
            self._released = set()
        return results

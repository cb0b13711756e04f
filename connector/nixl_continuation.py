"""ContinuationConnector: vLLM's NIXL pull connector plus continuation semantics.

Loaded by vLLM through ``kv_connector_module_path="connector.nixl_continuation"``; it runs
inside each engine-core process (scheduler side) and each worker (worker side).

P side: a request sent with ``{"do_remote_decode": True}`` that ends by stop token, EOS or
length keeps its blocks (stock behaviour) and its returned params gain a typed
:class:`~connector.handoff.Handoff` under ``kvhandoff``: token count, token digest, lease.

D side: the stock connector claims the whole prompt as remote; a continuation prompt
(parent + suffix) would then import KV that P never computed. We import exactly
``min(remote_num_tokens, len(prompt) - 1)`` tokens. Reads are refused once the lease is
(nearly) over, and a READ that completes after the lease ended is discarded as a load
failure: the freed blocks may already hold another request's KV.

Beam fork (both sides of one engine): vLLM's prefix cache shares only full blocks,
so each beam of a beam-search step would recompute the partial last block of the
sequence it extends (up to ``block_size`` tokens per beam per step). A beam-step
request sent with ``kv_transfer_params["kvhandoff_beam"]`` = ``{"id": name, "keep":
True}`` keeps its blocks when it ends; a next-step request with ``{"fork_from": name,
"fork_children": k}`` loads the tokens its local prefix-cache hit does not cover by a
block copy from the kept request instead, so it computes one token. The kept request
is released after its ``k`` children were scheduled, when a later request lists it
under ``fork_release`` (it got no children), or after ``beam_fork_hold_s``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlPullConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import (
    NixlPullConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

from connector.faults import (
    FAULTS,
    corrupt_imported,
    fault_of,
    num_imported_with_fault,
    scribble,
)
from connector.handoff import (
    BEAM_KEY,
    DEFAULT_LEASE_SAFETY_MARGIN_S,
    FORK_TOKENS_KEY,
    KEY,
    PROTOCOL_VERSION,
    token_digest,
)
from connector.logs import use_vllm_handlers
from connector.signing import TARGET_KEY, load_secret, sign

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)
use_vllm_handlers("connector", "decode_engine")

#: A READ slower than this is logged as a warning (loopback READs take milliseconds).
SLOW_READ_S = 1.0

#: Side-channel listeners that could not start, by port (see
#: ContinuationConnectorScheduler._nixl_handshake_listener).
_listener_failures: dict[int, Exception] = {}


def kv_bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    """Bytes one logical block holds across all layers (K and V)."""
    return sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names)
        for g in kv_cache_config.kv_cache_groups
    )


def _beam_params(request: Request) -> dict[str, Any] | None:
    params = request.kv_transfer_params
    return params.get(BEAM_KEY) if params else None


class ContinuationStats(NixlKVConnectorStats):
    """NIXL's transfer stats plus the tokens beam fork copied on this engine."""

    def reset(self) -> None:
        super().reset()
        self.data[FORK_TOKENS_KEY] = []

    def is_empty(self) -> bool:
        return super().is_empty() and not self.data.get(FORK_TOKENS_KEY)

    def aggregate(self, other: Any) -> ContinuationStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self


@dataclass(slots=True)
class _KeptRequest:
    """A finished beam-step request whose blocks wait for its children to copy from."""

    request_id: str  # vLLM's internal id: what the worker reports to free the blocks
    token_ids: list[int]  # the tokens its KV covers
    block_ids: tuple[list[int], ...]
    expires_at: float  # time.monotonic()
    num_children: int | None = None  # announced by its first child
    num_forked: int = 0


@dataclass(slots=True)
class _ImportRecord:
    num_tokens: int
    num_blocks: int


class ContinuationConnectorScheduler(NixlPullConnectorScheduler):
    """Scheduler side: export a typed handoff on P, import a continuation on D."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, engine_id, kv_cache_config)
        from kvhandoff.model import model_fingerprint

        self.model_fingerprint = model_fingerprint(vllm_config.model_config.model)
        self.kv_bytes_per_block = kv_bytes_per_block(kv_cache_config)
        self._imports: dict[str, _ImportRecord] = {}
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        self._fork_enabled = bool(extra.get_from_extra_config("beam_fork", True)) and (
            len(kv_cache_config.kv_cache_groups) == 1
        )
        self._fork_hold_s = float(extra.get_from_extra_config("beam_fork_hold_s", 10.0))
        self._kept: dict[str, _KeptRequest] = {}  # by beam name
        self._fork_pending: dict[str, tuple[str, int]] = {}  # child -> (source, tokens)
        self._fork_copies: list[tuple[int, int]] = []  # (source block, child block)
        self._fork_release: set[str] = set()  # beam names
        self.stats = ContinuationStats()
        self._secret = load_secret(extra.get_from_extra_config("handoff_secret_file", None))
        # Negative controls (connector.faults): off unless the engine was started so.
        self._fault_injection = bool(extra.get_from_extra_config("fault_injection", False))
        self._import_faults: dict[str, str] = {}  # D: request id -> decode-worker fault
        self._scribble_block_ids: list[int] = []  # P: exported blocks to overwrite

    def _fault(self, request: Request) -> str | None:
        """The fault ``request`` names, if this engine injects faults."""
        name = fault_of(request.kv_transfer_params)
        if name is None:
            return None
        if not self._fault_injection:
            logger.warning("Ignoring fault %r named by %s: this engine was not started with "
                           "fault injection", name, request.request_id)
            return None
        if name not in FAULTS:
            logger.warning("Ignoring unknown fault %r named by %s", name, request.request_id)
            return None
        return name

    # ---- NIXL side channel -------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> None:
        super().set_xfer_handshake_metadata(metadata)
        failure = _listener_failures.pop(self.side_channel_port, None)
        if failure is not None:
            self._nixl_handshake_listener_t = None
            raise RuntimeError(
                f"the NIXL side channel cannot listen on {self.side_channel_host}:"
                f"{self.side_channel_port} ({failure}); start the engine with another "
                "side-channel port") from failure

    @staticmethod
    def _nixl_handshake_listener(encoded_data: dict[tuple[int, int], Any],
                                 ready_event: threading.Event, stop_event: threading.Event,
                                 host: str, port: int) -> None:
        """vLLM's listener thread, except that a failed bind ends the engine's start-up
        (:meth:`set_xfer_handshake_metadata` raises): vLLM's own thread dies without
        setting ``ready_event`` and the engine core waits for it forever."""
        try:
            NixlPullConnectorScheduler._nixl_handshake_listener(
                encoded_data, ready_event, stop_event, host, port)
        except Exception as exc:
            if ready_event.is_set():
                raise
            _listener_failures[port] = exc
            ready_event.set()

    # ---- beam fork ---------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        beam = _beam_params(request)
        if beam and self._fork_enabled:
            self._fork_release.update(n for n in beam.get("fork_release") or () if n in self._kept)
        super().on_new_request(request)

    def _fork_match(self, request: Request, beam: dict[str, Any], num_computed: int) -> int:
        """Tokens a beam child can copy from its kept source (0: compute them)."""
        source = self._kept.get(beam["fork_from"])
        if source is None:
            return 0
        # The last prompt token is computed here, to sample from it.
        num_tokens = min(len(source.token_ids), request.num_prompt_tokens - 1)
        if num_tokens <= num_computed or (
            request.prompt_token_ids[:num_tokens] != source.token_ids[:num_tokens]
        ):
            return 0
        self._fork_pending[request.request_id] = (beam["fork_from"], num_tokens)
        return num_tokens - num_computed

    def _fork_scheduled(self, request: Request, beam: dict[str, Any], blocks: Any,
                        num_external_tokens: int) -> None:
        pending = self._fork_pending.pop(request.request_id, None)
        source = self._kept.get(beam["fork_from"])
        if source is None:
            return
        if pending is not None and num_external_tokens > 0:
            num_tokens = pending[1]
            first = (num_tokens - num_external_tokens) // self.block_size
            last = -(-num_tokens // self.block_size)
            child_blocks = blocks.get_block_ids()[0]
            self._fork_copies.extend(
                zip(source.block_ids[0][first:last], child_blocks[first:last])
            )
            self.stats.data[FORK_TOKENS_KEY].append(num_external_tokens)
        if source.num_children is None:
            source.num_children = max(int(beam.get("fork_children") or 1), 1)
        source.num_forked += 1
        if source.num_forked >= source.num_children:
            self._fork_release.add(beam["fork_from"])

    def _keep(self, request: Request, beam: dict[str, Any], block_ids: Any) -> bool:
        from vllm.v1.request import RequestStatus

        if not (
            self._fork_enabled
            and beam.get("keep")
            and beam.get("id")
            and request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            and any(block_ids)
        ):
            return False
        self._kept[beam["id"]] = _KeptRequest(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids[: request.num_computed_tokens]),
            block_ids=tuple(list(group) for group in block_ids),
            expires_at=time.monotonic() + self._fork_hold_s,
        )
        return True

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        now = time.monotonic()
        for name, kept in self._kept.items():
            if now >= kept.expires_at and name not in self._fork_release:
                logger.warning(
                    "Releasing beam request %s: %d of %s children forked from it within "
                    "%.1fs", name, kept.num_forked, kept.num_children, self._fork_hold_s
                )
                self._fork_release.add(name)
        meta.kvhandoff_faults = {r: f for r, f in self._import_faults.items()
                                 if r in meta.reqs_to_recv}
        for req_id in meta.kvhandoff_faults:
            del self._import_faults[req_id]
        meta.kvhandoff_scribble = self._scribble_block_ids
        self._scribble_block_ids = []
        meta.kvhandoff_fork_copies = self._fork_copies
        meta.kvhandoff_fork_release = [
            self._kept.pop(name).request_id for name in self._fork_release
        ]
        self._fork_copies, self._fork_release = [], set()
        return meta

    # ---- D side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        beam = _beam_params(request)
        if beam and beam.get("fork_from") and self._fork_enabled:
            return self._fork_match(request, beam, num_computed_tokens), False
        if not (params and params.get("do_remote_prefill")):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        # The last prompt token must be computed here to sample from it, and the
        # suffix was never computed on P.
        num_importable = min(
            params.get("remote_num_tokens") or 0, request.num_prompt_tokens - 1
        )
        fault = self._fault(request)
        if fault is not None:
            num_importable = num_imported_with_fault(
                fault, num_importable, request.num_prompt_tokens, self.block_size)
        count = num_importable - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ):
        params = request.kv_transfer_params
        beam = _beam_params(request)
        if beam and beam.get("fork_from") and self._fork_enabled:
            self._fork_scheduled(request, beam, blocks, num_external_tokens)
        if params and params.get("do_remote_prefill") and num_external_tokens > 0:
            local_block_ids = blocks.get_unhashed_block_ids_all_groups()
            self._imports[request.request_id] = _ImportRecord(
                num_tokens=num_external_tokens,
                num_blocks=len(local_block_ids[0]) if local_block_ids else 0,
            )
            fault = self._fault(request)
            if fault is not None and FAULTS[fault].side == "decode_worker":
                self._import_faults[request.request_id] = fault
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    # ---- both sides --------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        record = self._imports.pop(request.request_id, None)
        delay_free, params = super().request_finished(request, block_ids)
        if record is not None:
            # D side: report what this request imported (the client sees it on the
            # final RequestOutput.kv_transfer_params).
            params = dict(params or {})
            params[KEY] = {
                "num_imported_tokens": record.num_tokens,
                "num_imported_blocks": record.num_blocks,
                "num_imported_bytes": record.num_blocks * self.kv_bytes_per_block,
                # D admitted the import only without beam fork (its pool is short).
                "beam_fork_disabled": bool((_beam_params(request) or {}).get("fork_disabled")),
            }
        elif delay_free and params is not None and params.get("do_remote_prefill"):
            self._attach_handoff(request, params)
        self._fork_pending.pop(request.request_id, None)
        beam = _beam_params(request)
        if beam and not delay_free and self._keep(request, beam, block_ids):
            return True, params
        return delay_free, params

    def _attach_handoff(self, request: Request, params: dict[str, Any]) -> None:
        """P side: describe the held blocks as a typed, versioned handoff."""
        num_parent_tokens = request.num_tokens
        assert request.num_computed_tokens == num_parent_tokens - 1, (
            f"P exported {request.num_computed_tokens} computed tokens for a "
            f"{num_parent_tokens}-token parent: the lease would cover the wrong KV"
        )
        now = time.time()
        # Stock NIXL stamps the deadline in this process's perf_counter; D's worker
        # rebases it with the clock offset measured at the handshake.
        params["remote_blocks_expiry_time"] = self._reqs_need_send[request.request_id]
        params[KEY] = {
            "protocol_version": PROTOCOL_VERSION,
            "model_fingerprint": self.model_fingerprint,
            "engine_id": self.engine_id,
            "request_id": request.request_id,
            "num_parent_tokens": num_parent_tokens,
            "num_computed_tokens": request.num_computed_tokens,
            "token_digest": token_digest(request.all_token_ids),
            "block_size": self.block_size,
            "num_blocks": len(params["remote_block_ids"][0]),
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "exported_at": now,
            "lease_expires_at": now + self._kv_lease_duration,
            "target_engine_id": str((request.kv_transfer_params or {}).get(TARGET_KEY) or ""),
        }
        if self._secret is not None:
            params[KEY]["signature"] = sign(params, self._secret)
        if self._fault(request) == "stale":
            self._scribble_block_ids.extend(params["remote_block_ids"][0])
        logger.debug(
            "Exported %s: %d parent tokens, %d blocks, lease %ds",
            request.request_id,
            num_parent_tokens,
            len(params["remote_block_ids"][0]),
            self._kv_lease_duration,
        )


def _agent_config_with_delay(bind: Any, delay_us: int) -> type:
    """A ``nixlAgentConfig`` whose progress-thread delay is ``delay_us``.

    The Python API pins ``pthrDelay`` to 0 (a thread that busy-spins a core); the C++
    agent sleeps ``pthrDelay`` microseconds between progress sweeps when it is set.
    """
    base = bind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (the binding's name)
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            base.pthrDelay.__set__(self, delay_us)

    return _Config


@contextlib.contextmanager
def _nixl_agent_options(*, progress_thread: bool, progress_delay_us: int):
    """Create the stock worker's NIXL agent with our progress settings.

    vLLM 0.32 builds its agent with the library defaults: a progress thread that
    busy-spins a whole core. Without any progress thread, P answers a READ only
    while its worker happens to call into NIXL, and with P and D as separate
    servers on 2 cores those calls were seen to stall for seconds. A progress
    thread that sleeps ``progress_delay_us`` between sweeps keeps both: transfers
    progress on their own and an idle engine costs a few percent of a core.
    """
    original = base_worker.nixl_agent_config
    api = sys.modules.get(getattr(base_worker.NixlWrapper, "__module__", ""), None)
    bind = getattr(api, "nixlBind", None)
    if original is None:
        yield
        return
    saved_config = bind.nixlAgentConfig if bind is not None else None
    base_worker.nixl_agent_config = functools.partial(
        original, enable_prog_thread=progress_thread
    )
    if progress_thread and progress_delay_us > 0:
        if bind is None:
            logger.warning("NIXL bindings not found: its progress thread will busy-spin")
        else:
            bind.nixlAgentConfig = _agent_config_with_delay(bind, progress_delay_us)
    try:
        yield
    finally:
        base_worker.nixl_agent_config = original
        if bind is not None:
            bind.nixlAgentConfig = saved_config


def _block_views(kv_caches: dict[str, Any], num_blocks: int) -> list[tuple[Any, int]]:
    """Each distinct KV tensor with its block dimension (the one of size ``num_blocks``).

    Holds for vLLM's attention layouts (CPU: ``[blocks, heads, block_size, 2*head]``,
    FlashAttention: ``[2, blocks, block_size, heads, head]``, ...). A layout where the
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


class ContinuationConnectorWorker(NixlPullConnectorWorker):
    """Worker side: stock READs, fenced by the lease."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ):
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        with _nixl_agent_options(
            progress_thread=bool(extra.get_from_extra_config("nixl_progress_thread", True)),
            progress_delay_us=int(
                extra.get_from_extra_config("nixl_progress_delay_us", 500)
            ),
        ):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        self._lease_margin_s = float(
            extra.get_from_extra_config(
                "lease_safety_margin_s", DEFAULT_LEASE_SAFETY_MARGIN_S
            )
        )
        # req_id -> (local perf_counter time by which the READ must have completed,
        # when it was issued).
        self._read_deadlines: dict[str, tuple[float, float]] = {}
        # Same stats as NIXL's, with keys that aggregate with the scheduler side's.
        self.xfer_stats = ContinuationStats()
        self._num_blocks = kv_cache_config.num_blocks
        self._fork_enabled = bool(extra.get_from_extra_config("beam_fork", True))
        # (tensor, block dimension) for each distinct KV cache tensor.
        self._fork_views: list[tuple[Any, int]] = []
        self._fork_ratio = 1
        self._fork_released: set[str] = set()
        self._fault_injection = bool(extra.get_from_extra_config("fault_injection", False))
        self._import_faults: dict[str, str] = {}  # request id -> fault, until its READ is done

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if self._fork_enabled or self._fault_injection:
            # The attention kernel may split a logical block into several.
            self._fork_ratio = int(getattr(self, "_physical_blocks_per_logical_kv_block", 1))
            self._fork_views = _block_views(kv_caches, self._num_blocks * self._fork_ratio)

    def start_load_kv(self, metadata: Any) -> None:
        copies = getattr(metadata, "kvhandoff_fork_copies", None)
        if copies:
            self._copy_blocks(copies)
        if self._fault_injection:
            self._import_faults.update(getattr(metadata, "kvhandoff_faults", None) or {})
            stale = getattr(metadata, "kvhandoff_scribble", None)
            if stale:
                logger.warning("Injected fault 'stale': overwriting %d exported blocks",
                               len(stale))
                scribble(self._fork_views, stale, self._fork_ratio)
        self._fork_released.update(getattr(metadata, "kvhandoff_fork_release", None) or ())
        super().start_load_kv(metadata)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Beam fork: copy kept requests' blocks into their children's, every layer."""
        import torch

        if not self._fork_views:
            raise RuntimeError("beam fork copies requested but this worker has no KV views")
        device = self._fork_views[0][0].device
        ratio = self._fork_ratio
        src = torch.tensor([s * ratio + j for s, _ in copies for j in range(ratio)],
                           dtype=torch.long, device=device)
        dst = torch.tensor([d * ratio + j for _, d in copies for j in range(ratio)],
                           dtype=torch.long, device=device)
        for tensor, dim in self._fork_views:
            tensor.index_copy_(dim, dst, tensor.index_select(dim, src))

    def get_transfer_results(self) -> Any:
        results = super().get_transfer_results()
        if self._fork_released:
            # Reported as "finished sending": the scheduler frees the kept blocks.
            results.finished_sending.update(self._fork_released)
            self._fork_released = set()
        return results

    def _inject_import_faults(self, done: set[str]) -> None:
        for req_id in done:
            fault = self._import_faults.pop(req_id, None)
            meta = self._recving_metadata.get(req_id)
            if fault is None or meta is None:
                continue
            logger.warning("Injected fault %r into %s's imported blocks", fault, req_id)
            corrupt_imported(fault, self._fork_views, list(meta.local_block_ids[0]),
                             self._fork_ratio)

    def _local_deadline(self, meta: Any) -> float | None:
        remote = meta.remote
        offset = self._engine_clock_offset.get(remote.engine_id)
        if remote.blocks_expiry_time is None or offset is None:
            return None
        return remote.blocks_expiry_time - offset

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        assert meta.remote is not None
        deadline = None
        if meta.remote.engine_id in self._remote_agents:
            deadline = self._local_deadline(meta)
        if deadline is not None and any(meta.local_block_ids):
            remaining = deadline - time.perf_counter()
            if remaining < self._lease_margin_s:
                logger.warning(
                    "Refusing READ for %s: P's lease on its blocks ends in %.2fs "
                    "(margin %.2fs); its blocks may be reused",
                    req_id,
                    remaining,
                    self._lease_margin_s,
                )
                self.xfer_stats.record_kv_expired_req()
                self._handle_failed_transfer(
                    req_id, None, self._recv_failures, record_failed_transfer=False
                )
                return
            self._read_deadlines[req_id] = (deadline, time.perf_counter())
            logger.debug("READ for %s: %d blocks, P's lease ends in %.2fs", req_id,
                         len(meta.local_block_ids[0]), remaining)
        posted_at = time.perf_counter()
        super()._read_blocks_for_req(req_id, meta)
        posting = time.perf_counter() - posted_at
        if posting >= SLOW_READ_S:
            # The worker (and so the engine's step) was blocked in NIXL for that long.
            logger.warning("Posting the READ for %s took %.2fs (NIXL's transfer() blocked "
                           "this worker)", req_id, posting)

    def _pop_done_transfers(
        self, transfers: dict[str, list[int]]
    ) -> tuple[set[str], set[str]]:
        done, failed = super()._pop_done_transfers(transfers)
        if self._import_faults:
            self._inject_import_faults(done - failed)
        now = time.perf_counter()
        for req_id in done:
            fence = self._read_deadlines.pop(req_id, None)
            if fence is None:
                continue
            deadline, issued_at = fence
            took = now - issued_at
            if took >= SLOW_READ_S:
                logger.warning("READ for %s took %.2fs (P's lease ended %.2fs after it was "
                               "issued)", req_id, took, deadline - issued_at)
            else:
                logger.debug("READ for %s done in %.3fs", req_id, took)
            if now >= deadline and req_id not in failed:
                # P may have freed and reused the blocks while we read them.
                logger.error(
                    "Discarding READ for %s: it completed %.3fs after P's lease ended "
                    "(issued %.3fs before the lease end, took %.3fs)",
                    req_id,
                    now - deadline,
                    deadline - issued_at,
                    now - issued_at,
                )
                self.xfer_stats.record_kv_expired_req()
                failed.add(req_id)
        return done, failed


def bound_shm_reader_waits(recheck_ms: int) -> None:
    """Cap how long this process's readers of vLLM's shared-memory queues sleep.

    vLLM's engine core and its worker hand every step over a shared-memory ring and
    wake the reader with a ZMQ ping that is best effort: PUB ``SNDHWM=1`` drops it
    silently when ZMQ's I/O thread lags, and a reader whose ping was dropped sleeps
    until its recheck, 5 s in vLLM 0.32 (vllm-project/vllm#45224). On a busy 2-core
    host this was measured under load: D's engine core idle for 5-6 s with imports
    waiting. ``recheck_ms`` bounds each such stall; an idle reader wakes that often.
    0 keeps vLLM's own value.
    """
    if recheck_ms <= 0:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    if shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS > recheck_ms:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms


class ContinuationConnector(NixlPullConnector):
    """The connector class vLLM instantiates (see module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ):
        # Skip NixlPullConnector.__init__ (it builds the stock halves), keep the base.
        super(NixlPullConnector, self).__init__(vllm_config, role, kv_cache_config)
        # Built in the engine core (scheduler role) and in each worker: both read.
        extra = vllm_config.kv_transfer_config
        assert extra is not None
        bound_shm_reader_waits(int(extra.get_from_extra_config("shm_reader_recheck_ms", 20)))
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = ContinuationConnectorScheduler(
                vllm_config, self.engine_id, kv_cache_config
            )
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ContinuationConnectorWorker(
                vllm_config, self.engine_id, kv_cache_config
            )

    def get_kv_connector_stats(self) -> ContinuationStats | None:
        scheduler = self.connector_scheduler
        if isinstance(scheduler, ContinuationConnectorScheduler):
            stats = scheduler.stats
            return None if stats.is_empty() else stats.clone_and_reset()
        return super().get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> ContinuationStats:
        return ContinuationStats(data=data) if data is not None else ContinuationStats()

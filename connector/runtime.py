"""Runtime adjustments to vLLM 0.32 and NIXL, each working around an upstream behaviour
stated where it is made. Applied in the engine processes the connector is loaded in.

- the NIXL side channel: vLLM's listener thread dies silently on a failed bind and the
  engine core waits for it forever (``connector.liveness.side_channel_listener``);
- NIXL's progress thread busy-spins a core (:func:`nixl_agent_options`);
- vLLM's shared-memory step queue can sleep 5 s on a lost wake-up ping, and its
  readers spin for 1 s after every message (:func:`bound_shm_reader_waits`);
- on CPU hosts the KV pool sits on 4 KiB pages, which halves what a NIXL READ moves
  per second (:func:`back_with_huge_pages`);
- UCX's log file (its protocol tables, read by ``tools.ucx_report``) is a buffered
  stream a worker process never flushes (:func:`kvhandoff.ucxlog.flush_ucx_log`, here for
  the worker).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import sys
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

logger = logging.getLogger(__name__)

#: Side-channel listeners that could not start, by port (``connector.liveness``).
listener_failures: dict[int, Exception] = {}


_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1+
_HUGE_PAGE = 2 << 20


def back_with_huge_pages(tensors: list[Any]) -> int:
    """Back the host memory of ``tensors`` (the KV pool) with 2 MiB pages; returns the
    bytes now on huge pages.

    vLLM allocates the CPU KV pool with ``torch.zeros``, which touches every page as
    4 KiB: the host's transparent huge pages are ``madvise``-only here and torch does not
    ask. UCX's ``cma`` READs (``process_vm_readv``) walk pages on both sides, and on 4 KiB
    pages they move about half of what they move on 2 MiB pages (docs/decisions.md,
    "Huge pages for the KV pool"). ``MADV_HUGEPAGE`` then ``MADV_COLLAPSE`` rebuilds the
    already-touched range in place; a kernel without ``MADV_COLLAPSE`` (before 6.1)
    gets the advice only (khugepaged collapses it later) and a warning.
    """
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    spans = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                    for t in tensors if t.device.type == "cpu"})
    collapsed = 0
    for addr, nbytes in spans:
        start = -(-addr // _HUGE_PAGE) * _HUGE_PAGE
        end = (addr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end <= start:
            continue
        length = ctypes.c_size_t(end - start)
        if libc.madvise(ctypes.c_void_p(start), length, _MADV_HUGEPAGE) != 0:
            logger.warning("KV pool stays on 4 KiB pages: madvise(MADV_HUGEPAGE) failed "
                           "(errno %d)", ctypes.get_errno())
            continue
        if libc.madvise(ctypes.c_void_p(start), length, _MADV_COLLAPSE) != 0:
            logger.warning("KV pool advised to huge pages but not collapsed now "
                           "(madvise(MADV_COLLAPSE) errno %d; needs Linux 6.1+)",
                           ctypes.get_errno())
            continue
        collapsed += end - start
    return collapsed


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
def nixl_agent_options(*, progress_thread: bool, progress_delay_us: int):
    """Create the stock worker's NIXL agent with our progress settings.

    vLLM 0.32 builds its agent with the library defaults: a progress thread that
    busy-spins a whole core. Without any progress thread, P answers a READ only
    while its worker happens to call into NIXL. A progress thread that sleeps
    ``progress_delay_us`` between sweeps keeps both: transfers progress on their own
    and an idle engine costs a few percent of a core (docs/decisions.md, "NIXL
    progress thread").
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


def bound_shm_reader_waits(recheck_ms: int, busy_loop_ms: float | None = None) -> None:
    """Cap how long this process's readers of vLLM's shared-memory queues sleep.

    vLLM's engine core and its worker hand every step over a shared-memory ring and
    wake the reader with a ZMQ ping that is best effort: PUB ``SNDHWM=1`` drops it
    silently when ZMQ's I/O thread lags, and a reader whose ping was dropped sleeps
    until its recheck, 5 s in vLLM 0.32 (vllm-project/vllm#45224; docs/decisions.md,
    "Shared-memory recheck"). ``recheck_ms`` bounds each such stall; an idle reader
    wakes that often. 0 keeps vLLM's own value.

    A reader also spins (``sched_yield``) for 1 s after each message before it sleeps
    on the ping. An engine stepping every few milliseconds, as vLLM steps one whose
    finished requests still hold exported blocks, keeps its engine core and its worker
    spinning for as long as that lasts: a whole core of a small host. ``busy_loop_ms``
    caps the spin (None keeps vLLM's 1 s); past it the reader sleeps until the ping or
    the recheck.
    """
    from vllm.distributed.device_communicators import shm_broadcast

    if 0 < recheck_ms < shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS:
        shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = recheck_ms
    if busy_loop_ms is None:
        return
    cond = shm_broadcast.SpinCondition
    original = getattr(cond.wait, "__wrapped__", cond.wait)
    cap_s = busy_loop_ms / 1e3

    @functools.wraps(original)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > cap_s:
            self.busy_loop_s = cap_s
        original(self, timeout_ms)

    cond.wait = wait




class IdlePacer:
    """Pauses an engine whose steps have computed nothing for ``after_s``.

    vLLM keeps stepping (1 ms apart) while any finished request still holds blocks
    through the connector: P holding an export until D reads it or the lease ends, a
    kept beam step. Each empty step is a round trip to the worker, which polls NIXL:
    ~130% of a core on P for as long as the export waits, taken from D on a small
    host. After ``after_s`` of empty steps each further one first sleeps ``pause_s``
    (``idle_after_ms``, ``idle_pause_ms``): the worker still polls READ-done
    notifications and leases every ~10 ms, a new request waits at most that long to be
    scheduled, and beam steps (whose next step arrives within milliseconds) never reach
    the pause. A busy step (it computes tokens or posts READs), or the first after the
    engine slept on its empty queue (a new request arrived), starts a new streak: an
    import's READ step is never paused."""

    def __init__(self, after_s: float, pause_s: float):
        self._after_s, self._pause_s = after_s, pause_s
        self._last_step_at = 0.0
        self._idle_since: float | None = None

    def pace(self, busy: bool) -> None:
        """Called once per scheduler step, before it is handed to the worker."""
        if self._pause_s <= 0:
            return
        now = time.perf_counter()
        last, self._last_step_at = self._last_step_at, now
        if busy or now - last > self._after_s:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self._after_s:
            time.sleep(self._pause_s)

"""Whether P still held an export's blocks when D's READ of them completed (vllm#52234).

A READ is one-sided: P is not asked, and a handoff says only where the blocks were when
it was made. If P released them before D read (the parent given back, a replayed or
duplicated handoff, a router that lost track) and reused them, D would import another
request's KV and answer 200 with wrong tokens, inside the lease the handoff names; and a
handoff that names other blocks of P (a buggy P signs whatever it sends) would do the
same. So D's READ counts only once P confirms, after it completed, that the export is
still live and that its blocks are the ones D read:

- P (:class:`LiveExports`, on its scheduler side): an export, with its block ids, is
  live from the step that makes its handoff until the step that frees its blocks; it
  leaves the set in
  ``update_connector_output``, which vLLM's scheduler calls before it frees the blocks
  of the exports that finished sending. Freed blocks are reused only by a later
  schedule, and overwritten only by that step's forward. So "live when asked, after the
  READ completed" means the READ saw the export's KV.
- The question travels on NIXL's side channel (:func:`side_channel_listener`: vLLM's
  listener loop, which also answers :data:`LIVE_MSG` with one bool per export asked), the
  socket every D already reaches for its handshake with P.
- D (:class:`LiveChecks`, in its worker): a READ that completes is held back from the
  scheduler until P answers; "live" reports it done, anything else (not live, P gone,
  no answer in :data:`CHECK_TIMEOUT_S`) reports it failed: the request ends
  ``import_failed`` and the router recomputes it, flagged. One round trip on the side
  channel per import (about a millisecond on loopback).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import zmq_ctx
from vllm.utils.network_utils import make_zmq_path

logger = logging.getLogger(__name__)

#: The side channel's question: ``(LIVE_MSG, [[P's request id, block ids by group],
#: ...])`` -> ``[bool, ...]``: each export held by P with exactly those blocks.
LIVE_MSG = "kvhandoff_live"
#: D waits this long for P's answer; no answer fails the import.
CHECK_TIMEOUT_S = 5.0
#: And this much more for an answer already on its way at the deadline: a D process
#: stopped past the deadline (SIGSTOP, a long pause of its host) wakes with P's reply in
#: its socket but its I/O thread not yet run, and zmq's recv reports the deadline first.
LATE_REPLY_S = 0.5


Blocks = list[list[int]]


class LiveExports:
    """P: the exports whose blocks P holds, by request id, with their block ids by KV
    cache group. Written by the scheduler's thread, read by the side channel's (dict
    operations under the GIL)."""

    def __init__(self) -> None:
        self._blocks: dict[str, Blocks] = {}

    def add(self, request_id: str, block_ids: Iterable[Iterable[int]]) -> None:
        """Its handoff is made: D may read its blocks."""
        self._blocks[request_id] = [list(group) for group in block_ids]

    def end(self, request_ids: Iterable[str]) -> None:
        """Its blocks are freed in this step (call before vLLM frees them)."""
        for request_id in request_ids:
            self._blocks.pop(request_id, None)

    def are_live(self, asked: list[tuple[str, Blocks]]) -> list[bool]:
        """For each (request id, block ids): held, with exactly those blocks."""
        return [self._blocks.get(r) == blocks for r, blocks in asked]


def side_channel_listener(live: LiveExports,
                          failures: dict[int, Exception]) -> Callable[..., None]:
    """The side channel's thread target, with vLLM's listener's arguments: vLLM's loop
    (``_nixl_handshake_listener``: NIXL metadata and P's clock for a handshake) that also
    answers :data:`LIVE_MSG` from ``live``. A failed bind is recorded in ``failures``
    (by port) and ``ready_event`` set, so the engine's start fails with the reason
    (vLLM's thread would die without setting it, and the engine core wait forever)."""

    def listen(encoded_data: dict[tuple[int, int], Any], ready_event: threading.Event,
               stop_event: threading.Event, host: str, port: int) -> None:
        try:
            _serve(encoded_data, ready_event, stop_event, host, port, live)
        except Exception as exc:
            if ready_event.is_set():
                raise
            failures[port] = exc
            ready_event.set()

    return listen


def _serve(encoded_data: dict[tuple[int, int], Any], ready_event: threading.Event,
           stop_event: threading.Event, host: str, port: int, live: LiveExports) -> None:
    with zmq_ctx(zmq.ROUTER, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        ready_event.set()
        while True:
            try:
                identity, _, raw = sock.recv_multipart()
            except zmq.Again:
                if stop_event.is_set():
                    break
                continue
            try:
                msg = msgspec.msgpack.decode(raw)
                if msg[0] == LIVE_MSG:
                    asked = [(str(r), [[int(b) for b in g] for g in blocks])
                             for r, blocks in msg[1]]
                    sock.send_multipart((identity, b"", msgspec.msgpack.encode(
                        live.are_live(asked))))
                    continue
                kind, pp_rank, tp_rank = msg
                if kind != GET_META_MSG:
                    logger.warning("Side channel: unexpected message %r", kind)
                # P's perf_counter: D estimates the clock offset from it (vLLM's rule:
                # this runs in the process that stamps the lease deadlines).
                ts = msgspec.msgpack.encode(time.perf_counter())
                sock.send_multipart((identity, b"", encoded_data[(pp_rank, tp_rank)], ts))
            except Exception as e:  # a malformed message costs its sender an empty reply
                logger.warning("Side channel: refused a malformed message (%s)", e)
                sock.send_multipart((identity, b"", b""))


def ask_live(host: str, port: int, asked: list[tuple[str, Blocks]],
             timeout_s: float = CHECK_TIMEOUT_S) -> list[bool]:
    """P's answer over its side channel: whether each (request id, block ids) is an
    export P holds with those blocks. Raises on no answer within ``timeout_s`` and
    :data:`LATE_REPLY_S` more (``zmq.Again``) or a reply that is not one bool per export
    asked."""
    with zmq_ctx(zmq.REQ, make_zmq_path("tcp", host, port)) as sock:
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, 0)
        sock.send(msgspec.msgpack.encode((LIVE_MSG, asked)))
        try:
            raw = sock.recv()
        except zmq.Again:
            if not sock.poll(int(LATE_REPLY_S * 1000)):
                raise
            raw = sock.recv(zmq.NOBLOCK)
        reply = msgspec.msgpack.decode(raw)
    if not isinstance(reply, list) or len(reply) != len(asked):
        raise ValueError(f"P answered {reply!r}")
    return [bool(r) for r in reply]


class LiveChecks:
    """D: READs that completed, held back until their P confirms the export is live."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvhandoff-live")
        self._pending: dict[str, tuple[Future, str]] = {}

    def ask(self, request_id: str, host: str, port: int, p_request_id: str,
            block_ids: Blocks) -> None:
        """``request_id``'s READ from P (``host``:``port``, its side channel) of export
        ``p_request_id``, which its handoff said holds ``block_ids``, completed: ask P in
        the background."""
        self._pending[request_id] = (
            self._pool.submit(ask_live, host, port, [(p_request_id, block_ids)]),
            p_request_id)

    def settle(self) -> tuple[set[str], dict[str, str]]:
        """The answers in so far: (confirmed live, refused with the reason)."""
        confirmed: set[str] = set()
        refused: dict[str, str] = {}
        for request_id, (future, p_request_id) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[request_id]
            try:
                live = future.result()[0]
            except Exception as e:
                refused[request_id] = (f"P did not confirm that export {p_request_id} was "
                                       f"still held ({type(e).__name__}: {e})")
                continue
            if live:
                confirmed.add(request_id)
            else:
                refused[request_id] = (f"P did not hold export {p_request_id} with the "
                                       "blocks its handoff names when the READ completed "
                                       "(released, expired, never made, or other blocks): "
                                       "they may hold another request's KV")
        return confirmed, refused

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

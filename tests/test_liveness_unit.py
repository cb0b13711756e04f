"""P's side channel answers whether exports are live (``connector.liveness``), beside
vLLM's handshake; a malformed message costs its sender an empty reply and the listener
keeps serving; D's checks report confirmed, not live, and no answer apart."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from connector.liveness import LiveChecks, LiveExports, ask_live, side_channel_listener
from kvhandoff.ports import free_port


@pytest.fixture
def side_channel():
    live = LiveExports()
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    failures: dict[int, Exception] = {}
    thread = threading.Thread(target=side_channel_listener(live, failures), daemon=True,
                              args=({(0, 0): b"meta"}, ready, stop, "127.0.0.1", port))
    thread.start()
    ready.wait()
    yield live, port
    stop.set()
    thread.join(5)


def test_live_until_ended_and_only_with_its_own_blocks(side_channel):
    live, port = side_channel
    live.add("a", [[1, 2, 3]])
    live.add("b", ((4, 5),))
    assert ask_live("127.0.0.1", port, [("a", [[1, 2, 3]]), ("b", [[4, 5]]),
                                        ("c", [[1]])]) == [True, True, False]
    # Another export's blocks, one block more or less, under a live request id: no.
    assert ask_live("127.0.0.1", port, [("a", [[4, 5]]), ("a", [[1, 2]]),
                                        ("b", [[4, 5, 6]])]) == [False, False, False]
    live.end(["a"])
    assert ask_live("127.0.0.1", port, [("a", [[1, 2, 3]]), ("b", [[4, 5]])]) == [
        False, True]


def test_vllms_handshake_is_still_served_and_a_malformed_message_is_survived(side_channel):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import GET_META_MSG

    live, port = side_channel
    ctx = zmq.Context.instance()
    for raw in (b"\xff\x00garbage", msgspec.msgpack.encode(["kvhandoff_live"]),
                msgspec.msgpack.encode((GET_META_MSG, 5, 5))):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(raw)
        assert sock.recv_multipart() == [b""]
        sock.close(linger=0)
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    meta, ts = sock.recv_multipart()
    sock.close(linger=0)
    assert meta == b"meta" and isinstance(msgspec.msgpack.decode(ts), float)
    live.add("x", [[7]])
    assert ask_live("127.0.0.1", port, [("x", [[7]])]) == [True]


def test_a_bind_that_fails_is_reported_not_hung():
    port = free_port()
    blocker = zmq.Context.instance().socket(zmq.ROUTER)
    blocker.bind(f"tcp://127.0.0.1:{port}")
    ready, stop = threading.Event(), threading.Event()
    failures: dict[int, Exception] = {}
    side_channel_listener(LiveExports(), failures)({}, ready, stop, "127.0.0.1", port)
    blocker.close(linger=0)
    assert ready.is_set() and port in failures


def test_d_tells_confirmed_not_live_and_no_answer_apart(side_channel):
    live, port = side_channel
    live.add("held", [[3, 4]])
    checks = LiveChecks()
    checks.ask("d-1", "127.0.0.1", port, "held", [[3, 4]])
    checks.ask("d-2", "127.0.0.1", port, "released", [[3, 4]])
    checks.ask("d-3", "127.0.0.1", free_port(), "held", [[3, 4]])  # nobody answers there
    confirmed: set[str] = set()
    refused: dict[str, str] = {}
    deadline = time.monotonic() + 15
    while len(confirmed) + len(refused) < 3 and time.monotonic() < deadline:
        c, r = checks.settle()
        confirmed |= c
        refused.update(r)
        time.sleep(0.05)
    checks.shutdown()
    assert confirmed == {"d-1"}
    assert "did not hold export released" in refused["d-2"]
    assert "did not confirm" in refused["d-3"]


@pytest.mark.parametrize("late_s,answered", [(0.2, True), (1.2, False)])
def test_an_answer_on_its_way_at_the_deadline_is_taken(late_s, answered):
    """P answers ``late_s`` after D's deadline (what a D stopped past its deadline finds
    on waking: the reply there, its zmq I/O thread not yet run): taken within
    ``LATE_REPLY_S`` (0.5 s), else no answer (``zmq.Again``), as before."""
    from connector.liveness import LATE_REPLY_S, LIVE_MSG

    assert LATE_REPLY_S == 0.5
    port, timeout_s = free_port(), 0.3
    ctx = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.bind(f"tcp://127.0.0.1:{port}")

    def answer_late() -> None:
        identity, _, raw = server.recv_multipart()
        assert msgspec.msgpack.decode(raw)[0] == LIVE_MSG
        time.sleep(timeout_s + late_s)
        server.send_multipart((identity, b"", msgspec.msgpack.encode([True])))

    thread = threading.Thread(target=answer_late, daemon=True)
    thread.start()
    try:
        if answered:
            assert ask_live("127.0.0.1", port, [("a", [[1]])], timeout_s=timeout_s) == [True]
        else:
            with pytest.raises(zmq.Again):
                ask_live("127.0.0.1", port, [("a", [[1]])], timeout_s=timeout_s)
    finally:
        thread.join(5)
        server.close(linger=0)

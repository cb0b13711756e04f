"""KV events with a key (``--kv-events-key``): vLLM's own publisher as an engine core runs
it, our relay in front of it as the engine server runs it (``engine.kv_events``: CURVE
PUB and replay ROUTER), and the router's feed (``router.cache_feed``). The feed holding
the key follows the engine through the live stream and a replay; a reader without the
key, or with another, gets nothing of either (the controls)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.kv_events import EventEndpoints, EventRelay
from kvhandoff.event_keys import EventKeys
from router.cache_feed import EventFeed
from router.cache_index import BlockIndex, prefix_keys
from tests.test_cache_index import B, Engine, _stored, _until

pytestmark = [pytest.mark.fleet, pytest.mark.security]


def _keys(tmp_path, name: str, secret: str) -> EventKeys:
    path = tmp_path / name
    path.write_text(secret)
    return EventKeys.from_file(path)


def _heard(endpoint: str, keys: EventKeys | None, wait_s: float = 2.0) -> int:
    """Batches a plain ZMQ SUB (with ``keys``, a CURVE client) receives in ``wait_s``."""
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    if keys is not None:
        keys.connect(sub)
    sub.connect(endpoint)
    n, deadline = 0, time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            if sub.poll(100):
                sub.recv_multipart()
                n += 1
    finally:
        sub.close(linger=0)
    return n


def _replayed(endpoint: str, keys: EventKeys | None, wait_s: float = 3.0) -> int | None:
    """Batches a replay from 0 returns (None: no answer within ``wait_s``)."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.connect(sock)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")), flags=zmq.NOBLOCK)
    except zmq.Again:
        sock.close(linger=0)
        return None
    n = 0
    try:
        while True:
            if not sock.poll(int(wait_s * 1000)):
                return None
            frames = sock.recv_multipart()
            if frames[-2] == (-1).to_bytes(8, "big", signed=True):
                return n
            n += 1
    finally:
        sock.close(linger=0)


def test_keys_are_derived_from_the_file_and_a_short_or_missing_file_is_refused(tmp_path):
    a, again = _keys(tmp_path, "a", "s" * 32), _keys(tmp_path, "b", "s" * 32)
    assert a == again and a.server_public != a.client_public
    assert _keys(tmp_path, "c", "t" * 32).server_public != a.server_public
    with pytest.raises(ValueError, match="at least 16"):
        _keys(tmp_path, "short", "s" * 8)
    with pytest.raises(ValueError, match="no-such-file"):
        EventKeys.from_file(tmp_path / "no-such-file")


def test_only_the_keys_holder_reads_the_events_and_their_replay(tmp_path):
    keys = _keys(tmp_path, "events.key", "the shared secret of this fleet")
    other = _keys(tmp_path, "other.key", "a secret of another fleet!!")
    endpoints = EventEndpoints.pick("keyed-engine", "127.0.0.1", keyed=True)
    assert endpoints.keyed and endpoints.vllm_replay_endpoint != endpoints.replay_endpoint
    engine = Engine(endpoints.ipc, endpoints.inner_replay_port)
    relay = EventRelay(endpoints, keys)
    prompt = list(range(300, 340))
    want = prefix_keys(prompt, B)

    async def follow() -> EventFeed:
        index = BlockIndex(B, max_blocks=1000)
        feed = EventFeed("e", endpoints.endpoint, endpoints.replay_endpoint, index,
                         keys=keys)
        # Stored before the feed listened: its replay (through the relay) brings it.
        engine.publish(_stored(None, [0, 1], prompt[:8]))
        await engine.sent(0)
        task = asyncio.create_task(feed.run())
        try:
            await _until(lambda: index.cached_blocks(want) == 2, timeout_s=10)
            engine.publish(_stored(1, [2], prompt[8:12]))  # the live stream
            await engine.beat_until(lambda: index.cached_blocks(want) == 3)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return feed

    try:
        feed = asyncio.run(follow())
        assert feed.stats.incomplete == 0 and feed.stats.replays >= 1
        # The controls, while the engine keeps publishing: no key, another key.
        for reader_keys in (None, other):
            engine.publish(_stored(None, [50], prompt[:4]))
            assert _heard(endpoints.endpoint, reader_keys) == 0, reader_keys
            assert _replayed(endpoints.replay_endpoint, reader_keys) is None, reader_keys
        # Their positive twins, the same calls with the key.
        engine.publish(_stored(None, [51], prompt[:4]))

        async def beat_while_listening() -> int:
            heard = asyncio.create_task(asyncio.to_thread(_heard, endpoints.endpoint, keys))
            await engine.beat_until(lambda: heard.done(), timeout_s=10)
            return heard.result()

        assert asyncio.run(beat_while_listening()) > 0
        assert _replayed(endpoints.replay_endpoint, keys) > 3
    finally:
        relay.close()
        engine.close()


def test_a_router_follows_curve_events_only_with_the_key(tmp_path, caplog):
    """``Capacity.kv_events_curve``: a router without the key places that engine by load
    (no feed, one warning); with it, the feed reads with the key; plain events are read
    plainly by either."""
    from types import SimpleNamespace

    from router.cache_feed import EngineCaches

    keys = _keys(tmp_path, "events.key", "the shared secret of this fleet")

    def capacity(curve: bool, port: int):
        return SimpleNamespace(kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                               kv_events_replay_endpoint=f"tcp://127.0.0.1:{port + 1}",
                               kv_events_curve=curve, block_size=16, num_total_blocks=8)

    async def follow(caches: EngineCaches) -> dict:
        import logging

        caches._log = logging.getLogger("test")
        caches.follow("127.0.0.1:1", capacity(True, 20001))
        caches.follow("127.0.0.1:1", capacity(True, 20001))  # warned once
        caches.follow("127.0.0.1:2", capacity(False, 20003))
        feeds = {a: f for a, (_, f, _) in caches._feeds.items()}
        for _, _, task in caches._feeds.values():
            task.cancel()
        return feeds

    without = asyncio.run(follow(EngineCaches()))
    assert list(without) == ["127.0.0.1:2"] and without["127.0.0.1:2"].keys is None
    assert caplog.text.count("placed by load") == 1
    with_key = asyncio.run(follow(EngineCaches(keys=keys)))
    assert with_key["127.0.0.1:1"].keys == keys and with_key["127.0.0.1:2"].keys is None

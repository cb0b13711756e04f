"""The router's picture of each engine's prefix cache (``router.cache_index``), unit
level: the index against a dict of the blocks stored, and the feed against vLLM's own
event publisher (``ZmqEventPublisher``, real ZMQ on loopback): a late start, a gap, a
replay buffer that no longer reaches back, an engine restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.cache_feed import EventFeed
from router.cache_index import BlockIndex, prefix_keys

pytestmark = pytest.mark.fleet

B = 4


def _stored(parent, hashes, tokens, lora=None, medium="GPU"):
    """A store in the engine's own pool (vLLM's MEDIUM_GPU, on CPU hosts too)."""
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=B, lora_id=None, medium=medium, lora_name=lora)


def test_the_index_knows_the_longest_cached_prefix():
    index = BlockIndex(B, max_blocks=100)
    prompt = list(range(100, 120))  # five blocks
    index.store(None, [b"h0", b"h1"], prompt[:8])
    index.store(b"h1", [b"h2"], prompt[8:12])
    keys = prefix_keys(prompt, B)
    assert index.cached_blocks(keys) == 3
    assert index.cached_blocks(prefix_keys(prompt[:4] + [0] * 16, B)) == 1
    assert index.cached_blocks(prefix_keys(prompt, B, adapter="other")) == 0
    index.remove([b"h1"])
    assert index.cached_blocks(keys) == 1  # block 1 gone: the prefix stops there
    index.store(b"unknown", [b"h9"], prompt[12:16])  # its parent's events were missed
    assert index.stats.orphans == 1 and index.cached_blocks(keys) == 1
    index.clear()
    assert index.cached_blocks(keys) == 0 and len(index) == 0


def test_the_index_is_bounded_oldest_first():
    index = BlockIndex(B, max_blocks=3)
    a, b = list(range(0, 12)), list(range(50, 62))
    index.store(None, [1, 2, 3], a)
    index.store(None, [4, 5], b[:8])
    assert len(index) == 3 and index.stats.evicted == 2
    assert index.cached_blocks(prefix_keys(a, B)) == 0  # its first two were forgotten
    assert index.cached_blocks(prefix_keys(b, B)) == 2


class Engine:
    """vLLM's publisher as an engine core runs it: PUB bound on an ipc path (vLLM binds
    ipc and wildcard endpoints, connects to the rest), replay ROUTER on loopback."""

    def __init__(self, pub: str, replay: int, buffer_steps: int = 100, hwm: int = 100_000):
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0, endpoint=pub,
            replay_endpoint=f"tcp://127.0.0.1:{replay}", buffer_steps=buffer_steps,
            hwm=hwm)

    def publish(self, *events) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        self.publisher.publish(KVEventBatch(ts=time.time(), events=list(events)))

    async def sent(self, seq: int) -> None:
        """Until the publisher's thread has sent batch ``seq`` (it appends what it sent
        to its replay buffer, vLLM's ``_buffer``, right after sending it)."""
        await _until(lambda: any(s >= seq for s, _ in list(self.publisher._buffer)))

    async def beat_until(self, condition, timeout_s: float = 20.0) -> None:
        """Until ``condition``, publishing an ignored batch (an offloading tier's store)
        every 0.2 s as a working engine goes on publishing: a batch sent before the
        feed's SUB joined shows as a gap at the next one, and the replay brings it."""
        deadline = time.monotonic() + timeout_s
        beat = 0
        while not condition():
            assert time.monotonic() < deadline, "condition not met"
            self.publish(_stored(None, [10 ** 6 + beat], [9, 9, 9, 9], medium="CPU"))
            beat += 1
            await asyncio.sleep(0.2)

    def close(self) -> None:
        self.publisher.shutdown()


async def _until(condition, timeout_s: float = 5.0) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def test_the_feed_follows_vllms_publisher_through_gaps_and_restarts(tmp_path):
    from kvhandoff.ports import free_port

    pub, replay = f"ipc://{tmp_path}/events", free_port()
    prompt = list(range(200, 240))  # ten blocks
    keys = prefix_keys(prompt, B)

    async def scenario():
        engine = Engine(pub, replay)
        index = BlockIndex(B, max_blocks=1000)
        feed = EventFeed("e", pub, f"tcp://127.0.0.1:{replay}", index)
        # Stored before the router listened: the replay at the start brings it.
        engine.publish(_stored(None, [0, 1], prompt[:8]))
        await engine.sent(0)
        task = asyncio.create_task(feed.run())
        await _until(lambda: index.cached_blocks(keys) == 2)
        engine.publish(_stored(1, [2], prompt[8:12]))
        await engine.beat_until(lambda: index.cached_blocks(keys) == 3)
        # Missed while the router was away: the replay at its start, or the gap the
        # next batch shows, brings them.
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.publish(_stored(2, [3], prompt[12:16]))
        engine.publish(_stored(3, [4], prompt[16:20]))
        task = asyncio.create_task(feed.run())
        engine.publish(_stored(4, [5], prompt[20:24]))
        await engine.beat_until(lambda: index.cached_blocks(keys) == 6)
        replays = feed.stats.replays
        assert feed.stats.incomplete == 0 and replays >= 2
        # The engine restarts (its numbers start again): the index starts over from what
        # the new engine stored.
        engine.close()
        await asyncio.sleep(0.3)
        engine = Engine(pub, replay)
        engine.publish(_stored(None, [10], prompt[:4]))
        await engine.beat_until(lambda: feed.stats.restarts == 1)
        await _until(lambda: index.cached_blocks(keys) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()

    asyncio.run(scenario())


def test_a_gap_the_replay_no_longer_reaches_clears_the_index(tmp_path):
    """Negative control of the replay: a buffer of two batches cannot give back three
    missed ones, so the index is cleared (counted) rather than left with a hole."""
    from kvhandoff.ports import free_port

    pub, replay = f"ipc://{tmp_path}/events", free_port()
    prompt = list(range(300, 340))
    keys = prefix_keys(prompt, B)

    async def scenario():
        engine = Engine(pub, replay, buffer_steps=2)
        index = BlockIndex(B, max_blocks=1000)
        feed = EventFeed("e", pub, f"tcp://127.0.0.1:{replay}", index)
        engine.publish(_stored(None, [0], prompt[:4]))
        await engine.sent(0)
        task = asyncio.create_task(feed.run())
        await _until(lambda: index.cached_blocks(keys) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for i in range(1, 5):
            engine.publish(_stored(i - 1, [i], prompt[4 * i:4 * i + 4]))
        # All sent before the feed is back (else it could hear some live; CI's once did).
        await engine.sent(4)
        task = asyncio.create_task(feed.run())
        await _until(lambda: feed.stats.incomplete >= 1)
        assert index.cached_blocks(keys) == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()

    asyncio.run(scenario())


def test_batches_dropped_while_the_router_was_busy_are_replayed(tmp_path):
    """A running feed whose queue is full (a router busy for a second, the publisher's
    and the feed's queues bounded): ZMQ drops batches, the next one shows the gap, the
    replay fills it, and the index ends whole. Offloading tiers' stores (medium "CPU")
    are not the engine's pool and stay out."""
    from kvhandoff.ports import free_port

    pub, replay = f"ipc://{tmp_path}/events", free_port()
    # Here the publisher's thread and the feed share one process and its GIL: a replay
    # is their ping-pong frame by frame (3000 batches took 1.5 s alone and over 60 s
    # under a loaded CI, the replay unfinished). 500 are dropped all the same.
    count = 500
    prompt = list(range(1, 4 * count + 5))
    keys = prefix_keys(prompt, B)

    async def scenario():
        engine = Engine(pub, replay, buffer_steps=2 * count, hwm=1)
        index = BlockIndex(B, max_blocks=10 * count)
        feed = EventFeed("e", pub, f"tcp://127.0.0.1:{replay}", index, max_queued=1)
        engine.publish(_stored(None, [0], prompt[:4]))
        await engine.sent(0)
        task = asyncio.create_task(feed.run())
        await _until(lambda: index.cached_blocks(keys) == 1)
        for i in range(1, count):  # the publisher's thread sends while this loop sleeps
            engine.publish(_stored(i - 1, [i], prompt[4 * i:4 * i + 4]))
        time.sleep(1.0)
        engine.publish(_stored(count - 1, [count], prompt[4 * count:4 * count + 4]))
        # A gap shows at the next batch: on a slow machine the last ones can be dropped
        # too, so later batches come (an offloading tier's stores, ignored) as a working
        # engine's would, until the replay has made the index whole.
        deadline = time.monotonic() + 120
        extra = 0
        while index.cached_blocks(keys) != count + 1:
            assert time.monotonic() < deadline, feed.stats
            engine.publish(_stored(None, [10 ** 6 + extra], [9, 9, 9, 9], medium="CPU"))
            extra += 1
            await asyncio.sleep(0.5)
        assert feed.stats.replays >= 2 and feed.stats.incomplete == 0, feed.stats
        assert index.cached_blocks(prefix_keys([9, 9, 9, 9], B)) == 0
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        engine.close()

    asyncio.run(scenario())


class RawEngine:
    """A publisher that can send anything (vLLM's only sends what it encoded): PUB on
    ``pub``, a replay ROUTER on ``replay`` that answers the first ``bad_replies`` asks
    with a one-frame reply (not vLLM's shape) and the rest with an empty replay."""

    def __init__(self, pub: str, replay: int, bad_replies: int = 0):
        import zmq

        self.ctx = zmq.Context()
        # XPUB: it hears every SUB that joins (XPUB_VERBOSE), so the test sends only
        # once the feed listens, instead of sleeping and hoping it does.
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.bind(pub)
        self.joined = 0
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay}")
        self.bad_replies = bad_replies
        self.asks = 0

    def answer_replays(self) -> None:
        import zmq

        while self.pub.poll(0, zmq.POLLIN):
            self.joined += self.pub.recv()[:1] == b"\x01"
        while self.router.poll(0, zmq.POLLIN):
            identity, _, _start = self.router.recv_multipart()
            self.asks += 1
            if self.asks <= self.bad_replies:
                self.router.send_multipart((identity, b"garbage"))
            else:
                self.router.send_multipart((identity, b"", (-1).to_bytes(8, "big", signed=True),
                                            b""))

    def send(self, seq: int, payload: bytes) -> None:
        self.pub.send_multipart((b"", seq.to_bytes(8, "big", signed=True), payload))

    def batch(self, seq: int, *events) -> None:
        import msgspec

        self.send(seq, msgspec.msgpack.encode([time.time(), list(events), 0]))

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _raw_stored(parent, hashes, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": B, "medium": "GPU"}


def test_unreadable_batches_and_a_failed_loop_clear_the_index_and_the_feed_goes_on(tmp_path):
    """A batch that is not msgpack, and one whose event lacks its token ids, are each
    skipped and counted, the index cleared (it missed their events); a replay answered
    in a shape the feed cannot read fails its loop, which is counted and started again.
    The feed keeps following the engine through all of it."""
    import router.cache_feed as cache_feed
    from kvhandoff.ports import free_port

    pub, replay = f"ipc://{tmp_path}/events", free_port()
    prompt = list(range(400, 420))
    keys = prefix_keys(prompt, B)

    async def scenario():
        engine = RawEngine(pub, replay, bad_replies=1)
        index = BlockIndex(B, max_blocks=100)
        feed = EventFeed("e", pub, f"tcp://127.0.0.1:{replay}", index)

        async def replays():
            while True:
                engine.answer_replays()
                await asyncio.sleep(0.01)

        answering = asyncio.create_task(replays())
        task = asyncio.create_task(feed.run())
        # The first replay's answer is unreadable: the loop fails, and starts again.
        await _until(lambda: feed.stats.failures == 1 and engine.asks >= 2,
                     timeout_s=cache_feed.FEED_RETRY_S + 5)
        await _until(lambda: engine.joined >= 2)  # the second loop's SUB listens
        engine.batch(0, _raw_stored(None, [0], prompt[:4]))
        await _until(lambda: index.cached_blocks(keys) == 1)
        engine.send(1, b"\xc1 not msgpack")
        await _until(lambda: feed.stats.malformed == 1)
        assert index.cached_blocks(keys) == 0 and feed.stats.incomplete == 1
        engine.batch(2, _raw_stored(None, [0], prompt[:4]))
        await _until(lambda: index.cached_blocks(keys) == 1)
        engine.batch(3, {"type": "BlockStored", "block_hashes": [1], "medium": "GPU"})
        await _until(lambda: feed.stats.malformed == 2)
        assert index.cached_blocks(keys) == 0
        engine.batch(4, _raw_stored(None, [0], prompt[:4]), _raw_stored(0, [1], prompt[4:8]))
        await _until(lambda: index.cached_blocks(keys) == 2)
        # Numbers 1 and 3 count as seen: no replay was asked for them.
        assert engine.asks == 2 and not task.done(), feed.stats
        assert feed.stats.failures == 1 and feed.stats.batches == 3
        for t in (task, answering):
            t.cancel()
        await asyncio.gather(task, answering, return_exceptions=True)
        engine.close()

    asyncio.run(scenario())


def test_events_on_an_engines_loopback_are_not_read_from_another_host() -> None:
    """An engine publishes its KV events on loopback unless told otherwise; a router
    that reaches the engine over the network must not read its own loopback for them
    (another process's, or nothing): that engine is placed by load."""
    from router.cache_feed import reachable

    assert reachable("127.0.0.1:5000", "tcp://127.0.0.1:6000")
    assert reachable("localhost:5000", "tcp://127.0.0.1:6000")
    assert not reachable("10.213.7.1:5000", "tcp://127.0.0.1:6000")
    assert reachable("10.213.7.1:5000", "tcp://10.213.7.1:6000")  # --kv-events HOST
    assert reachable("p", "tcp://127.0.0.1:6000")  # a name: cannot tell, follow it

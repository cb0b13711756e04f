"""Each engine's KV events into its :class:`~router.cache_index.BlockIndex`: one
:class:`EventFeed` per engine (a ZMQ SUB on its PUB endpoint, replays from its ROUTER
endpoint) and :class:`EngineCaches`, the router's view of every engine, which starts,
restarts and stops the feeds as the engines' capacity snapshots name their endpoints.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.cache_index import BlockIndex, prefix_keys

if TYPE_CHECKING:
    from kvhandoff.event_keys import EventKeys

#: vLLM's replay end marker (``ZmqEventPublisher.END_SEQ``).
_END_SEQ = -1
#: How long a replay may take before the index is given up as incomplete.
REPLAY_TIMEOUT_S = 5.0
#: A feed whose loop failed starts again after this long (its index empty meanwhile),
#: doubled after each failure in a row up to ``FEED_RETRY_MAX_S``: an engine whose events
#: stay unreadable is not retried (and logged) every second.
FEED_RETRY_S = 1.0
FEED_RETRY_MAX_S = 30.0


class MalformedBatch(ValueError):
    """A published batch that is not a ``KVEventBatch`` of vLLM's shape."""


@dataclass
class FeedStats:
    batches: int = 0
    #: Replays asked for: at the start, after a gap, after an engine restart.
    replays: int = 0
    #: Times the index was cleared because the events could not be made whole (a replay
    #: that started past what was missed, or did not answer in time).
    incomplete: int = 0
    restarts: int = 0
    #: Batches that could not be read (not msgpack, or not vLLM's shape): each clears
    #: the index, since an event was lost.
    malformed: int = 0
    #: Times the feed's loop failed (a socket error, an unexpected reply) and was
    #: started again after ``FEED_RETRY_S``, its index cleared.
    failures: int = 0


def decode_batch(payload: bytes) -> tuple[float, list]:
    """A ``KVEventBatch`` (msgpack ``[ts, events, dp_rank]``, each event a map tagged
    with its ``type``): its time and events."""
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
        return float(batch[0]), list(batch[1])
    except (msgspec.DecodeError, TypeError, ValueError, IndexError, KeyError) as e:
        raise MalformedBatch(f"{type(e).__name__}: {e}") from e


#: The engine's own pool (vLLM's ``MEDIUM_GPU``, on CPU hosts too); offloading tiers
#: publish other media ("CPU", "STORAGE") for their own copies.
ENGINE_MEDIA = (None, "GPU")


def apply_events(index: BlockIndex, events: list) -> None:
    """A batch's events into ``index`` (the engine pool's only). Raises
    :class:`MalformedBatch` at the first event it cannot read (those before it are
    applied)."""
    for event in events:
        kind = event.get("type") if isinstance(event, dict) else None
        try:
            if kind in ("BlockStored", "BlockRemoved") and event.get("medium") not in ENGINE_MEDIA:
                continue
            if kind == "BlockStored":
                index.store(event.get("parent_block_hash"), list(event["block_hashes"]),
                            list(event["token_ids"]), event.get("lora_name"))
            elif kind == "BlockRemoved":
                index.remove(list(event["block_hashes"]))
            elif kind == "AllBlocksCleared":
                index.clear()
        except (KeyError, TypeError, ValueError) as e:
            raise MalformedBatch(f"{kind} event: {type(e).__name__}: {e}") from e


class EventFeed:
    """Keeps one engine's :class:`BlockIndex` in step with its events: a SUB socket on
    its PUB endpoint; a replay from its ROUTER endpoint at the start (what was stored
    before the router listened), after a gap in the sequence numbers and after the
    engine restarted (numbers start again at 0). Events it cannot make whole, and
    batches it cannot read, clear the index (counted, logged): the placement then treats
    the engine as holding nothing until new events come. A loop that fails (a socket
    error) is logged, counted and started again; only a cancel ends :meth:`run`."""

    def __init__(self, name: str, endpoint: str, replay_endpoint: str, index: BlockIndex,
                 logger: object | None = None, max_queued: int = 10_000,
                 keys: EventKeys | None = None):
        self.name, self.endpoint, self.replay_endpoint = name, endpoint, replay_endpoint
        self.index = index
        #: The engine's events are CURVE (``kvhandoff.event_keys``): read with these.
        self.keys = keys
        self.stats = FeedStats()
        self._next: int | None = None  # the sequence number expected next
        self._last_ts = float("-inf")  # the latest batch's time applied
        self._known_from: int | None = None  # set once a replay answered
        self._log = logger
        #: Batches ZMQ may queue for this feed (its SUB's high-water mark): beyond, the
        #: publisher drops them and the gap is replayed.
        self.max_queued = max_queued

    def _warn(self, message: str, *args: object) -> None:
        if self._log is not None:
            self._log.warning("KV events of %s: " + message, self.name, *args)

    async def run(self) -> None:
        """Until cancelled; a failed loop starts again after ``FEED_RETRY_S`` (doubling
        while it keeps failing before any batch arrives), with its index cleared and a
        replay."""
        import asyncio

        wait_s = FEED_RETRY_S
        while True:
            batches = self.stats.batches
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the feed must outlive any one failure
                self.stats.failures += 1
                if self.stats.batches > batches:
                    wait_s = FEED_RETRY_S  # it followed the engine for a while: a new failure
                if self._log is not None:
                    self._log.warning("KV events of %s: feed failed (%s: %s); index "
                                      "cleared, again in %g s", self.name,
                                      type(e).__name__, e, wait_s)
                self.index.clear()
                self._next = self._known_from = None
                await asyncio.sleep(wait_s)
                wait_s = min(2 * wait_s, FEED_RETRY_MAX_S)

    async def _follow(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, self.max_queued)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.keys.connect(sub)
        sub.connect(self.endpoint)
        try:
            # What the engine stored before (or while) this feed did not listen.
            await self._replay(ctx, self._next or 0)
            while True:
                _, seq_bytes, payload = await sub.recv_multipart()
                await self._on(ctx, int.from_bytes(seq_bytes, "big", signed=True), payload)
        finally:
            sub.close(linger=0)

    async def _on(self, ctx: object, seq: int, payload: bytes) -> None:
        try:
            ts, events = decode_batch(payload)
        except MalformedBatch as e:
            self._malformed(seq, e)
            return
        if self._next is not None and seq < self._next:
            if ts <= self._last_ts:
                return  # already applied (a replay overlapped the stream)
            # Numbers went back with time going on: the engine restarted.
            self._warn("sequence restarted at %d (expected %d): the engine restarted",
                       seq, self._next)
            self.stats.restarts += 1
            self.index.clear()
            self._next = self._known_from = None
            await self._replay(ctx, 0)
            if self._next is not None and seq < self._next:
                return
        elif self._next is not None and seq > self._next:
            await self._replay(ctx, self._next)
            if self._next is not None and seq < self._next:
                return
            if self._next is not None and seq > self._next:
                self._incomplete(f"events {self._next}-{seq - 1} missed and not replayed")
        self._apply(seq, ts, events)

    def _apply(self, seq: int, ts: float, events: list) -> None:
        try:
            apply_events(self.index, events)
        except MalformedBatch as e:
            self._malformed(seq, e)
            return
        self.stats.batches += 1
        self._next, self._last_ts = seq + 1, max(self._last_ts, ts)

    def _malformed(self, seq: int, error: MalformedBatch) -> None:
        """Batch ``seq`` could not be read: it is skipped (its number counts as seen, so
        no replay asks for it again) and the index, which missed its events, cleared."""
        self.stats.malformed += 1
        self._incomplete(f"batch {seq} unreadable ({error})")
        if self._next is None or seq >= self._next:
            self._next = seq + 1

    async def _replay(self, ctx: object, start: int) -> None:
        """Ask the engine for its buffered batches from ``start`` on and apply them."""
        import asyncio

        import zmq

        self.stats.replays += 1
        sock = ctx.socket(zmq.DEALER)  # type: ignore[attr-defined]
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            self.keys.connect(sock)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            first = None
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == _END_SEQ:
                    break
                first = seq if first is None else first
                if self._next is not None and seq < self._next:
                    continue
                try:
                    self._apply(seq, *decode_batch(frames[-1]))
                except MalformedBatch as e:
                    self._malformed(seq, e)
            if first is not None and first > start and self._known_from is not None:
                self._incomplete(f"replay from {start} began at {first}")
            elif first is not None and first > start:
                # A first replay that no longer reaches the engine's first batch: what was
                # cached before it is unknown (not wrong); blocks stored on those are
                # skipped as orphans until they are stored again.
                self._warn("replay began at %d: earlier blocks unknown", first)
            if self._known_from is None:
                self._known_from = start
        except TimeoutError:
            self._incomplete(f"no replay within {REPLAY_TIMEOUT_S:g} s")
        finally:
            sock.close(linger=0)

    def _incomplete(self, why: str) -> None:
        self._warn("index cleared: %s", why)
        self.stats.incomplete += 1
        self.index.clear()


def _network_address(host: str) -> bool:
    """An IP address literal other than loopback (a hostname cannot be told apart)."""
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def reachable(address: str, endpoint: str) -> bool:
    """Whether the events ``endpoint`` an engine at ``address`` names can be this
    router's: an engine publishes on loopback unless told otherwise (its events carry
    prompts' token ids), and an engine reached at a network address then has them on its
    own host's loopback, not this one's. Those engines are placed by load."""
    events_host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return _network_address(events_host) or not _network_address(address.rsplit(":", 1)[0])


# ---- the router's view of every engine -----------------------------------------------
class EngineCaches:
    """One :class:`BlockIndex` and :class:`EventFeed` per engine that publishes its KV
    events (``Capacity.kv_events_endpoint``): started at its first snapshot that names
    them, started again when they change (a restarted engine on new ports), stopped by
    :meth:`close`. ``index_factor``: blocks an index keeps, times the engine's pool."""

    def __init__(self, logger: object | None = None, index_factor: int = 2,
                 keys: EventKeys | None = None):
        self._log = logger
        self._factor = index_factor
        #: For engines whose events are CURVE (``Capacity.kv_events_curve``).
        self._keys = keys
        self._feeds: dict[str, tuple[str, EventFeed, object]] = {}  # address -> feed
        self._unkeyed: set[str] = set()  # engines whose CURVE events this cannot read

    def follow(self, address: str, capacity: object) -> None:
        """After a snapshot of the engine at ``address``."""
        import asyncio

        endpoint = getattr(capacity, "kv_events_endpoint", "")
        current = self._feeds.get(address)
        if current is not None and current[0] == endpoint:
            return
        if current is not None:
            current[2].cancel()  # type: ignore[attr-defined]
            del self._feeds[address]
        if not endpoint or not reachable(address, endpoint):
            return
        curve = bool(getattr(capacity, "kv_events_curve", False))
        if curve and self._keys is None:
            if address not in self._unkeyed and self._log is not None:
                self._log.warning("KV events of %s are CURVE and this router has no "
                                  "--kv-events-key: placed by load", address)
            self._unkeyed.add(address)
            return
        index = BlockIndex(capacity.block_size,  # type: ignore[attr-defined]
                           self._factor * max(capacity.num_total_blocks, 1))  # type: ignore[attr-defined]
        feed = EventFeed(address, endpoint, capacity.kv_events_replay_endpoint,  # type: ignore[attr-defined]
                         index, self._log, keys=self._keys if curve else None)
        task = asyncio.get_running_loop().create_task(feed.run(), name=f"kv-events-{address}")
        self._feeds[address] = (endpoint, feed, task)

    def cached_blocks(self, address: str, token_ids: Sequence[int],
                      adapter: str | None = None) -> int:
        """Leading full blocks of ``token_ids`` the engine holds, as far as its events
        say (0 with no events)."""
        current = self._feeds.get(address)
        if current is None:
            return 0
        index = current[1].index
        return index.cached_blocks(prefix_keys(token_ids, index.block_size, adapter))

    def forget(self, address: str) -> None:
        """Stop following the engine at ``address`` (gone from the fleet)."""
        current = self._feeds.pop(address, None)
        if current is not None:
            current[2].cancel()  # type: ignore[attr-defined]
        self._unkeyed.discard(address)

    def addresses(self) -> list[str]:
        """The engines followed now."""
        return list(self._feeds)

    def feed(self, address: str) -> EventFeed | None:
        current = self._feeds.get(address)
        return None if current is None else current[1]

    async def close(self) -> None:
        import asyncio

        tasks = [task for _, _, task in self._feeds.values()]
        for task in tasks:
            task.cancel()  # type: ignore[attr-defined]
        await asyncio.gather(*tasks, return_exceptions=True)  # type: ignore[arg-type]
        self._feeds.clear()

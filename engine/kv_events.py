"""An engine's KV-cache events (vLLM's ``KVEventsConfig``, ZMQ) where the router can read
them, on the engine's own address only.

vLLM's publisher binds its PUB socket only on a wildcard (``tcp://*:port``: every
interface) or an ipc/inproc endpoint, and connects to anything else. An engine here
listens only on its configured address (loopback on one host, the host's address across
hosts: tests/test_security.py, tests/test_hosts.py), so the engine core binds its PUB on
an ipc path and :class:`EventRelay` (ZMQ's own proxy, a thread of the engine's server
process) republishes it on ``tcp://<host>:<port>``. The replay ROUTER is vLLM's, bound on
``tcp://<host>:<replay port>`` (vLLM binds a ROUTER on any address). The router reads
both: ``router.cache_index``.

With keys (``kvhandoff.event_keys``: ``--kv-events-key``, required for an address other
than loopback) the relay's PUB is a CURVE server that takes only the keys' client (ZMQ's
ZAP, in a thread of the relay), vLLM's ROUTER binds on loopback, and the relay serves
replays on ``tcp://<host>:<replay port>`` as a CURVE server too, asking vLLM's ROUTER on
the client's behalf: nothing of the events leaves the host in the clear.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.event_keys import EventKeys

logger = logging.getLogger(__name__)

#: vLLM's end-of-replay sequence number (``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: How long the relay waits for each frame of vLLM's replay.
REPLAY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EventEndpoints:
    ipc: str  # where the engine core's PUB binds
    host: str
    port: int  # the relay's PUB
    replay_port: int  # vLLM's replay ROUTER, or the relay's (with keys)
    #: With keys: vLLM's replay ROUTER, on loopback, behind the relay's (0: none).
    inner_replay_port: int = 0

    @classmethod
    def pick(cls, engine_id: str, host: str, keyed: bool = False) -> EventEndpoints:
        from kvhandoff.ports import free_port

        path = os.path.join(tempfile.gettempdir(), f"kvhandoff-{engine_id}.kv-events")
        return cls(f"ipc://{path}", host, free_port(host), free_port(host),
                   free_port("127.0.0.1") if keyed else 0)

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    @property
    def keyed(self) -> bool:
        """Both endpoints are the relay's CURVE servers."""
        return bool(self.inner_replay_port)

    @property
    def vllm_replay_endpoint(self) -> str:
        """Where vLLM's replay ROUTER binds."""
        if self.inner_replay_port:
            return f"tcp://127.0.0.1:{self.inner_replay_port}"
        return self.replay_endpoint

    def vllm_config(self) -> Any:
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=self.ipc, replay_endpoint=self.vllm_replay_endpoint)


class _OneClient:
    """ZAP's CURVE check: the keys' client and no other."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        if key != self.client_public:
            logger.warning("KV events: a client with an unknown CURVE key was refused")
            return False
        return True


class EventRelay:
    """ZMQ's proxy from the engine core's ipc PUB to a PUB on ``tcp://host:port``, in a
    daemon thread; with ``keys``, both that PUB and a replay ROUTER in front of vLLM's
    are CURVE servers for the keys' client (a second thread serves replays);
    :meth:`close` ends it."""

    def __init__(self, endpoints: EventEndpoints, keys: EventKeys | None = None):
        import zmq

        self._ctx = zmq.Context()
        self._auth = None
        if keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=logger)
            self._auth.start()
            self._auth.configure_curve_callback("*", _OneClient(keys.client_public))
        self._front = self._ctx.socket(zmq.XSUB)
        self._front.connect(endpoints.ipc)
        self._back = self._ctx.socket(zmq.XPUB)
        self._back.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.serve(self._back)
        self._back.bind(endpoints.endpoint)
        self._ipc_path = endpoints.ipc.removeprefix("ipc://")
        self._threads = [threading.Thread(target=self._run, name="kv-events-relay",
                                          daemon=True)]
        if keys is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            keys.serve(self._replay)
            self._replay.bind(endpoints.replay_endpoint)
            self._inner = endpoints.vllm_replay_endpoint
            self._threads.append(threading.Thread(target=self._serve_replays,
                                                  name="kv-events-replay", daemon=True))
        for thread in self._threads:
            thread.start()

    def _serve_replays(self) -> None:
        """Each request ``[client, b"", start]`` asked of vLLM's ROUTER, its answer
        frames sent back to ``client`` up to and with the end marker (vLLM's protocol,
        ``ZmqEventPublisher._service_replay``), one request at a time."""
        import zmq

        def connect() -> Any:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, int(REPLAY_TIMEOUT_S * 1000))
            sock.connect(self._inner)
            return sock

        inner = connect()
        try:
            while True:
                frames = self._replay.recv_multipart()
                if len(frames) != 3:
                    continue  # vLLM ignores such a request too
                client, _, start = frames
                inner.send_multipart((b"", start))
                while True:
                    try:
                        answer = inner.recv_multipart()
                    except zmq.Again:  # vLLM did not finish: the client times out too
                        logger.warning("KV events: vLLM's replay did not answer")
                        inner.close(linger=0)  # its late frames are nobody's
                        inner = connect()
                        break
                    self._replay.send_multipart((client, *answer))
                    if len(answer) >= 2 and answer[-2] == END_SEQ:
                        break
        except zmq.ContextTerminated:
            pass
        finally:
            for sock in (inner, self._replay):
                sock.close(linger=0)

    def _run(self) -> None:
        import zmq

        try:
            zmq.proxy(self._front, self._back)
        except zmq.ContextTerminated:
            pass
        finally:  # the sockets are this thread's from here on; term() waits for them
            for sock in (self._front, self._back):
                sock.close(linger=0)

    def close(self) -> None:
        """End the relay (its threads close the sockets, ``term`` waits for that)."""
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        for thread in self._threads:
            thread.join(timeout=2.0)
        try:
            os.unlink(self._ipc_path)
        except OSError:
            pass

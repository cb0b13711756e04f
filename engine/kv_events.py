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
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventEndpoints:
    ipc: str  # where the engine core's PUB binds
    host: str
    port: int  # the relay's PUB
    replay_port: int  # vLLM's replay ROUTER

    @classmethod
    def pick(cls, engine_id: str, host: str) -> EventEndpoints:
        from kvhandoff.ports import free_port

        path = os.path.join(tempfile.gettempdir(), f"kvhandoff-{engine_id}.kv-events")
        return cls(f"ipc://{path}", host, free_port(host), free_port(host))

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://{self.host}:{self.replay_port}"

    def vllm_config(self) -> Any:
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                              endpoint=self.ipc, replay_endpoint=self.replay_endpoint)


class EventRelay:
    """ZMQ's proxy from the engine core's ipc PUB to a PUB on ``tcp://host:port``, in a
    daemon thread; :meth:`close` ends it."""

    def __init__(self, endpoints: EventEndpoints):
        import zmq

        self._ctx = zmq.Context()
        self._front = self._ctx.socket(zmq.XSUB)
        self._front.connect(endpoints.ipc)
        self._back = self._ctx.socket(zmq.XPUB)
        self._back.setsockopt(zmq.LINGER, 0)
        self._back.bind(endpoints.endpoint)
        self._ipc_path = endpoints.ipc.removeprefix("ipc://")
        self._thread = threading.Thread(target=self._run, name="kv-events-relay",
                                        daemon=True)
        self._thread.start()

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
        """End the relay (its thread closes the sockets, ``term`` waits for that)."""
        self._ctx.term()
        self._thread.join(timeout=2.0)
        try:
            os.unlink(self._ipc_path)
        except OSError:
            pass

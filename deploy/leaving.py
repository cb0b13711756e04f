"""A Decode replica that Serve stops moves its running beam searches out (issue 59).

Serve 2.60 calls no code of a replica it stops before it waits for the replica's running
calls (docs/decisions.md, "A running beam search moves with its prompt's KV": "Serve's
scale-down"). What a replica can see, through Serve's own extension point, is the
running set of its deployment: a handle the replica holds to its own deployment gets
each change (``CapacityRouter.update_replicas``, told to :func:`replicas_changed`), and
a stopping replica leaves that set as Serve marks it STOPPING, before Serve's drain
waits for its calls. :class:`LeaveWatch` turns "this replica left the running set
while another runs" into its engine's Stop of every search it runs: each stage 2
answers ``stopped`` through its own call, and the router's run resumes it on another
replica (``router.search_moves``: a stopped answer no move asked for goes on at a D
picked then; the resume avoids this engine). Searches end here in place when no other
replica runs (the whole deployment stops: nowhere to move them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

logger = logging.getLogger("kvhandoff.deploy")

#: How often the stop is sent again while searches run (the engine drops a Stop of a
#: search that has not reached it yet).
RESTOP_S = 0.2

_watches: list[LeaveWatch] = []


def replicas_changed(deployment: str, replica_ids: Iterable[str]) -> None:
    """Serve's running set of ``deployment`` as a request router in this process sees it
    (called from the handle's loop)."""
    ids = set(replica_ids)
    for watch in list(_watches):
        if watch.deployment == deployment:
            watch.replicas(ids)


class LeaveWatch:
    """One replica's watch (``EngineServer`` of role decode). ``running`` lists the
    request ids the engine runs now; ``stop`` stops those that are beam searches
    (``DecodeEngine.stop_searches``: unknown or sampled ids are ignored); both run on
    ``loop``, the replica's own."""

    def __init__(self, deployment: str, replica_id: str, loop: asyncio.AbstractEventLoop,
                 running: Callable[[], list[str]],
                 stop: Callable[[list[str]], Awaitable[None]]):
        self.deployment, self.replica_id, self.loop = deployment, replica_id, loop
        self._running, self._stop = running, stop
        self._seen = False
        #: Set once this replica has left the running set with another replica in it.
        self.left = False
        self.task: asyncio.Future | None = None

    def start(self) -> LeaveWatch:
        _watches.append(self)
        return self

    def close(self) -> None:
        if self in _watches:
            _watches.remove(self)

    def replicas(self, ids: set[str]) -> None:
        if self.replica_id in ids:
            self._seen = True
            return
        if not self._seen or self.left or not ids:
            return  # not running yet, already leaving, or nowhere to move to
        self.left = True
        logger.info("replica %s left %s's running set (stopping): moving its searches to "
                    "%d other replicas", self.replica_id, self.deployment, len(ids))
        self.task = asyncio.run_coroutine_threadsafe(self._move_out(), self.loop)

    async def _move_out(self) -> int:
        """Stop every running search, again every ``RESTOP_S`` while any request runs;
        returns how many stops were sent."""
        sent = 0
        while ids := self._running():
            await self._stop(ids)
            sent += 1
            await asyncio.sleep(RESTOP_S)
        return sent

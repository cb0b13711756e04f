"""Ending P's pinned holds (``router.chunks``' named KV chunks). No lease ends a pinned
hold, so nothing the router forgets may be left pinned: a Release that failed is sent
again with the next one on that P (and counted against the share meanwhile), a failed
registration's is sent once more (its prefill may still have been finishing on P), and
at the process's start the holds an earlier run left under this router's name prefix
are released before registrations go on."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from router.endpoint import Endpoint
from router.stages import StageCalls

logger = logging.getLogger(__name__)


class Pinned(Protocol):
    """What a release needs of a pinned hold."""

    held_name: str
    engine_id: str
    num_blocks: int
    prefill: Endpoint


class PinReleases:
    def __init__(self, stages: StageCalls, prefix: str):
        self.stages = stages
        #: What every pin of this router is named with on P.
        self.prefix = prefix
        #: Forgotten pins whose Release failed, by P (``id``): sent again.
        self._unreleased: dict[int, list[Pinned]] = {}
        #: Failed registrations, named once more with the next release on their P.
        self._resend: dict[int, list[Pinned]] = {}
        #: Set once an earlier run's leftovers were released; registrations wait.
        self.started = asyncio.Event()
        self.started.set()

    def unreleased(self, ep: Endpoint) -> list[Pinned]:
        """Pins on ``ep`` whose Release has yet to reach it (P still holds them)."""
        return list(self._unreleased.get(id(ep), ()))

    def hold_registrations(self) -> None:
        """Registrations wait until :meth:`release_leftovers` (the process's start)."""
        self.started.clear()

    async def release_leftovers(self, prefills: list[Endpoint]) -> None:
        """The pins an earlier run of this router left on ``prefills`` (its registry died
        with it) are released, then registrations go on. A P that fails keeps them
        (logged). A standalone router's Ps only: under Ray Serve one call reaches one P
        replica."""
        try:
            for ep in prefills:
                try:
                    await self.stages.release(ep, [], prefixes=[self.prefix])
                except Exception as e:
                    logger.warning("%s: the chunks an earlier router left there were not "
                                   "released (%s)", ep.address, e)
        finally:
            self.started.set()

    def once_more(self, p: Endpoint, pin: Pinned) -> None:
        """Name ``pin`` (a failed registration) again with the next release on ``p``."""
        self._resend.setdefault(id(p), []).append(pin)

    async def release(self, p: Endpoint, pins: list[Pinned]) -> None:
        """End P's holds on ``pins`` (forgotten already), with those still owed to it
        (unknown names are ignored); on failure they are all owed again."""
        pending = self._unreleased.pop(id(p), [])
        again = self._resend.pop(id(p), [])
        by_engine: dict[str, list[str]] = {}
        for r in [*pending, *again, *pins]:
            by_engine.setdefault(r.engine_id, []).append(r.held_name)
        try:
            for engine_id, names in by_engine.items():
                await self.stages.release(p, names, engine_id)
        except BaseException:
            self._unreleased.setdefault(id(p), []).extend([*pending, *pins])
            self._resend.setdefault(id(p), []).extend(again)
            logger.warning("Release of %d chunks on %s failed: sent again with the next "
                           "release there", len(pending) + len(pins), p.address)
            raise

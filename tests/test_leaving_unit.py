"""A stopping Decode replica's watch (``deploy.leaving.LeaveWatch``) with no cluster: the
running set Serve's handle reports, and the stops it sends its engine."""

from __future__ import annotations

import asyncio

from deploy import leaving


def _watch(loop, running: list[list[str]]):
    """A watch of replica "d-0" of "Decode" whose engine runs ``running[0]``, then
    ``running[1]``, ... (one list per look), recording the stops it is sent."""
    stops: list[list[str]] = []

    def now() -> list[str]:
        return running.pop(0) if running else []

    async def stop(ids: list[str]) -> None:
        stops.append(ids)

    return leaving.LeaveWatch("Decode", "d-0", loop, now, stop).start(), stops


def test_a_replica_that_leaves_the_running_set_stops_its_searches_until_none_runs(
        monkeypatch):
    """STEP 1: the set before this replica runs, then with it: nothing stopped. STEP 2:
    the set without it, another replica in it (Serve stopping this one): every search
    it runs is stopped, again while any runs, then no more. A second report changes
    nothing. Another deployment's set is not this watch's."""
    monkeypatch.setattr(leaving, "RESTOP_S", 0.01)

    async def main():
        watch, stops = _watch(asyncio.get_running_loop(),
                              [["a-s2", "b-s2"], ["b-s2"]])
        try:
            leaving.replicas_changed("Decode", ["d-1"])  # STEP 1: not running yet
            leaving.replicas_changed("Decode", ["d-0", "d-1"])
            leaving.replicas_changed("Prefill", ["p-0"])
            assert not watch.left and watch.task is None
            leaving.replicas_changed("Decode", ["d-1"])  # STEP 2
            assert watch.left
            sent = await asyncio.wrap_future(watch.task)
            leaving.replicas_changed("Decode", ["d-2"])
        finally:
            watch.close()
        return sent, stops

    sent, stops = asyncio.run(main())
    assert sent == 2 and stops == [["a-s2", "b-s2"], ["b-s2"]]


def test_a_replica_the_whole_deployment_stops_with_finishes_its_searches_in_place():
    """Control: the running set empties (the deployment deleted, nowhere to move): no
    stop; nor for a replica never seen running."""
    async def main():
        watch, stops = _watch(asyncio.get_running_loop(), [["a-s2"]])
        other, other_stops = _watch(asyncio.get_running_loop(), [["c-s2"]])
        other.replica_id = "d-9"
        try:
            leaving.replicas_changed("Decode", ["d-0", "d-1"])
            leaving.replicas_changed("Decode", [])
            await asyncio.sleep(0.05)
        finally:
            watch.close()
            other.close()
        return watch, stops, other, other_stops

    watch, stops, other, other_stops = asyncio.run(main())
    assert not stops and not other_stops
    assert other.task is None

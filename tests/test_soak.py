"""The soak's counting of what it sent (a fake router: no engines), and a short real soak
(``kvhandoff soak``) under the ``soak`` marker (not in CI; ``pytest -m soak`` runs it).
Its verdict is tested without engines in ``test_soak_verdict.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from kvhandoff.v1 import common_pb2, router_pb2
from tools.soak import load as soak_load
from tools.soak.load import Soak


class _FakeRouter:
    """Serves every call at once with a response whose handoff is recomputed when
    ``recomputed``; sets ``stop`` after ``calls`` calls."""

    def __init__(self, soak: Soak, calls: int, recomputed: bool):
        self.soak, self.left, self.recomputed = soak, calls, recomputed

    def _response(self) -> router_pb2.GenerateResponse:
        self.left -= 1
        if not self.left:
            self.soak.stop.set()
        stats = router_pb2.HandoffStats(recomputed=self.recomputed,
                                        handoff_failure="KV import from P failed: x"
                                        if self.recomputed else "")
        return router_pb2.GenerateResponse(stats=stats)

    def generate(self, req, timeout=None):
        if req.beam.beam_width == 0 or req.stage1.temperature < 0 \
                or req.prompt_token_ids.ids[0] >= 10**9:
            self._response()
            raise _Status(grpc.StatusCode.INVALID_ARGUMENT)
        return self._response()

    def generate_stream(self, req, timeout=None):
        return _FakeCall([
            router_pb2.GenerateStreamEvent(stage1_tokens=common_pb2.TokenIds(ids=[1])),
            router_pb2.GenerateStreamEvent(result=self._response())])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class _FakeCall:
    """A stream of events that ends CANCELLED once the client cancels it, as gRPC's does."""

    def __init__(self, events: list):
        self.events, self.cancelled = events, False

    def cancel(self) -> None:
        self.cancelled = True

    def __iter__(self):
        for event in self.events:
            if self.cancelled:
                raise _Status(grpc.StatusCode.CANCELLED)
            yield event


@pytest.mark.parametrize("recomputed", [False, True])
def test_the_soak_counts_served_requests_and_recomputed_handoffs(monkeypatch, recomputed):
    soak = Soak("fake:0", concurrency=1, seed=3)
    monkeypatch.setattr(soak_load, "RouterClient",
                        lambda address: _FakeRouter(soak, 200, recomputed))
    soak._worker(0)
    got = soak.take()
    served = len(got.latencies)
    assert served > 100 and not got.errors, got.errors
    # Every served request, unary or streamed, counted once as recomputed or not at all.
    assert len(got.recomputed) == (served if recomputed else 0)
    if recomputed:
        assert got.recomputed[0].startswith("soak-") and "KV import" in got.recomputed[0]


@pytest.mark.engines
@pytest.mark.soak
@pytest.mark.timeout(900)
def test_a_short_soak_passes(tmp_path, model_dir):
    out = tmp_path / "soak.json"
    # Two 30 s intervals after the baseline cannot show a slowdown, and one 30 s p99 against
    # another is noisy: throughput and p99 are held loosely here; a slowdown is the long
    # soak's to see, as is an RSS slope (two 30 s points make an hour's slope of noise).
    # Errors, pools, RSS growth and recomputes are held to their defaults.
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "soak", "--model", model_dir, "--minutes", "4",
         "--interval-s", "30", "--baseline-minutes", "2", "--max-throughput-drop", "0.5",
         "--max-p99-rise", "1.0", "--max-rss-slope-mib-h", "1e9", "--json", str(out),
         "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=800)
    print(proc.stdout)
    result = json.loads(out.read_text())
    assert proc.returncode == 0, (proc.stdout, proc.stderr[-3000:])
    assert result["verdict"]["ok"] and result["pools_clean"], result["verdict"]["failed"]
    names = [c["name"] for c in result["verdict"]["checks"]]
    assert names == ["throughput", "p99", "rss:prefill", "rss:decode", "rss:router",
                     "rss_slope:prefill", "rss_slope:decode", "rss_slope:router", "pools",
                     "errors", "recompute_share"], names
    kinds = {k.split(":")[0] for m in result["minutes"] for k in m["outcomes"]}
    assert kinds == {"unary", "stream", "cancel", "deadline", "bad"}, kinds
    assert all(m["served"] > 0 for m in result["minutes"])
    # Where each minute's CPU went, by process: every process busy, the engines most.
    for m in result["minutes"]:
        assert set(m["cpu_s"]) == {"prefill", "decode", "router", "client"}, m["cpu_s"]
        assert all(c > 0 for c in m["cpu_s"].values()), m["cpu_s"]
        assert m["machine"]["yardstick_ms"] > 0 and m["machine"]["steal_s"] >= 0, m


@pytest.mark.engines
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_soak_stopped_by_sigterm_leaves_no_server(tmp_path, model_dir):
    """SIGTERM (as a job scheduler stops it) during the load: the soak exits 130 with no
    verdict, and P, D and the router (each in its own session, so no signal reaches them
    from a terminal) are stopped, not left running."""
    import signal
    import time

    import psutil

    log = tmp_path / "soak.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "soak", "--model", model_dir, "--minutes",
             "100", "--interval-s", "5", "--baseline-minutes", "2", "--log-dir",
             str(tmp_path / "logs")], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 400
        while "minute 1:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(1)
        servers = psutil.Process(proc.pid).children(recursive=True)
        assert len([p for p in servers if "serve" in " ".join(p.cmdline())]) == 3, servers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130, log.read_text()[-2000:]
        assert "interrupted; servers stopped" in log.read_text()
        gone, alive = psutil.wait_procs(servers, timeout=60)
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()

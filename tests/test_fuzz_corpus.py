"""The malformed-input corpus (``tools.fuzz``) thrown at running engines, without and with
a handoff secret: hundreds of bad handoffs made from a real parent (every field broken,
re-signed as a buggy P would sign it, composed at random) and bad engine calls. Every
call gets a clear status, no engine dies or hangs, the pools come back where they were,
the good request afterwards gives the colocated reference's beams, and the case only D's
worker can refuse (ids beyond P's real pool, P's pool overstated) reached the worker and
was refused there. The corpus's own control (an engine that takes everything fails it)
and the field checks' control (the check removed admits the READ) are in
tests/test_field_checks.py.

A fresh seed each run (printed; ``KVHANDOFF_FUZZ_SEED=N`` replays a run)."""

from __future__ import annotations

import os
import random

import pytest

from tools.fuzz_cases import WORKER_CASE

pytestmark = [pytest.mark.engines, pytest.mark.fuzz]

SEED = int(os.environ.get("KVHANDOFF_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
#: Calls per run: the single-field cases and the other calls (about 110 unsigned, 190
#: signed), then random compositions.
CALLS = 300


def _check(report: dict, *, signed: bool) -> None:
    print(f"\nfuzz seed {SEED} (replay: KVHANDOFF_FUZZ_SEED={SEED}): sent {report['sent']}, "
          f"{report['by_code']}")
    assert report["sent"] == CALLS
    assert not report["failures"], report["failures"][:20]
    assert report["identical"]
    assert not {"UNKNOWN", "INTERNAL"} & set(report["by_code"])
    # Most of the corpus is refused as malformed, before any READ.
    assert report["by_code"].get("INVALID_ARGUMENT", 0) > CALLS // 2, report["by_code"]
    if signed:
        assert report["by_code"].get("PERMISSION_DENIED", 0) > 20, report["by_code"]
    # Signed, only the re-signed one gets past the signature to the worker.
    reaching = f"handoff {WORKER_CASE} ({'re-signed' if signed else 'as sent'})"
    worker = [c for name, c in report["codes"].items() if name == reaching]
    assert worker and set(worker) == {"UNAVAILABLE"}, worker


def test_corpus_without_a_secret_in_process_pair(pair, run, assert_pools_clean):
    """P and D with the defaults (no handoff secret), behind gRPC servers of their own."""
    from tools.fuzz_local import fuzz_pair

    report = run(fuzz_pair(pair, n=CALLS, seed=SEED), timeout=900)
    _check(report, signed=False)
    assert_pools_clean()


def test_corpus_with_a_secret_process_cluster(cluster, assert_cluster_clean):
    """The cluster's P and D, separate processes that sign and check handoffs, behind
    their engine key: each handoff case sent as tampered and as re-signed."""
    from connector.signing import load_secret
    from tools.fuzz_local import throw
    from tools.launch import engine_channel

    rng = random.Random(SEED)
    report = throw(cluster["prefill"].address, cluster["decode"][0].address, n=CALLS,
                   seed=SEED, prompt=[rng.randrange(10, 1000) for _ in range(70)],
                   suffix=[3], vocab_size=cluster_vocab(cluster),
                   secret=load_secret(str(cluster["secret_file"])), channel=engine_channel)
    _check(report, signed=True)
    for server in [cluster["prefill"], *cluster["decode"]]:
        assert server.proc.poll() is None, f"{server.role} died"
    assert_cluster_clean()


def cluster_vocab(cluster) -> int:
    from kvhandoff.v1 import engine_pb2
    from tests.conftest import engine_stub

    return engine_stub(cluster["prefill"].address).GetCapacity(
        engine_pb2.CapacityRequest(), timeout=10).vocab_size

"""Every handoff field checked before use (``connector.field_checks``), through vLLM's
real Scheduler with no model (as tests/test_scheduler_side.py): each malformed handoff
is refused at admission with reason ``malformed`` naming the field, nothing is
scheduled, and P is not contacted (an address in a handoff that does not hold together
is not trusted). The control: with the check taken out of the admission, the same
handoff is admitted and its READ scheduled. Plus the worker's last check against P's
handshake (``_outside_remote_pool``), and the corpus's own detection (``tools.fuzz``)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.utils import (
    make_export_params,
    make_import_request,
    make_scheduler,
    reject_at_admission,
)

PARENT = list(range(10, 85))  # 75 tokens: 74 computed, 3 blocks of 32


def _params(fingerprint, **fields):
    """An export of PARENT; ``fields`` override the handoff's (``t_`` prefix: a
    transport field)."""
    handoff = {k: v for k, v in fields.items() if not k.startswith("t_")}
    params = make_export_params(PARENT, model_fingerprint=fingerprint, **handoff)
    for k, v in fields.items():
        if k.startswith("t_"):
            params[k[2:]] = v
    return params


CASES = [
    ({"num_parent_tokens": "75"}, "num_parent_tokens is a str"),
    ({"cache_salt": None}, "cache_salt is a NoneType"),
    ({"num_parent_tokens": True}, "num_parent_tokens is a bool"),
    ({"lease_expires_at": float("nan")}, "lease_expires_at is nan"),
    ({"exported_at": -5.0}, "exported_at is negative"),
    ({"token_digest": "a" * 100_000}, "token_digest is 100000 characters"),
    ({"num_blocks": 7}, "num_blocks is 7"),
    ({"block_size": 0}, "block_size is 0"),
    ({"kv_bytes_per_block": 0}, "kv_bytes_per_block is 0"),
    ({"num_pool_blocks": 0}, "num_pool_blocks is 0"),
    ({"t_remote_block_ids": [[1_000_000, 1_000_001, 1_000_002]]},
     "holds 1000000, outside P's pool of 1000"),
    ({"t_remote_block_ids": [[-1, 2, 3]]}, "holds -1"),
    ({"t_remote_block_ids": [[5, 5, 6]]}, "names block 5 twice"),
    ({"t_remote_block_ids": [[5, 6]]}, "group 0 has 2 ids"),
    ({"t_remote_block_ids": [[5, 6, 7], [5, 6, 7]]}, "has 2 groups"),
    ({"t_remote_block_ids": [[5, "6", 7]]}, "well-formed NIXL transport"),
    ({"t_remote_engine_id": "prefill-other"}, "is not the handoff's engine"),
    ({"t_remote_request_id": "another"}, "remote_request_id is not"),
    ({"t_remote_num_tokens": 10_000}, "remote_num_tokens is 10000"),
    ({"t_remote_port": 70_000}, "remote_port is 70000"),
    ({"t_tp_size": 1 << 40}, "tp_size is"),
    ({"t_remote_blocks_expiry_time": float("inf")}, "remote_blocks_expiry_time is inf"),
    ({"exported_at": time.time() + 3600}, "in this engine's future"),
    ({"lease_expires_at": time.time() + 10 * 3600}, "beyond the longest lease"),
]


@pytest.mark.parametrize("fields,words", CASES, ids=[c[1] for c in CASES])
def test_a_malformed_handoff_is_refused_at_admission_and_p_is_not_contacted(
        model_dir, fingerprint, fields, words):
    scheduler = make_scheduler(model_dir)
    req = make_import_request(PARENT + [7, 8], _params(fingerprint, **fields))
    info = reject_at_admission(scheduler, req, notify_p=False)
    assert info["reason"] == "malformed", info
    assert words in info["error"], info["error"]


def test_control_without_the_check_the_out_of_range_ids_reach_the_read(
        model_dir, fingerprint, monkeypatch):
    """The control: the same out-of-range handoff, the geometry check taken out of the
    admission: admitted, and its READ of blocks P does not have is scheduled."""
    import connector.admission

    params = _params(fingerprint, t_remote_block_ids=[[1_000_000, 1_000_001, 1_000_002]])
    monkeypatch.setattr(connector.admission, "check_geometry", lambda *a, **k: None)
    scheduler = make_scheduler(model_dir)
    req = make_import_request(PARENT + [7, 8], params)
    scheduler.add_request(req)
    out = scheduler.schedule()
    recv = out.kv_connector_metadata.reqs_to_recv
    assert req.request_id in recv and recv[req.request_id].remote.block_ids == [
        [1_000_000, 1_000_001, 1_000_002]]


def test_a_well_formed_handoff_is_admitted(model_dir, fingerprint):
    scheduler = make_scheduler(model_dir)
    req = make_import_request(PARENT + [7, 8], _params(fingerprint))
    scheduler.add_request(req)
    out = scheduler.schedule()
    assert req.request_id in out.kv_connector_metadata.reqs_to_recv


def test_the_worker_finds_ids_beyond_ps_handshake():
    """The worker's check, before it posts a READ: P's pool as P's handshake gave it."""
    from connector.nixl_worker import ContinuationConnectorWorker

    worker = SimpleNamespace(dst_num_blocks={"p": 64})

    def meta(*groups):
        return SimpleNamespace(remote=SimpleNamespace(engine_id="p", block_ids=list(groups)))

    outside = ContinuationConnectorWorker._outside_remote_pool
    assert outside(worker, meta([1, 2, 63])) is None
    assert outside(worker, meta([1, 64])) == 64
    assert outside(worker, meta([3], [-1])) == -1
    # No handshake yet: nothing to check against (the READ waits for it).
    assert outside(SimpleNamespace(dst_num_blocks={}), meta([10**9])) is None


class _Yes:
    """An engine that answers every call OK: what the corpus exists to catch."""

    def __init__(self, handoff):
        self.handoff = handoff

    def GetCapacity(self, *a, **k):
        return SimpleNamespace(handoff_target="d")

    def Stage1(self, *a, **k):
        return [SimpleNamespace(handoff=self.handoff, new_token_ids=[5])]

    def Stage2(self, *a, **k):
        return SimpleNamespace(beams=[SimpleNamespace(token_ids=[1, 2])])

    def Release(self, *a, **k):
        return None

    Stop = Abort = Release


def test_corpus_control_an_engine_that_takes_everything_fails_it():
    """The corpus's own negative control: against an engine that accepts every malformed
    call, nearly every case is reported, by name."""
    from kvhandoff.v1 import common_pb2
    from tools.fuzz import Corpus
    from tools.fuzz_cases import Context

    handoff = common_pb2.Handoff(request_id="r", lease_expires_at=time.time() + 60,
                                 num_parent_tokens=4, num_computed_tokens=3)
    handoff.remote_block_ids.add(ids=[1])
    stub = _Yes(handoff)
    corpus = Corpus(stub, stub, prompt=[5, 6, 7], suffix=[8], secret=None,
                    ctx=Context(nobody_port=1, vocab_size=100))
    report = corpus.run(0, seed=1)
    assert report.by_code == {"OK": report.sent}
    refused_cases = [c for c in report.failures if "block ids out of P's pool" in c]
    assert refused_cases and len(report.failures) > 0.8 * report.sent, report.failures[:5]

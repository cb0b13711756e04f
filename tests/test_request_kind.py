"""A request's kind to the connector (``connector.request_kind``): read once from the
parameters it arrived with, in the order the connector tries them."""

from __future__ import annotations

import types

from connector.params import BEAM_KEY, BLEND_KEY, REEXPORT_KEY
from connector.request_kind import RequestKind, RequestKinds, classify


def test_each_kind_from_its_parameters_and_the_first_wins():
    fork = {BEAM_KEY: {"fork_from": "p"}}
    assert classify(fork, fork_enabled=True) is RequestKind.FORK_CHILD
    # Without beam fork the same request computes its tokens: plain.
    assert classify(fork, fork_enabled=False) is RequestKind.PLAIN
    assert classify({BLEND_KEY: {"parts": []}, "do_remote_decode": True},
                    True) is RequestKind.BLEND
    assert classify({REEXPORT_KEY: True, "do_remote_prefill": True}, True) is RequestKind.MOVED
    assert classify({"do_remote_prefill": True}, True) is RequestKind.IMPORT
    assert classify({"do_remote_decode": True}, True) is RequestKind.EXPORT
    assert classify(None, True) is RequestKind.PLAIN
    assert classify({**fork, BLEND_KEY: {"parts": []}}, True) is RequestKind.FORK_CHILD


def test_a_kind_stays_what_it_was_when_first_seen_until_forgotten():
    kinds = RequestKinds(fork_enabled=True)
    request = types.SimpleNamespace(request_id="m", kv_transfer_params={
        REEXPORT_KEY: True, "do_remote_prefill": True})
    assert kinds.of(request) is RequestKind.MOVED
    # vLLM queues the READ, the connector turns the request into an export: same kind.
    request.kv_transfer_params.update(do_remote_prefill=False, do_remote_decode=True)
    assert kinds.of(request) is RequestKind.MOVED
    kinds.forget("m")
    assert kinds.of(request) is RequestKind.MOVED  # classified again: still a move
    request.kv_transfer_params.pop(REEXPORT_KEY)
    kinds.forget("m")
    assert kinds.of(request) is RequestKind.EXPORT

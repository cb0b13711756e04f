"""What a request is to the connector's scheduler side, classified once, from the
``kv_transfer_params`` it arrived with, and read from then on.

A kind is not a state: an import's READ being queued (vLLM clears ``do_remote_prefill``),
a moved stage 1 turning into an export, a beam slot waiting for its group
(``WAIT_KEY``) change while the request lives, and are read where they matter. The
kinds are exclusive; where parameters name several, the first below wins (the order in
which the connector has always tried them).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from connector.params import BEAM_KEY, BLEND_KEY, REEXPORT_KEY

if TYPE_CHECKING:
    from vllm.v1.request import Request


class RequestKind(enum.Enum):
    #: Copies the partial last block of a kept request (``connector.beam_fork``): a beam
    #: step, or a continuation of a parent held on its own engine.
    FORK_CHILD = "fork_child"
    #: A stage 1 composed approximately from held chunks (``connector.blend``), exported
    #: or not.
    BLEND = "blend"
    #: Imports another P's export of its tokens so far, then exports its own (a move).
    MOVED = "moved"
    #: Imports P's export (D's stage 2 step 0).
    IMPORT = "import"
    #: A stage 1 exported when it ends.
    EXPORT = "export"
    #: Computed here; nothing imported, exported or copied.
    PLAIN = "plain"


def classify(params: Mapping[str, Any] | None, fork_enabled: bool) -> RequestKind:
    """The kind of a request arriving with ``params`` on an engine that forks beams or
    not (``fork_enabled``)."""
    params = params or {}
    beam = params.get(BEAM_KEY)
    if fork_enabled and beam and beam.get("fork_from"):
        return RequestKind.FORK_CHILD
    if params.get(BLEND_KEY):
        return RequestKind.BLEND
    if params.get(REEXPORT_KEY):
        return RequestKind.MOVED
    if params.get("do_remote_prefill"):
        return RequestKind.IMPORT
    if params.get("do_remote_decode"):
        return RequestKind.EXPORT
    return RequestKind.PLAIN


class RequestKinds:
    """The kinds of the requests the scheduler side has seen, until they finish."""

    def __init__(self, fork_enabled: bool):
        self._fork_enabled = fork_enabled
        self._kinds: dict[str, RequestKind] = {}

    def of(self, request: Request) -> RequestKind:
        """``request``'s kind: classified the first time it is asked for (when vLLM
        announces the request, ``on_new_request``), the same from then on."""
        kind = self._kinds.get(request.request_id)
        if kind is None:
            kind = self._kinds[request.request_id] = classify(request.kv_transfer_params,
                                                              self._fork_enabled)
        return kind

    def forget(self, request_id: str) -> None:
        """The request finished."""
        self._kinds.pop(request_id, None)

"""Running beam searches stopped to move to another engine (``Router.Move`` of a stage
2), the scheduler's part: a part of ``decode_engine.beam_slots.SlotGroups``.

The engine's ``stop`` names a search by its client request id (``connector.params.
STOP_KEY``, with the engine its handoff goes to). From the next step on, its group of
slots is listed in every step's orders (``connector.step_orders.StepOrders.stop_groups``)
until the processor stops it: after the next beam step it decides, the processor
returns the group's state (its completed beams, and every live beam with its tokens and
score: ``GroupResult.stopped``) as if that step had been its last, and the slots end
with it. Slot 0 (the leader) then ends as an export of the search's shared prefix (stage
2's prompt, whose KV every slot holds in the same blocks): its blocks are kept under a
lease and described by a handoff (``connector.exports``) that another engine imports
to resume the search (``decode_engine.beam_move``).

A stop naming a search that runs here but has no group of slots yet (its step 0 runs)
waits for them while the search shows a request (then :data:`STOP_WAIT_S` more, the gap
between step 0 and its slots); a stop naming no search running here is ignored; a group
that ends before the processor sees the stop ends as usual (nothing moved).

Who owns the blocks: the leader's, vLLM's delay-free (the connector's export) until the
importing engine has READ them or the lease ends; the other slots' are freed as they
end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from connector.params import EXPORT_TOKENS_KEY, TARGET_KEY

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from decode_engine.beam_group import Group

logger = logging.getLogger(__name__)

#: How long a stop waits for its search's slots once no request of it is seen (the gap
#: between step 0 and its slots).
STOP_WAIT_S = 5.0


def _runs(request_id: str, requests: Mapping[str, Any]) -> bool:
    """Whether a request of the search ``request_id`` is in the scheduler: its step 0
    (``{id}-s0``) or a slot (``{id}-g:...``; ``decode_engine.beam`` names them)."""
    prefixes = (f"{request_id}-s0", f"{request_id}-g:")
    return any(rid.startswith(prefixes) for rid in requests)


class SearchStops:
    """The stops asked for and not yet matched to a group (module docstring)."""

    def __init__(self) -> None:
        #: Client request id -> (the engine its handoff goes to, until when it waits).
        self._pending: dict[str, tuple[str, float]] = {}

    def ask(self, stops: dict[str, str], requests: Mapping[str, Any]) -> None:
        """The engine's stop: client request id -> the engine id its handoff goes to
        ("": none named). A stop naming no search running here (``requests``: the
        scheduler's) is dropped at once: a later request may reuse the id."""
        deadline = time.monotonic() + STOP_WAIT_S
        for rid, target in stops.items():
            if _runs(rid, requests):
                self._pending[rid] = (target, deadline)
            else:
                logger.info("Stop of %s ignored: no search of that id runs here", rid)

    def match(self, groups: dict[str, Group], requests: Mapping[str, Any]) -> None:
        """Each step: the stops asked for go to their searches' groups of slots; one
        whose search shows no request for :data:`STOP_WAIT_S` is dropped (it ended
        before its slots)."""
        if not self._pending:
            return
        now = time.monotonic()
        for name, group in groups.items():
            if group.members == 1 or group.result is not None or group.error:
                continue
            rid = name.split("-g:", 1)[0]
            asked = self._pending.pop(rid, None)
            if asked is not None:
                group.stop_to = asked[0]
                logger.info("Stopping beam group %s at its next step, to move it", name)
        for rid, (target, until) in list(self._pending.items()):
            if _runs(rid, requests):
                self._pending[rid] = (target, now + STOP_WAIT_S)
            elif until <= now:
                logger.info("Stop of %s dropped: its search ran no slots within %.0f s",
                            rid, STOP_WAIT_S)
                del self._pending[rid]

    @staticmethod
    def stopping(groups: dict[str, Group]) -> list[str]:
        """This step's order: the groups to stop (asked, still searching)."""
        return [name for name, group in groups.items()
                if group.stop_to is not None and group.result is None and not group.error]

    @staticmethod
    def export(group: Group, leader: Request | None) -> None:
        """The processor stopped ``group``: its leader ends as an export of the shared
        prefix (its first ``group.shared_tokens`` tokens), addressed to the engine the
        stop named."""
        if leader is None:
            group.error = "its slot 0 ended before the group was stopped"
            return
        params = leader.kv_transfer_params = dict(leader.kv_transfer_params or {})
        params["do_remote_decode"] = True
        params[EXPORT_TOKENS_KEY] = group.shared_tokens
        if group.stop_to:
            params[TARGET_KEY] = group.stop_to

"""P's scheduler: vLLM's, plus stopping a running request at its next token (a move)
and admitting a moved stage 1's import up front (``connector.admission``).

Loaded by vLLM in P's engine-core process (``scheduler_cls``, ``engine.config``). A
request named by the connector's stop list (``connector.params.STOP_KEY``, carried by
the engine's ``stop`` request) gets ``max_tokens`` = the tokens it has plus one: vLLM's
own length check ends it after its next token, as if it had asked for that many, so a
request started with ``export`` ends exactly as a finished stage 1 does: its blocks (the
partial last block included) are kept under a lease and described by a handoff, and
another engine can continue it from there. A stop may address that handoff to another
engine than the one the request named (``connector.params.RETARGET_KEY``: a move to
another P).
"""

from __future__ import annotations

import logging

from connector.admission import AdmissionScheduler
from connector.params import TARGET_KEY
from decode_engine.beam_slots import SlotGroups

logger = logging.getLogger(__name__)


class PrefillScheduler(AdmissionScheduler):
    pool_name = "prefill"
    # The colocated path's beam search runs on P.
    hooks = (SlotGroups.for_scheduler,)

    def schedule(self, *args, **kwargs):
        connector = getattr(self.connector, "connector_scheduler", None)
        stops = connector.take_stops() if connector is not None else {}
        if stops:
            self._stop_at_next_token(stops)
        return super().schedule(*args, **kwargs)

    def _stop_at_next_token(self, stops: dict[str, str]) -> None:
        """``stops``: client request id -> the engine to address its handoff to ("":
        the one it named)."""
        for request_id, request in self.requests.items():
            # vLLM's internal id is the client's with "-<8 hex>" appended.
            name = request_id if request_id in stops else request_id.rsplit("-", 1)[0]
            if request.is_finished() or name not in stops:
                continue
            request.max_tokens = min(request.max_tokens, request.num_output_tokens + 1)
            target = stops[name]
            if target and request.kv_transfer_params is not None:
                request.kv_transfer_params[TARGET_KEY] = target
            logger.info("Stopping %s after its next token (%d sampled so far)%s",
                        request_id, request.num_output_tokens,
                        f", its handoff for {target}" if target else "")

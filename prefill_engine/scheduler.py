"""P's scheduler: vLLM's, plus stopping a running request at its next token (a move).

Loaded by vLLM in P's engine-core process (``scheduler_cls``, ``engine.config``). A
request named by the connector's stop list (``connector.handoff.STOP_KEY``, carried by
the engine's ``stop`` request) gets ``max_tokens`` = the tokens it has plus one: vLLM's
own length check ends it after its next token, as if it had asked for that many, so a
request started with ``export`` ends exactly as a finished stage 1 does: its blocks (the
partial last one included) are kept under a lease and described by a handoff, and
another engine can continue it from there.
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)


class PrefillScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        connector = getattr(self.connector, "connector_scheduler", None)
        names = connector.take_stops() if connector is not None else set()
        if names:
            self._stop_at_next_token(names)
        return super().schedule(*args, **kwargs)

    def _stop_at_next_token(self, names: set[str]) -> None:
        # vLLM's internal id is the client's with "-<8 hex>" appended.
        for request_id, request in self.requests.items():
            if request.is_finished() or not (
                    request_id in names or request_id.rsplit("-", 1)[0] in names):
                continue
            request.max_tokens = min(request.max_tokens, request.num_output_tokens + 1)
            logger.info("Stopping %s after its next token (%d sampled so far)",
                        request_id, request.num_output_tokens)

"""D's scheduler: vLLM's, admitting each stage-2 import up front (``connector.admission``),
with beam search inside the engine (its groups of slots: ``decode_engine.beam_slots``).

Selected with ``scheduler_cls="decode_engine.scheduler.ContinuationScheduler"``; it runs
in D's engine-core process. A search the engine's ``stop`` names stops after its next
beam step, to move (``decode_engine.search_stops``).
"""

from __future__ import annotations

from connector.admission import AdmissionScheduler
from connector.step_orders import ContinuationMetadata
from decode_engine.beam_slots import SlotGroups


class ContinuationScheduler(AdmissionScheduler):
    pool_name = "decode"
    hooks = (SlotGroups.for_scheduler,)

    def schedule(self, *args, **kwargs):
        """vLLM's step, with the searches asked to stop (the engine's ``stop``: a move)
        handed to the beam groups, and the groups to stop in this step's orders
        (``decode_engine.search_stops``)."""
        groups = self._hooks[0]
        assert isinstance(groups, SlotGroups)
        connector = getattr(self.connector, "connector_scheduler", None)
        stops = connector.take_stops() if connector is not None else {}
        if stops:
            groups.stops.ask(stops, self.requests)
        output = super().schedule(*args, **kwargs)
        stopping = groups.stopping()
        meta = output.kv_connector_metadata
        if stopping and isinstance(meta, ContinuationMetadata):
            meta.orders.stop_groups = stopping
        return output

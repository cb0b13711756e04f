"""D's scheduler: vLLM's, admitting each stage-2 import up front (``connector.admission``),
with beam search inside the engine (its groups of slots: ``decode_engine.beam_slots``).

Selected with ``scheduler_cls="decode_engine.scheduler.ContinuationScheduler"``; it runs
in D's engine-core process.
"""

from __future__ import annotations

from connector.admission import AdmissionScheduler
from decode_engine.beam_slots import SlotGroups


class ContinuationScheduler(AdmissionScheduler):
    pool_name = "decode"
    hooks = (SlotGroups.for_scheduler,)

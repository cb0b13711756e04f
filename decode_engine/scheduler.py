"""D's scheduler: vLLM's, admitting each stage-2 import up front (``connector.admission``).

Selected with ``scheduler_cls="decode_engine.scheduler.ContinuationScheduler"``; it runs
in D's engine-core process.
"""

from __future__ import annotations

from connector.admission import AdmissionScheduler


class ContinuationScheduler(AdmissionScheduler):
    pool_name = "decode"

"""D's scheduler: vLLM's, admitting each stage-2 import up front (``connector.admission``).

Selected with ``scheduler_cls="decode_engine.scheduler.ContinuationScheduler"``; it runs
in D's engine-core process.
"""

from __future__ import annotations

from connector.admission import AdmissionScheduler
from kvhandoff.heap import start_from_env


class ContinuationScheduler(AdmissionScheduler):
    pool_name = "decode"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        start_from_env("decode-core")  # the engine core's heap, when asked (a diagnostic)

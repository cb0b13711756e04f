"""What the connector's worker sends its scheduler each step beside the KV transfers
(vLLM's connector worker metadata): the records of the beam groups run in this step.

Their writer is the beam processor (``decode_engine.beam_processor``), a logits processor
vLLM builds itself, by class path, in each worker process, with only ``(vllm_config,
device, is_pin_memory)``; the connector's worker is built by vLLM too, and neither is
handed the other. They meet here, in the one registry of this worker process,
:data:`OUTBOX`: the connector's worker opens each step's metadata, the processor posts
into it during sampling. This module knows nothing of what a record says.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

logger = logging.getLogger(__name__)


class BeamStepMeta(KVConnectorWorkerMetadata):
    """One step's records, by group: ``{"step": k, "parents": [...], "select_ms": t}``
    (``t``: the processor's time on the group), plus ``"result"`` at the group's last
    step, or ``{"step": k, "error": why}``."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, Any]] = {}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel workers see the same logits and decide the same.
        if isinstance(other, BeamStepMeta):
            for group, record in other.groups.items():
                self.groups.setdefault(group, record)
        return self


class Outbox:
    """This worker process's hand-over from the processor to the connector worker: the
    metadata of the step being run, while any group is active here."""

    def __init__(self) -> None:
        self.active = False  # set by the processor: slots are in the batch
        self._current: BeamStepMeta | None = None
        #: Set by the connector worker from each step's orders: the groups the
        #: processor stops after their next step, to move them
        #: (``decode_engine.search_stops``).
        self.stopping: frozenset[str] = frozenset()

    def open_step(self) -> BeamStepMeta | None:
        """The connector worker, once per step (``build_connector_worker_meta``); None
        while no group runs here."""
        self._current = BeamStepMeta() if self.active else None
        return self._current

    def post(self, group: str, record: dict[str, Any]) -> None:
        if self._current is None:
            # Cannot happen with the connector loaded; the scheduler sees the step
            # missing and ends the group.
            logger.error("Beam group %s: no step metadata to post step %s to", group,
                         record.get("step"))
            return
        self._current.groups[group] = record


#: The registry (module docstring): one per worker process.
OUTBOX = Outbox()

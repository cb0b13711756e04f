"""What the connector's scheduler side tells its worker each step, beside vLLM's NIXL
metadata: one typed record, :class:`StepOrders`, carried by :class:`ContinuationMetadata`
(vLLM's ``NixlConnectorMetadata`` with that one declared field). The scheduler side
(``connector.nixl_scheduler``) is its one writer, the worker (``connector.nixl_worker``)
its one reader; the lists in it are the worker's from the step it arrives in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata


@dataclass(slots=True)
class BlendCopies:
    """An approximate composition's token copies (``connector.blend``): flat slot lists
    (block * block_size + offset) and each token's position delta; ``rotate`` False only
    under the ``unrotated`` fault."""

    source_slots: list[int]
    dest_slots: list[int]
    deltas: list[int]
    rotate: bool = True


@dataclass(slots=True)
class StepOrders:
    """One step's orders, each acted on by the worker before the forward pass (the
    holds and releases of exports after vLLM's own metadata is applied)."""

    #: Beam fork (``connector.beam_fork``): (source block, child block) copies, kept
    #: requests' slots included (``connector.admission``'s hooks append theirs) ...
    fork_copies: list[tuple[int, int]] = field(default_factory=list)
    #: ... and the kept requests released (vLLM's internal ids), reported as sent.
    fork_release: list[str] = field(default_factory=list)
    #: Approximate compositions' token copies (``connector.blend``).
    blend: list[BlendCopies] = field(default_factory=list)
    #: Fault injection only (``connector.faults``): request id -> the decode-worker fault
    #: its READ gets, and exported blocks to overwrite ("stale").
    faults: dict[str, str] = field(default_factory=dict)
    scribble: list[int] = field(default_factory=list)
    #: P: exports held for their whole lease, and held exports whose lease ends now.
    hold: list[str] = field(default_factory=list)
    unhold: list[str] = field(default_factory=list)
    #: Beam groups to stop after their next beam step, to move
    #: (``decode_engine.search_stops``): sent every step until the processor stops them.
    stop_groups: list[str] = field(default_factory=list)


class ContinuationMetadata(NixlConnectorMetadata):
    """vLLM's NIXL metadata for one step plus :class:`StepOrders`. vLLM's NIXL scheduler
    builds its metadata itself (no factory to override), so this one is made from it:
    the same fields, and ``orders``."""

    def __init__(self, stock: NixlConnectorMetadata | None = None,
                 orders: StepOrders | None = None):
        super().__init__()
        if stock is not None:
            vars(self).update(vars(stock))
        self.orders: StepOrders = orders if orders is not None else StepOrders()

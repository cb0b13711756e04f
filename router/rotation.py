"""Which engines this router has drained (Router.Drain): no new work goes to them, the
work on them finishes or moves. :class:`Rotation` is what the move desk needs of it;
:class:`LocalRotation` keeps it in this process, on the endpoints themselves
(``Endpoint.draining``, read by every pick). Another store, shared by several routers,
may stand in: it writes the same flag on each router's endpoints."""

from __future__ import annotations

from typing import Protocol

from router.endpoint import Endpoint


class Rotation(Protocol):
    """Drains, by engine. Answers at once (no await)."""

    def drain(self, ep: Endpoint) -> None:
        """No new work goes to ``ep`` from now on."""
        ...

    def undo(self, ep: Endpoint) -> None:
        """``ep`` takes new work again."""
        ...

    def is_drained(self, ep: Endpoint) -> bool: ...


class LocalRotation:
    """:class:`Rotation` in this process."""

    def drain(self, ep: Endpoint) -> None:
        ep.draining = True

    def undo(self, ep: Endpoint) -> None:
        ep.draining = False

    def is_drained(self, ep: Endpoint) -> bool:
        return ep.draining

"""Where a request runs: small parts in a row, the shape of llm-d's endpoint picker.

Filters keep the engines that may take it (in rotation and not drained; room for it);
scorers value each in tokens (the prefill a cached prefix saves, the work queued ahead
of it); the picker takes the best, ties to the one with fewer requests outstanding, then
the first listed. Without cache information every engine scores its queue alone, which
is the router's placement before the cache was known: the fewest outstanding first.

The stated rule: an outstanding request counts as ``LOAD_TOKENS`` tokens of work, so an
engine is worth one more request in its queue only for at least that many cached tokens
of the prompt (a full P is not chosen for a few cached blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from router.errors import grpc_error

#: What one outstanding request weighs against cached tokens.
LOAD_TOKENS = 512

Filter = Callable[[Any], bool]
Scorer = Callable[[Any], float]


def takes_work(ep: Any) -> bool:
    return bool(ep.takes_work)


def not_excluded(excluded: Any) -> Filter:
    return lambda ep: ep is not excluded


def has_catalog(catalog: str | None) -> Filter:
    """With a catalog: engines that loaded it (its stage 2 runs on the one picked)."""
    if catalog is None:
        return lambda ep: True
    return lambda ep: catalog in ep.capacity.catalogs


def adapters_of(ep: Any) -> list[str]:
    """The LoRA adapters an engine serves (``Capacity.adapters``)."""
    return [a.name for a in getattr(ep.capacity, "adapters", ())]


def serves_adapter(adapter: str) -> Filter:
    """With an adapter: engines that serve it (its KV is valid on no other)."""
    if not adapter:
        return lambda ep: True
    return lambda ep: adapter in adapters_of(ep)


def catalog_widths(capacity: Any, catalog: str | None) -> list[int] | None:
    """The widths by depth of ``catalog`` on an engine (``Capacity.catalog_widths``):
    what ``kvhandoff.budget.live_slots`` needs to count a kept search's slots. None
    with no catalog, or from an engine that does not say (W slots are counted)."""
    if catalog is None:
        return None
    for widths in getattr(capacity, "catalog_widths", ()):
        if widths.name == catalog:
            return list(widths.nodes_at_depth)
    return None


def cached_prefix(cached_blocks: Callable[[Any], int], block_size: Callable[[Any], int]
                  ) -> Scorer:
    """Tokens of the prompt the engine holds in its prefix cache."""
    return lambda ep: float(cached_blocks(ep) * block_size(ep))


def queue(load_tokens: int = LOAD_TOKENS) -> Scorer:
    """The work ahead of it: ``load_tokens`` per request outstanding."""
    return lambda ep: -float(ep.outstanding * load_tokens)


def decode_rank(held: Scorer | None) -> Callable[[Any], tuple[float, int, int]]:
    """A D's rank among those with room for a stage 2 (higher first). By load (``held``
    None: no cache information, or not for every candidate: a missing index degrades to
    this): the most room, then the fewest outstanding. With ``held`` (the prompt's
    tokens it holds): those against its queue by stage 1's rule (``queue``), then room.
    On D a cached block saves a READ, not compute: a busy D is a poor trade for it."""
    if held is None:
        return lambda ep: (0.0, ep.num_unclaimed_blocks, -ep.outstanding)
    waiting = queue()
    return lambda ep: (held(ep) + waiting(ep), ep.num_unclaimed_blocks, -ep.outstanding)


@dataclass(frozen=True)
class Picker:
    filters: tuple[Filter, ...]
    scorers: tuple[Scorer, ...]

    def ranked(self, endpoints: Sequence[Any]) -> list[tuple[float, Any]]:
        """The kept endpoints with their scores, best first (ties: fewer outstanding,
        then the order given)."""
        kept = [ep for ep in endpoints if all(f(ep) for f in self.filters)]
        scored = [(sum(s(ep) for s in self.scorers), i, ep) for i, ep in enumerate(kept)]
        scored.sort(key=lambda t: (-t[0], t[2].outstanding, t[1]))
        return [(score, ep) for score, _, ep in scored]

    def pick(self, endpoints: Sequence[Any]) -> Any | None:
        ranked = self.ranked(endpoints)
        return ranked[0][1] if ranked else None


def check_catalog(catalog: str | None, live: Sequence[Any], role: str) -> None:
    """NOT_FOUND when ``catalog`` is one that none of the engines in rotation (``live``,
    when any) loaded."""
    _check_named("catalog", catalog, live, role, lambda ep: ep.capacity.catalogs)


def check_adapter(adapter: str, live: Sequence[Any], role: str) -> None:
    """NOT_FOUND when ``adapter`` is one that none of the engines in rotation serves."""
    _check_named("adapter", adapter, live, role, adapters_of)


def check_servable(catalog: str | None, adapter: str, live: Sequence[Any], role: str) -> None:
    """NOT_FOUND unless some engine in rotation has ``catalog``, some serves ``adapter``,
    and one does both."""
    check_catalog(catalog, live, role)
    check_adapter(adapter, live, role)
    check_catalog_with_adapter(catalog, adapter, live, role)


def check_catalog_with_adapter(catalog: str | None, adapter: str, live: Sequence[Any],
                               role: str) -> None:
    """NOT_FOUND when engines in rotation have ``catalog`` and ``adapter`` but none has
    both (each checked alone first by :func:`check_catalog` and :func:`check_adapter`)."""
    if not catalog or not adapter or not live:
        return
    if not any(catalog in ep.capacity.catalogs and adapter in adapters_of(ep) for ep in live):
        raise grpc_error(grpc.StatusCode.NOT_FOUND,
                         f"no {role} engine has both catalog {catalog!r} and adapter "
                         f"{adapter!r} (the catalog is on "
                         f"{', '.join(ep.address for ep in live if catalog in ep.capacity.catalogs)}"
                         f"; the adapter on "
                         f"{', '.join(ep.address for ep in live if adapter in adapters_of(ep))})")


def _check_named(what: str, name: str | None, live: Sequence[Any], role: str,
                 names_of: Callable[[Any], Sequence[str]]) -> None:
    if not name or not live:
        return
    if not any(name in names_of(ep) for ep in live):
        theirs = sorted({n for ep in live for n in names_of(ep)})
        raise grpc_error(grpc.StatusCode.NOT_FOUND,
                         f"no {role} engine has {what} {name!r} (theirs: "
                         f"{', '.join(theirs) or 'none'}; engines load them with "
                         f"--{what} NAME=PATH)")

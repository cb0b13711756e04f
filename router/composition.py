"""What a request's ``chunk_ids`` resolve to (``router.chunks``): an exact chain, or an
approximate composition of chunks prefilled apart.

Exact: the ids name a registered chain (root first); the prompt starts with the chain's
tokens, which are prefix-cache hits on the chain's P.

Approximate (the request asks for it with a recompute share): the prompt starts with
each chunk's own tokens in the order given, and P copies their KV from the chunks it
holds, keys moved to their new positions (``connector.blend``). The last
``ceil(share * chunk tokens)`` chunk tokens are computed instead of copied (the
prompt's tail: they attend to everything before them, and so does every token after
them); the query after the chunks is always computed. A chunk registered under another
keeps the context it was prefilled with (a chain listed from its root, in order, is
exact where it stands). Every chunk must be held on the same P and under the request's
adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import grpc

from connector.blend_spec import Blend, BlendPart
from router.errors import adapter_named, grpc_error


@dataclass(frozen=True)
class Composition:
    """The chunks a request composes (``ChunkRecord``s, in its order), and with
    ``blend`` how P copies them (None: an exact chain)."""

    chain: tuple[Any, ...]
    blend: Blend | None = None

    @property
    def prefix_ids(self) -> list[int]:
        """The prompt's first tokens: the chain's, or each chunk's own in turn."""
        if self.blend is None:
            return list(self.chain[-1].chain_ids)
        return [t for record in self.chain for t in record.token_ids]

    @property
    def prefill(self) -> Any:
        """The P that holds the chunks (an ``Endpoint``)."""
        return self.chain[-1].prefill


def check_adapter(record: Any, adapter: str, under: bool = False) -> None:
    """FAILED_PRECONDITION unless chunk ``record`` was prefilled under ``adapter`` (its
    KV is that adapter's): a request composing it runs under the same, and so does a
    chunk registered ``under`` it."""
    if record.adapter == adapter:
        return
    named = adapter_named(record.adapter)
    raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION, (
        f"chunk {record.chunk_id!r} was prefilled under {named}: a chunk under it is "
        f"too, not under {adapter_named(adapter)}") if under else (
        f"chunk {record.chunk_id!r} was prefilled under {named}, the request runs "
        f"under {adapter_named(adapter)}"))


def is_chain(records: tuple[Any, ...]) -> bool:
    """Whether ``records`` are a registered chain from its root, in order."""
    return all(r.under == (records[i - 1].chunk_id if i else "")
               for i, r in enumerate(records))


def approximate(records: tuple[Any, ...], share: float, adapter: str) -> Composition:
    """``records`` composed by position with ``share`` of their tokens recomputed; the
    status that says why not (chunks on several Ps, under another adapter)."""
    if not 0.0 <= share <= 1.0:
        raise grpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                         f"recompute_share must be in [0, 1], got {share}")
    first = records[0]
    for record in records:
        if (record.prefill, record.engine_id) != (first.prefill, first.engine_id):
            raise grpc_error(grpc.StatusCode.FAILED_PRECONDITION,
                             f"chunks {first.chunk_id!r} and {record.chunk_id!r} are held "
                             "on different P engines: an approximate composition copies "
                             "from one")
        check_adapter(record, adapter)
    parts, at = [], 0
    for record in records:
        own = len(record.token_ids)
        parts.append(BlendPart(record.held_name, len(record.chain_ids) - own, own, at))
        at += own
    # A share sent as a float32 (0.15 -> 0.150000006) means its six decimals.
    num_loaded = at - math.ceil(round(share, 6) * at - 1e-9)
    return Composition(records, Blend(tuple(parts), num_loaded))

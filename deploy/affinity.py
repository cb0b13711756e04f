"""Which router replica owns an id, when the Router deployment runs several replicas.

A parent (``StartParent``) and a running request live in the router replica that took
them: its registry, its runs. Calls that name one go to the replica that owns the id:
``owner(id, world_size)`` is a replica *rank* (Serve's ``ReplicaContext.rank``, 0 to
``world_size - 1``), fixed by the id alone, so every proxy routes alike and a replica that
Serve replaces takes over its predecessor's rank (the ids of the others stay where they
are; the lost replica's parents are read back from the store every replica shares,
``deploy.shared``). Ids a router replica makes itself are made owned by it
(:func:`owned_id`). :func:`rendezvous` orders D replicas for a parent's continuations."""

from __future__ import annotations

import hashlib
import pickle
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: The router method -> the request field naming the id its replica must own. Calls not
#: listed (Drain, health) and calls whose id is empty go to any replica.
ID_FIELD = {
    "StartParent": "request_id",
    "Continue": "parent_id",
    "ReleaseParent": "parent_id",
    "Move": "request_id",
    "Generate": "request_id",
    "GenerateStream": "request_id",
}


def owner(key: str, world_size: int) -> int:
    """The rank owning ``key`` among ``world_size`` replicas (stable across processes)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % world_size


def rendezvous(key: str, items: list[T], name: Callable[[T], str]) -> list[T]:
    """``items`` in rendezvous (highest-random-weight) order for ``key``, by their
    ``name``: every process ranks them alike with nothing shared, a key keeps its first
    choice while that item is there, and when one goes only its keys move (each to its
    own second). Decode's request router keeps a parent's continuations on one D so."""
    def weight(item: T) -> bytes:
        return hashlib.blake2b(f"{key}|{name(item)}".encode(), digest_size=8).digest()

    return sorted(items, key=weight, reverse=True)


def routing_key(method: str, args: list[Any] | tuple[Any, ...]) -> str:
    """The id a call of ``method`` names ("" when none). ``args[0]`` is the request: the
    message itself (a handle call), or the bytes Serve's gRPC proxy sends its replicas (a
    pickled ``gRPCRequest`` around the message)."""
    field = ID_FIELD.get(method)
    if field is None or not args:
        return ""
    request = args[0]
    if isinstance(request, bytes):
        # The proxy's own pickle of the client's message (proxy_request_response.py).
        request = getattr(pickle.loads(request), "user_request_proto", None)
    return str(getattr(request, field, "") or "")


def owned_id(rank: int, world_size: int, prefix: str = "r") -> str:
    """A new id that ``owner`` maps to ``rank`` (expected ``world_size`` draws)."""
    while True:
        candidate = f"{prefix}-{uuid.uuid4().hex[:12]}"
        if world_size <= 1 or owner(candidate, world_size) == rank:
            return candidate

"""Which transport UCX chose, read from UCX's own protocol tables.

A process started with :func:`ucx_env` (``UCX_PROTO_INFO=y``, ``UCX_LOG_FILE``) writes one
table per protocol UCX selects for a peer: the peer's scope (``self``, ``intra-node``,
``inter-node``), the operation (``remote memory read by ucp_get*`` is a NIXL READ) and,
per message size range, the transport and device (``tcp/eth1``, ``cma/memory``,
``rc_mlx5/mlx5_0:1``). :func:`read_transports` lists what READs from other processes
used; :func:`is_network` says whether a transport crosses a network rather than a
machine's shared memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: Transport families that cross a network (TCP sockets, InfiniBand/RoCE verbs, AWS SRD).
NETWORK_FAMILIES = frozenset({"tcp", "rc", "dc", "ud", "srd"})

_ROW = re.compile(r"\|\s*(\S+)\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|\s*$")
_TITLE = re.compile(r"\|\s*(.*?)\s*\|\s*$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")


@dataclass(frozen=True)
class Protocol:
    #: "self", "intra-node" or "inter-node": where UCX thinks the peer is.
    scope: str
    #: e.g. "remote memory read by ucp_get*(multi) into host memory from host".
    operation: str
    #: Every transport/device a size range of it uses, e.g. ("tcp/eth1",).
    transports: tuple[str, ...]


def ucx_env(log_file: str) -> dict[str, str]:
    """Environment that makes UCX write its protocol tables to ``log_file`` (UCX expands
    ``%p`` to the process id, ``%h`` to the host name)."""
    return {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": log_file}


def protocols(text: str) -> list[Protocol]:
    """The protocol tables in a UCX log (lines may carry UCX's ``[time] [host:pid]``
    prefix)."""
    out: list[Protocol] = []
    titles: list[str] = []
    transports: list[str] = []

    def close() -> None:
        if len(titles) >= 2 and transports:
            scope = next((w for w in ("inter-node", "intra-node", "self")
                          if w in titles[0].split()), "")
            out.append(Protocol(scope, titles[1], tuple(dict.fromkeys(transports))))

    for raw in text.splitlines():
        line = raw[raw.find("|"):] if "|" in raw else raw[raw.find("+"):] if "+" in raw else ""
        if not line:
            continue
        if line.startswith("+"):
            continue
        row = _ROW.match(line)
        if row and row.group(1) != "Range" and (".." in row.group(1) or row.group(1).isdigit()):
            transports.extend(f"{a}/{b}" for a, b in _TRANSPORT.findall(row.group(3)))
            continue
        if row:  # the column header
            continue
        title = _TITLE.match(line)
        if title:
            if "cfg#" in title.group(1):
                close()
                titles, transports = [title.group(1)], []
            else:
                titles.append(title.group(1))
    close()
    return out


def read_transports(text: str) -> set[str]:
    """Transports of READs (``ucp_get``) to other processes (scope not ``self``)."""
    return {t for p in protocols(text)
            if p.scope != "self" and p.operation.startswith("remote memory read")
            for t in p.transports}


def read_transports_in(paths: list[Path]) -> set[str]:
    return set().union(*(read_transports(p.read_text(errors="replace")) for p in paths))


def peer_transports_in(paths: list[Path]) -> set[str]:
    """Transports of every protocol toward other processes (scope not ``self``): the
    local devices a process used to reach its peers."""
    return {t for path in paths for p in protocols(path.read_text(errors="replace"))
            if p.scope != "self" for t in p.transports}


def is_network(transport: str) -> bool:
    """``tcp/eth1`` and ``rc_mlx5/mlx5_0:1`` are; ``cma/memory`` and ``posix/memory``
    (one machine's shared memory) are not."""
    return transport.split("/")[0].split("_")[0] in NETWORK_FAMILIES


def all_network(transports: list[str] | set[str]) -> bool:
    """Some transport was seen, and every one is a network one (``is_network``)."""
    return bool(transports) and all(is_network(t) for t in transports)

"""Separate "hosts" on one machine: Linux network namespaces joined by veth pairs.

``hosts(("p", "d", "r"))`` makes one namespace per name, each with loopback and one veth
interface with an address of a private test subnet, all joined by a bridge that lives in
a hub namespace of its own. Nothing is created in the caller's namespace, and everything
is removed on exit, also when the body raised (deleting a namespace deletes its
interfaces). Needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root): :func:`can_create` says
whether this process may, and why not.

A process runs on a host through ``Host.run_prefix`` (``ip netns exec NAME``): its
sockets see only that namespace's interfaces, so P, D and the router on different hosts
reach each other only over the bridge, as machines on a network would.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

#: The test subnet: it exists only inside the namespaces made here.
SUBNET = "10.213.7"


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    interface: str

    @property
    def run_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def can_create() -> str:
    """"" when network namespaces can be created here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN, CAP_NET_ADMIN)"
    probe = f"kvh{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as e:
        return f"`ip netns add` failed: {getattr(e, 'stderr', '') or e}".strip()
    _ip("netns", "del", probe)
    return ""


@contextlib.contextmanager
def hosts(names: tuple[str, ...], subnet: str = SUBNET) -> Iterator[dict[str, Host]]:
    """One namespace per name, addresses ``subnet.1``, ``.2``, ... in order, joined by a
    bridge in a hub namespace; all removed on exit."""
    tag = f"kvh{os.getpid() % 100000}"
    hub = f"{tag}-hub"
    made: list[str] = []
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        out: dict[str, Host] = {}
        for i, name in enumerate(names, start=1):
            netns = f"{tag}-{name}"
            _ip("netns", "add", netns)
            made.append(netns)
            _ip("-n", netns, "link", "set", "lo", "up")
            # Interface names are at most 15 bytes; the pair is made inside the host's
            # namespace and one end moved to the hub: the caller's namespace is untouched.
            here, there = f"eth{i}", f"{tag[-6:]}h{i}"
            _ip("-n", netns, "link", "add", here, "type", "veth", "peer", "name", there,
                "netns", hub)
            _ip("-n", hub, "link", "set", there, "master", "br0")
            _ip("-n", hub, "link", "set", there, "up")
            address = f"{subnet}.{i}"
            _ip("-n", netns, "addr", "add", f"{address}/24", "dev", here)
            _ip("-n", netns, "link", "set", here, "up")
            out[name] = Host(name, netns, address, here)
        yield out
    finally:
        for netns in reversed(made):
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", netns)

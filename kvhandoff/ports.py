"""Ports for servers that another process binds later (engines, routers, side channels).
Light: standard library only."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

#: Lowest port :func:`free_port` picks: Ray's worker ports are 10002-19999 by default.
FREE_PORT_FLOOR = 20000
#: How long a port :func:`free_port` handed out stays reserved for its owner, across every
#: process of this user on the host: long enough for an engine to start and bind it.
RESERVED_S = 900.0
_ports_handed_out: set[int] = set()


def _reservations() -> Path:
    return Path(tempfile.gettempdir()) / f"kvhandoff-ports-{os.getuid()}"


def _reserve(port: int) -> bool:
    """Claim ``port`` for this process against every other process that calls
    :func:`free_port` on this host (a file created exclusively); a claim older than
    ``RESERVED_S`` is taken over. False when another process holds it."""
    folder = _reservations()
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if time.time() - path.stat().st_mtime < RESERVED_S:
                    return False
                path.unlink()
            except FileNotFoundError:
                pass
    return False


def ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def check_listenable(host: str, port: int, what: str) -> None:
    """Raise RuntimeError naming ``what``, ``host:port`` and why when nothing could listen
    there now (a port in use, an address this host does not have)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ's listener
        try:
            s.bind((host, port))
            s.listen()
        except OSError as e:
            raise RuntimeError(f"{what} cannot listen on {host}:{port} ({e}); start the "
                               "engine with another side-channel port") from e


def port_range() -> tuple[int, int]:
    """Where :func:`free_port` picks: ``$KVHANDOFF_PORT_RANGE`` (``LOW-HIGH``, e.g. each
    of several test sessions side by side its own), else from ``FREE_PORT_FLOOR`` up to
    the kernel's ephemeral range."""
    value = os.environ.get("KVHANDOFF_PORT_RANGE")
    if value:
        low, high = (int(part) for part in value.split("-"))
        return low, high
    return FREE_PORT_FLOOR, ephemeral_floor()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, for a server another process will bind later.

    Chosen at random below the kernel's ephemeral range, so no socket the kernel numbers
    itself (a bind to port 0, an outgoing connection) can take it before its owner binds:
    an engine binds its NIXL side channel tens of seconds after the port is chosen, and a
    side-channel port taken in between once left a D waiting for its listener forever.
    Never the same port twice within ``RESERVED_S`` on this host, whichever process asks
    (a file per port under the temp folder): two processes of one test lane once chose
    the same port, and the second engine to bind it could not start.
    """
    rng = random.SystemRandom()  # not the random module: tests seed it identically
    low, high = port_range()
    for _ in range(200 if high - low >= 1000 else 0):
        port = rng.randrange(low, high)
        if port in _ports_handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if not _reserve(port):
            continue
        _ports_handed_out.add(port)
        return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address or ``localhost`` (any other name or
    address may be reached from elsewhere)."""
    import ipaddress

    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False

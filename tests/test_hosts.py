"""Separate network hosts on this machine (tools/netns.py): the plumbing issue 20's
cross-host handoffs stand on. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools.netns import can_create, hosts

pytestmark = [pytest.mark.hosts]

#: Bytes of the plain TCP copy between two hosts (a probe of the link, not a benchmark).
COPY_BYTES = 64 << 20

_SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 47001)); s.listen(1); print("listening", flush=True)
c, peer = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, peer[0], time.perf_counter() - t0, flush=True)
"""

_CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], 47001), timeout=10)
buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[2]) >> 20): c.sendall(buf)
c.close()
"""


@pytest.fixture
def two_hosts():
    why = can_create()
    if why:
        pytest.skip(why)
    with hosts(("p", "d")) as made:
        yield made


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_two_hosts_talk_over_their_link_and_only_there(two_hosts):
    """P's host sends 64 MiB to D's host over TCP: every byte arrives, from P's address.
    Each host has its loopback and its link and no default route (nothing it runs can
    reach beyond the test subnet)."""
    p, d = two_hosts["p"], two_hosts["d"]
    server = subprocess.Popen([*d.run_prefix, sys.executable, "-c", _SERVER, d.address],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        subprocess.run([*p.run_prefix, sys.executable, "-c", _CLIENT, d.address,
                        str(COPY_BYTES)], check=True, timeout=120)
        received, peer, seconds = server.stdout.readline().split()
        server.wait(timeout=30)
    finally:
        server.kill()
    assert int(received) == COPY_BYTES and peer == p.address
    print(f"TCP copy {p.address} -> {d.address}: {COPY_BYTES * 8 / float(seconds) / 1e9:.2f} "
          "Gbit/s")
    for host in (p, d):
        routes = subprocess.run(["ip", "-n", host.netns, "route"], capture_output=True,
                                text=True, check=True).stdout
        assert "default" not in routes and host.address in routes, routes


def test_the_namespaces_go_away_also_when_the_body_fails():
    why = can_create()
    if why:
        pytest.skip(why)
    with pytest.raises(RuntimeError, match="in the body"), hosts(("a", "b")) as made:
        names = {h.netns for h in made.values()}
        assert names <= _netns_names()
        raise RuntimeError("in the body")
    assert not names & _netns_names()
    assert not any(n.endswith("-hub") and n.startswith("kvh") for n in _netns_names())

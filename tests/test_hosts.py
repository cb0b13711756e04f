"""Separate network hosts on this machine (tools/netns.py): the plumbing issue 20's
cross-host handoffs stand on. Skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools.netns import call, can_create, hosts
from tools.nixl_probe import measure_across_hosts
from tools.ucx_report import is_network

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


def _address_of(interface: str) -> str:
    import socket

    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", interface],
                         capture_output=True, text=True, check=True).stdout
    return out.split()[3].split("/")[0] + " " + socket.gethostname()


def test_a_function_called_on_a_host_sees_that_host_only(two_hosts):
    """tools.netns.call: the child is on the host (its interface, its address), and an
    error there comes back here naming the function and the host."""
    d = two_hosts["d"]
    assert call(d, _address_of, d.interface).split()[0] == d.address
    with pytest.raises(RuntimeError, match=r"_address_of on d: .*eth9"):
        call(d, _address_of, "eth9")


def test_a_nixl_read_across_hosts_goes_over_tcp_and_the_check_sees_shared_memory(
        two_hosts, tmp_path):
    """A raw NIXL READ of 16 MiB from P's host to D's host, UCX_TLS=tcp as the hosts mode
    runs engines: every byte arrives (the probe checks) and UCX's own tables say it went
    by TCP on D's link. Negative control: left to itself, UCX sees one machine (same
    kernel) and reads through shared memory (cma), which the check refuses."""
    p, d = two_hosts["p"], two_hosts["d"]
    over_tcp = measure_across_hosts(p, d, 16 << 20, tmp_path, ucx_tls="tcp", repeats=1)
    assert over_tcp["read_transports"] == [f"tcp/{d.interface}"], over_tcp
    assert all(is_network(t) for t in over_tcp["read_transports"])
    chosen = measure_across_hosts(p, d, 16 << 20, tmp_path, ucx_tls=None, repeats=1)
    assert chosen["read_transports"] and not all(is_network(t)
                                                 for t in chosen["read_transports"]), chosen
    print(f"NIXL READ 16 MiB across hosts: {over_tcp['gbps']} GB/s over "
          f"{over_tcp['read_transports']}; {chosen['gbps']} GB/s over "
          f"{chosen['read_transports']} when UCX chooses")

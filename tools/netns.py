"""Separate "hosts" on one machine: Linux network namespaces joined by veth pairs.

``hosts(("p", "d", "r"))`` makes one namespace per name, each with loopback and one veth
interface with an address of a private test subnet, all joined by a bridge that lives in
a hub namespace of its own. Nothing is created in the caller's namespace, and everything
is removed on exit, also when the body raised (deleting a namespace deletes its
interfaces). Needs CAP_SYS_ADMIN and CAP_NET_ADMIN (root): :func:`can_create` says
whether this process may, and why not.

A process runs on a host through ``Host.run_prefix`` (``ip netns exec NAME``), or moves
itself there with :func:`enter` before it opens any socket (a child made for the purpose:
:func:`call`); its sockets see only that namespace's interfaces, so P, D and the router
on different hosts reach each other only over the bridge, as machines on a network would.
The caller's own namespace never reaches them: a client of a server on a host runs on a
host too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import multiprocessing as mp
import os
import struct
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

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


_T = TypeVar("_T")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def enter(host: Host) -> None:
    """Move this process onto ``host``, as ``ip netns exec`` does: its network namespace,
    and a private mount namespace whose ``/sys`` shows that host's interfaces (UCX finds
    its devices there). Call it first thing in a fresh, single-threaded process: sockets
    opened afterwards, also by threads started afterwards, are on that host."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(ret: int, what: str) -> None:
        if ret != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (entering {host.netns}): {os.strerror(err)}")

    with open(f"/run/netns/{host.netns}") as f:
        check(libc.setns(f.fileno(), _CLONE_NEWNET), "setns")
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"", b"/", b"none", _MS_SLAVE | _MS_REC, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(host.netns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _call_child(host: Host, env: dict[str, str], fn: Callable[..., Any], args: tuple,
                conn: Any) -> None:
    enter(host)
    os.environ.update(env)
    try:
        conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - handed to the caller, who raises it
        conn.send((False, f"{type(e).__name__}: {e}"))


def call(host: Host, fn: Callable[..., _T], *args: Any, env: dict[str, str] | None = None,
         timeout_s: float = 600.0) -> _T:
    """``fn(*args)`` in a fresh process on ``host`` (with ``env`` added to its environment),
    its result returned here (it must pickle); its exception is raised here as a
    RuntimeError naming it. The child is killed if it has not answered in ``timeout_s``."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call_child, args=(host, env or {}, fn, args, child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {host.name} did not answer "
                               f"in {timeout_s:.0f}s")
        ok, value = parent.recv()
    except EOFError:
        proc.join(5)
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} on {host.name} exited "
                           f"({proc.exitcode}) without an answer") from None
    finally:
        if proc.is_alive():
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} on {host.name}: {value}")
    return value


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
def hosts(names: tuple[str, ...], subnet: str = SUBNET, *,
          offload: bool = True) -> Iterator[dict[str, Host]]:
    """One namespace per name, addresses ``subnet.1``, ``.2``, ... in order, joined by a
    bridge in a hub namespace; all removed on exit. ``offload=False``: the hosts'
    interfaces send one packet per buffer (``gso_max_segs 1``) from the start, so that
    :func:`packet_loss` drops packets also on connections opened before it (a socket keeps
    the segmentation limit of its first route)."""
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
            if not offload:
                _ip("-n", netns, "link", "set", here, "gso_max_segs", "1")
            _ip("-n", netns, "link", "set", here, "up")
            out[name] = Host(name, netns, address, here)
        yield out
    finally:
        for netns in reversed(made):
            with contextlib.suppress(subprocess.CalledProcessError, OSError):
                _ip("netns", "del", netns)


def _drop_program(percent: int) -> bytes:
    """eBPF for a tc classifier in direct-action mode: ``return prandom() % 100 < percent
    ? TC_ACT_SHOT : TC_ACT_OK``. Instructions are ``struct bpf_insn`` (opcode, dst | src
    << 4, offset, immediate)."""
    def insn(code: int, off: int = 0, imm: int = 0) -> bytes:
        return struct.pack("<BBhi", code, 0, off, imm)

    return b"".join([
        insn(0x85, imm=7),           # call bpf_get_prandom_u32 -> r0
        insn(0x97, imm=100),         # r0 %= 100
        insn(0x35, off=2, imm=percent),  # if r0 >= percent: goto pass
        insn(0xB7, imm=2),           # r0 = TC_ACT_SHOT
        insn(0x95),                  # exit
        insn(0xB7, imm=0),           # pass: r0 = TC_ACT_OK
        insn(0x95),                  # exit
    ])


#: The bpf syscall's number (no libc wrapper).
_SYS_BPF = {"x86_64": 321, "aarch64": 280}


def _bpf(cmd: int, attr: bytes) -> int:
    import platform

    number = _SYS_BPF.get(platform.machine())
    if number is None:
        raise OSError(f"packet_loss: the bpf syscall's number on {platform.machine()} is not "
                      "known here")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr + bytes(128 - len(attr)))
    ret = libc.syscall(number, cmd, buf, len(buf.raw))
    if ret < 0:
        raise OSError(ctypes.get_errno(), f"bpf({cmd}): {os.strerror(ctypes.get_errno())}")
    return ret


def _pin_drop_program(percent: int, path: str) -> None:
    code = ctypes.create_string_buffer(_drop_program(percent))
    license_ = ctypes.create_string_buffer(b"GPL")
    # BPF_PROG_LOAD (5): prog_type SCHED_CLS (3), insn_cnt, insns, license.
    fd = _bpf(5, struct.pack("<IIQQ", 3, len(code.raw) // 8, ctypes.addressof(code),
                             ctypes.addressof(license_)))
    try:
        name = ctypes.create_string_buffer(path.encode())
        _bpf(6, struct.pack("<QI", ctypes.addressof(name), fd))  # BPF_OBJ_PIN
    finally:
        os.close(fd)


def _clsact_counts(host: Host) -> tuple[int, int]:
    out = subprocess.run(["tc", "-n", host.netns, "-s", "qdisc", "show", "dev", host.interface],
                         capture_output=True, text=True, check=True).stdout
    stats = out.split("qdisc clsact", 1)[1].split("Sent", 1)[1].split()
    return int(stats[2]), int(stats[5].rstrip(","))  # "X bytes N pkt (dropped D, ..."


@contextlib.contextmanager
def packet_loss(host: Host, percent: int) -> Iterator[Callable[[], tuple[int, int]]]:
    """Until exit, ``host`` drops ``percent`` % of the packets it sends, at random, as a
    lossy link would (TCP retransmits them). ``tc qdisc ... netem loss`` is the usual
    tool, but this kernel has no ``sch_netem`` (nor ``act_gact``, nor iptables): the drop
    is an eBPF program (direct action, ``cls_bpf``) on the egress (``clsact``) of the
    host's interface, pinned for ``tc`` in a bpf file system mounted in a temporary
    directory, all removed on exit. The interface sends one packet per buffer while it
    lasts (``gso_max_segs 1``): with segmentation offload the program would see, and drop,
    64 KiB bursts of ~44 packets at a time, not packets. A connection opened before keeps
    its bursts (its socket took the limit of its route when it connected): for those, make
    the hosts with ``hosts(..., offload=False)``. Yields a function giving (packets sent,
    packets dropped) so far on that interface."""
    if not 0 <= percent <= 100:
        raise ValueError(f"percent must be in [0, 100], not {percent}")
    fs = tempfile.mkdtemp(prefix="kvh-bpffs-")
    tc = ["tc", "-n", host.netns]
    dev = ["dev", host.interface]
    shown = subprocess.run(["ip", "-n", host.netns, "-d", "-j", "link", "show", *dev],
                           capture_output=True, text=True, check=True).stdout
    gso_max_segs = str(json.loads(shown)[0]["gso_max_segs"])
    try:
        _ip("-n", host.netns, "link", "set", *dev, "gso_max_segs", "1")
        subprocess.run(["mount", "-t", "bpf", "bpf", fs], check=True, capture_output=True)
        try:
            program = os.path.join(fs, f"drop{percent}")
            _pin_drop_program(percent, program)
            subprocess.run([*tc, "qdisc", "add", *dev, "clsact"], check=True,
                           capture_output=True)
            try:
                subprocess.run([*tc, "filter", "add", *dev, "egress", "bpf", "da", "pinned",
                                program], check=True, capture_output=True, text=True)
                yield lambda: _clsact_counts(host)
            finally:
                subprocess.run([*tc, "qdisc", "del", *dev, "clsact"], capture_output=True)
        finally:
            subprocess.run(["umount", fs], capture_output=True)
    finally:
        os.rmdir(fs)
        with contextlib.suppress(subprocess.CalledProcessError, OSError):
            _ip("-n", host.netns, "link", "set", *dev, "gso_max_segs", gso_max_segs)


_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("listening", flush=True)
c, peer = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, peer[0], time.perf_counter() - t0, flush=True)
"""

_SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3]) >> 20): c.sendall(buf)
c.close()
"""


def tcp_copy(src: Host, dst: Host, nbytes: int, port: int = 47001) -> tuple[int, str, float]:
    """A plain TCP copy of ``nbytes`` (a multiple of 1 MiB) from ``src`` to ``dst``: the
    bytes received, the peer address ``dst`` saw, and the seconds from the first byte
    received to the last (the link's rate, without connection set-up)."""
    import sys

    sink = subprocess.Popen([*dst.run_prefix, sys.executable, "-c", _SINK, dst.address,
                             str(port)], stdout=subprocess.PIPE, text=True)
    try:
        if sink.stdout.readline().strip() != "listening":
            raise RuntimeError(f"the TCP sink on {dst.name} did not start")
        subprocess.run([*src.run_prefix, sys.executable, "-c", _SOURCE, dst.address, str(port),
                        str(nbytes)], check=True, timeout=300)
        received, peer, seconds = sink.stdout.readline().split()
        sink.wait(timeout=30)
    finally:
        sink.kill()
        sink.wait()
    return int(received), peer, float(seconds)

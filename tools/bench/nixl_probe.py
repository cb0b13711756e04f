"""Raw NIXL READ bandwidth between two processes on this host, against a same-host memory
copy of the same bytes: the physical limit a handoff's transfer is compared with.

A child process registers a buffer and publishes its NIXL metadata; this process READs it
(UCX backend, no progress thread on either side: the reader drives the transfer, the
owner polls its notifications like an engine does). Across hosts (``measure_across_hosts``:
separate network namespaces, tools.netns) both ends run on their hosts and the reader
reports which transport UCX chose."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any


def _owner(size: int, conn: Any, host: Any = None, env: dict[str, str] | None = None) -> None:
    if host is not None:
        from tools.netns import enter

        enter(host)
    os.environ.update(env or {})
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("kvh-probe-owner", nixl_agent_config(enable_prog_thread=False,
                                                            backends=["UCX"]))
    buf = np.ones(size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    descs = agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(descs), buf.ctypes.data))
    while not conn.poll(0.0005):
        agent.get_new_notifs()  # also progresses UCX: a READ over TCP needs the owner's
    conn.recv()


def _timed_reads(agent: Any, local: Any, remote: Any, remote_name: str, repeats: int
                 ) -> list[float]:
    """Seconds of each of ``repeats`` READs of ``remote`` into ``local`` (after one
    untimed READ: the first sets up the connection)."""
    times = []
    for i in range(repeats + 1):
        handle = agent.initialize_xfer("READ", local, remote, remote_name)
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended in {state}")
        if i:
            times.append(elapsed)
    return times


def _reader(name: str, size: int) -> tuple[Any, Any]:
    import numpy as np
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"{name}-{os.getpid()}",
                       nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = np.zeros(size, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, size, 0, "")], "DRAM")
    return agent, buf


def _read(owner: tuple, size: int, repeats: int, num_descriptors: int) -> float:
    """Best GB/s of ``repeats`` READs of the owner's buffer."""
    import numpy as np

    meta, serialized, remote_addr = owner
    agent, buf = _reader("kvh-probe-reader", size)
    remote_name = agent.add_remote_agent(meta)
    if num_descriptors == 1:
        local = agent.get_xfer_descs([(buf.ctypes.data, size, 0)], "DRAM")
        remote = agent.deserialize_descs(serialized)
    else:
        # Equal pieces, the local ones in a shuffled order (as D's free blocks come),
        # so NIXL cannot merge them: the descriptor structure of an engine's READ.
        chunk = size // num_descriptors
        order = np.random.default_rng(0).permutation(num_descriptors)
        local = agent.get_xfer_descs(np.array(
            [(buf.ctypes.data + i * chunk, chunk, 0) for i in order], dtype=np.uint64),
            "DRAM")
        remote = agent.get_xfer_descs(np.array(
            [(remote_addr + i * chunk, chunk, 0) for i in range(num_descriptors)],
            dtype=np.uint64), "DRAM")
    best = min(_timed_reads(agent, local, remote, remote_name, repeats))
    moved = size // num_descriptors * num_descriptors
    if not buf[:16].all() or not buf[moved - 16:moved].all():
        raise RuntimeError("NIXL READ returned the wrong bytes")
    agent.remove_remote_agent(remote_name)
    return moved / best / 1e9


class RawReader:
    """Raw one-descriptor NIXL READs of up to ``capacity`` bytes from an owner process
    that lives as long as this object, so that a raw rate can be taken right beside each
    engine READ rather than once after the engines stopped: this machine's memory copy
    rate drifts by up to 2x within a minute (docs/performance.md)."""

    def __init__(self, capacity: int):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._owner = ctx.Process(target=_owner, daemon=True, args=(capacity, child))
        self._owner.start()
        meta, _, self._remote_addr = self._conn.recv()
        self._agent, self._buf = _reader("kvh-raw-reader", capacity)
        self._remote = self._agent.add_remote_agent(meta)
        self.capacity = capacity

    def gbps(self, size: int, repeats: int = 3) -> tuple[float, float]:
        """Median and best GB/s of ``repeats`` READs of the owner's first ``size`` bytes
        as one descriptor."""
        if not 0 < size <= self.capacity:
            raise ValueError(f"size {size} outside (0, {self.capacity}]")
        local = self._agent.get_xfer_descs([(self._buf.ctypes.data, size, 0)], "DRAM")
        remote = self._agent.get_xfer_descs([(self._remote_addr, size, 0)], "DRAM")
        times = _timed_reads(self._agent, local, remote, self._remote, repeats)
        if not self._buf[size - 16:size].all():
            raise RuntimeError("NIXL READ returned the wrong bytes")
        self._buf[:size] = 0  # the next READ must bring its bytes again
        return (round(size / statistics.median(times) / 1e9, 3),
                round(size / min(times) / 1e9, 3))

    def close(self) -> None:
        self._agent.remove_remote_agent(self._remote)
        self._conn.send("stop")
        self._owner.join(10)

    def __enter__(self) -> RawReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_gbps(size: int, repeats: int, num_descriptors: int = 1, hosts: tuple = (),
              env: dict[str, str] | None = None) -> float:
    """Best GB/s of ``repeats`` raw NIXL READs of ``size`` bytes in ``num_descriptors``
    descriptors. Owner in a child process, reader here; with ``hosts`` (owner's,
    reader's: see tools.netns), each in a child process on its host, ``env`` added to
    both."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, daemon=True,
                        args=(size, child, hosts[0] if hosts else None, env))
    owner.start()
    try:
        described = parent.recv()
        if not hosts:
            return _read(described, size, repeats, num_descriptors)
        from tools.netns import call

        return call(hosts[1], _read, described, size, repeats, num_descriptors, env=env or {})
    finally:
        parent.send("stop")
        owner.join(10)


def _memcpy_gbps(size: int, repeats: int) -> float:
    import numpy as np

    src = np.ones(size, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return size / best / 1e9


def measure_descriptor_rate(size: int, num_descriptors: int, repeats: int = 3) -> float:
    """Raw NIXL READ GB/s for ``size`` bytes posted as ``num_descriptors`` equal,
    unmergeable descriptors: what an engine's READ of that structure could reach."""
    return round(read_gbps(size, repeats, num_descriptors), 3)


def measure_across_hosts(owner_host: Any, reader_host: Any, size: int, log_dir: Path,
                         ucx_tls: str | None = "tcp", repeats: int = 3) -> dict[str, Any]:
    """Raw NIXL READ GB/s of one ``size``-byte descriptor from ``owner_host`` to
    ``reader_host`` (tools.netns hosts), with ``UCX_TLS=ucx_tls`` (None: UCX's own choice)
    and the transport UCX chose for it, read from the reader's UCX protocol tables."""
    from tools.ucx_report import read_transports_in, ucx_env

    log_dir.mkdir(parents=True, exist_ok=True)
    tag = f"probe-{os.getpid()}-{time.monotonic_ns()}"
    env = {**ucx_env(str(log_dir / f"{tag}.%p.ucx.log")),
           **({"UCX_TLS": ucx_tls} if ucx_tls else {})}
    gbps = read_gbps(size, repeats, 1, (owner_host, reader_host), env)
    return {"bytes": size, "gbps": round(gbps, 3), "ucx_tls": ucx_tls,
            "read_transports": sorted(read_transports_in(sorted(log_dir.glob(f"{tag}.*"))))}


def measure_transfer(sizes: list[int], repeats: int = 3) -> dict[str, Any]:
    rows = [{"bytes": n, "nixl_gbps": round(read_gbps(n, repeats), 3),
             "memcpy_gbps": round(_memcpy_gbps(n, repeats), 3)} for n in sizes]
    largest = rows[-1]
    return {"nixl_gbps": largest["nixl_gbps"], "memcpy_gbps": largest["memcpy_gbps"],
            "ratio": round(largest["nixl_gbps"] / largest["memcpy_gbps"], 3), "sizes": rows}

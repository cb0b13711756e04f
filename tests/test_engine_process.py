"""What our code sets up inside vLLM's engine processes (one test starts an engine server)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from connector.runtime import back_with_huge_pages, bound_shm_reader_waits


def test_shm_reader_waits_are_bounded_and_never_lengthened(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)
    bound_shm_reader_waits(0)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    bound_shm_reader_waits(20)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20
    bound_shm_reader_waits(100)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20


def test_shm_reader_spin_is_capped(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    seen = []

    def wait(self, timeout_ms=None):
        seen.append(self.busy_loop_s)

    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", wait)
    cond = types.SimpleNamespace(busy_loop_s=1.0)
    shm_broadcast.SpinCondition.wait(cond)
    assert seen == [1.0]  # the control: vLLM's 1 s spin, uncapped
    bound_shm_reader_waits(0, busy_loop_ms=0.5)
    shm_broadcast.SpinCondition.wait(cond)
    assert seen[-1] == 0.0005
    bound_shm_reader_waits(0, busy_loop_ms=0.5)  # applied twice: wrapped once
    assert shm_broadcast.SpinCondition.wait.__wrapped__ is wait


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_kv_pool_memory_is_collapsed_to_huge_pages():
    import torch

    if "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
        pytest.skip("every mapping gets huge pages on this host: nothing to compare")
    size = 64 << 20
    control = torch.zeros(size, dtype=torch.int8)
    pool = torch.zeros(size, dtype=torch.int8)
    assert _huge_kib(control.data_ptr()) == 0  # torch alone: 4 KiB pages
    collapsed = back_with_huge_pages([pool[: size // 2], pool[size // 2:]])
    assert collapsed >= size - (4 << 20)  # one storage, its 2 MiB-aligned span
    assert _huge_kib(pool.data_ptr() + (4 << 20)) * 1024 >= collapsed
    assert torch.count_nonzero(pool) == 0  # contents kept


@pytest.mark.parametrize("level, shown, hidden", [
    ("DEBUG", ["a debug line", "a warning line"], []),
    (None, ["a warning line"], ["a debug line"]),
])
def test_our_records_in_an_engine_process_carry_time_and_level(level, shown, hidden):
    # An engine process configures no root handler: our records must still come out,
    # formatted, at KVHANDOFF_LOG_LEVEL (default WARNING).
    code = textwrap.dedent("""
        import logging
        from connector.logs import use_vllm_handlers
        use_vllm_handlers("connector")
        log = logging.getLogger("connector.nixl_continuation")
        log.debug("a debug line")
        log.warning("a warning line")
    """)
    env = {"PATH": "/usr/bin:/bin"}
    if level:
        env["KVHANDOFF_LOG_LEVEL"] = level
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=Path(__file__).parents[1]).stderr
    for text in shown:
        line = next(line for line in err.splitlines() if text in line)
        assert "connector.nixl_continuation" in line and ("WARNING" in line or "DEBUG" in line)
    for text in hidden:
        assert text not in err


def _listening_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_side_channel_that_cannot_listen_fails_the_start_with_the_reason():
    # vLLM's listener thread dies on a port in use and its caller waits forever.
    from connector.nixl_scheduler import ContinuationConnectorScheduler

    with _listening_port() as busy:
        sched = ContinuationConnectorScheduler.__new__(ContinuationConnectorScheduler)
        sched.side_channel_host, sched.side_channel_port = busy.getsockname()
        sched._nixl_handshake_listener_t = None
        sched._stop_event = threading.Event()
        with pytest.raises(RuntimeError,
                           match=f"cannot listen on 127.0.0.1:{sched.side_channel_port}"):
            sched.set_xfer_handshake_metadata({})
    # The port is free now: the listener starts and stops as vLLM's does.
    sched.set_xfer_handshake_metadata({})
    listener = sched._nixl_handshake_listener_t
    assert listener is not None and listener.is_alive()
    sched._stop_event.set()
    listener.join(timeout=10)
    assert not listener.is_alive()


@pytest.mark.engines  # starts a real engine server (it fails at its side channel)
def test_an_engine_server_whose_side_channel_port_is_taken_exits_saying_so(model_dir, tmp_path):
    from kvhandoff.ports import free_port

    with _listening_port() as busy:
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "cli.main", "serve", "--role", "decode",
             "--model", model_dir, "--port", str(free_port()), "--kv-cache-mib", "24",
             "--side-channel-port", str(port)],
            capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert proc.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stdout + proc.stderr


@pytest.mark.engines
def test_engine_workers_keep_every_core_and_hold_their_pool_on_huge_pages(pair):
    """vLLM's NIXL worker pins the thread that runs the forward pass to one core (the
    same core for P and D on this host); ours gives the cores back. Its KV pool is on
    2 MiB pages (READs move about twice the bytes per second). On CPU the worker runs
    inside the engine-core process (EngineConfig.worker_in_engine_core): one process
    per engine, no VLLM::Worker."""
    import psutil

    from tests.conftest import D_POOL_BYTES, P_POOL_BYTES

    children = psutil.Process().children(recursive=True)
    assert not [p for p in children if p.name().startswith("VLLM::Worker")]
    workers = [p for p in children if p.name().startswith("VLLM::EngineCor")]
    assert len(workers) == 4  # the pair's P, D, second P and second D
    for worker in workers:
        assert set(worker.cpu_affinity()) == os.sched_getaffinity(0), worker
        rollup = Path(f"/proc/{worker.pid}/smaps_rollup").read_text()
        huge = int(rollup.split("AnonHugePages:")[1].split()[0]) * 1024
        assert huge >= min(P_POOL_BYTES, D_POOL_BYTES) - (4 << 20), (worker, huge)

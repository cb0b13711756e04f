"""The probe's NIXL side: the wheels, an agent, a READ waited on, and P's process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvhandoff.ucxlog import flush_ucx_log
from tools.gpu_probe.pools import Geometry, device, make_pool, sync

#: A READ that has not finished after this long is reported as hung, not waited on.
READ_TIMEOUT_S = 60.0


def install_wheels(wheels: Path) -> str:
    """Installs every wheel in ``wheels`` into a private folder (no index, no
    dependencies: torch and numpy must be there already) and returns that folder, which
    this process and its children then import from."""
    target = Path(os.environ.get("KVH_PROBE_SITE", "/tmp/kvh-probe-site"))
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        raise SystemExit(f"--wheels {wheels}: no .whl files there")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target),
                    *found], check=True)
    return str(target)


def _nixl() -> tuple[Any, Any]:
    """``nixl_agent`` and ``nixl_agent_config`` from the ``nixl`` meta package, or from
    the CUDA-specific one directly when the meta package is missing."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore
        except ImportError:
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore
    return nixl_agent, nixl_agent_config


def agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and no progress thread (vLLM's settings)."""
    nixl_agent, nixl_agent_config = _nixl()
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def wait(nixl: Any, handle: Any, what: str) -> float:
    """Posts ``handle`` and polls it to the end; seconds from post to DONE. Raises
    RuntimeError if it ends in another state or runs past :data:`READ_TIMEOUT_S`."""
    t0 = time.perf_counter()
    state = nixl.transfer(handle)
    while state not in ("DONE", "ERR"):
        if time.perf_counter() - t0 > READ_TIMEOUT_S:
            raise RuntimeError(f"{what}: no completion after {READ_TIMEOUT_S:.0f} s")
        state = nixl.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    if state != "DONE":
        raise RuntimeError(f"{what}: NIXL READ ended in {state}")
    return elapsed


def owner(geo: Geometry, device_name: str, layouts: list[str], flat_bytes: int, fault: int,
          conn: Any, env: dict[str, str]) -> None:
    """P's side: a pool per layout in ``layouts`` filled with the pattern (shifted by
    ``fault``) and a flat buffer, registered; publishes on ``conn`` how to read them
    (``metadata``, ``pools``: layout -> each layer view's address, ``flat``, ``dev_id``),
    then serves READs (polling notifications, which also progresses UCX) until told to
    stop."""
    os.environ.update(env)
    import torch

    dev, mem_type, dev_id = device(device_name)
    pools = {layout: make_pool(geo, dev, layout) for layout in layouts}
    for pool in pools.values():
        pool.fill(fault)
    flat = torch.full((flat_bytes,), 0x5A, dtype=torch.uint8, device=dev)
    sync(dev)
    nixl = agent("kvh-gpu-probe-owner")
    for pool in pools.values():
        nixl.register_memory(pool.regions(dev_id), mem_type)
    nixl.register_memory([(flat.data_ptr(), flat_bytes, dev_id, "")], mem_type)
    conn.send({"metadata": nixl.get_agent_metadata(),
               "pools": {layout: pool.bases for layout, pool in pools.items()},
               "flat": flat.data_ptr(), "dev_id": dev_id})
    while not conn.poll(0.0005):
        nixl.get_new_notifs()
    conn.recv()
    flush_ucx_log()

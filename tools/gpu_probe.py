"""NIXL READ bandwidth in vLLM 0.32's KV layout, GPU memory to GPU memory between two
processes on one GPU (or host memory to host memory with ``--device cpu``, its test here),
against a copy of the same bytes inside one process.

Two processes, as P and D would be: the *owner* (P) holds a KV pool, one tensor per layer
in the layout vLLM 0.32's FlashAttention backend allocates on CUDA
(``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: blocks outermost, a block's K
and V together), registers it with NIXL and fills every block with a byte that names its
(layer, block). The *reader* (D) holds a pool of the same shape and READs a parent's
blocks into its own, three ways:

- ``vllm_descs``: what vLLM's NIXL connector posts: both pools prepared once as
  descriptor lists of one block per layer region (``_build_fa_local``), then one
  ``make_prepped_xfer`` whose indices are region-major (``_get_block_descs_ids``), the
  parent's blocks a random sample of P's pool and D's destination blocks a random
  sample of D's, both shuffled: nothing NIXL could merge.
- ``one_desc``: the same number of bytes as one descriptor, between flat buffers.
- ``copy``: inside the reader, a device copy of the same bytes (contiguous), and the
  same blocks gathered pool to pool by index (what a local block copy costs).

Every READ is checked: D's destination blocks must hold the bytes of the P blocks they
were read from (``--fault`` offsets the owner's pattern: the check must then fail).
UCX writes its protocol tables (``UCX_PROTO_INFO``) to a log per process; the transports
that READs used are read from the reader's (``tools.ucx_report``).

Run by hand wherever CUDA is::

    python3 -m tools.gpu_probe --device cuda --wheels .whl --out out/gpu-probe

``--wheels DIR`` installs the NIXL wheels found in DIR into a private folder first (a
machine with no registry: carry ``nixl-cu13`` and the ``nixl`` meta package there). The
JSON report goes to ``--out``/probe.json, written again after every measurement, so a
run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvhandoff.ucxlog import flush_ucx_log

#: Llama-3-8B's KV geometry (32 layers, 8 KV heads of 128, bf16) in blocks of 16 tokens.
LLAMA3_8B = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block": 16, "dtype_bytes": 2}

#: A READ that has not finished after this long is reported as hung, not waited on.
READ_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    block: int
    dtype_bytes: int
    #: Blocks in each process's pool (per layer).
    pool_blocks: int

    @property
    def page_bytes(self) -> int:
        """One block of one layer: K and V of every KV head (vLLM's page size)."""
        return 2 * self.kv_heads * self.head_dim * self.block * self.dtype_bytes

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block)


def _install_wheels(wheels: Path) -> str:
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


def _device(name: str) -> tuple[Any, str, int]:
    """(torch device, NIXL memory type, device id) for ``cuda`` or ``cpu``."""
    import torch

    if name == "cuda":
        return torch.device("cuda", 0), "VRAM", 0
    return torch.device("cpu"), "DRAM", 0


def _sync(dev: Any) -> None:
    if dev.type == "cuda":
        import torch

        torch.cuda.synchronize(dev)


def _pool(geo: Geometry, dev: Any) -> list[Any]:
    """One tensor per layer, vLLM 0.32's CUDA FlashAttention shape, bf16 (or any
    2-byte type: only the bytes matter here)."""
    import torch

    dtype = {2: torch.bfloat16, 4: torch.float32}[geo.dtype_bytes]
    return [torch.empty((geo.pool_blocks, geo.kv_heads, geo.block, 2 * geo.head_dim),
                        dtype=dtype, device=dev) for _ in range(geo.layers)]


def _pattern(layer: int, block: Any, offset: int) -> Any:
    """The byte the owner writes into every byte of (layer, block): a value that
    differs between neighbouring blocks and layers."""
    return (layer * 31 + block * 7 + 1 + offset) % 251


def _block_descs(pool: list[Any], geo: Geometry, dev_id: int) -> Any:
    """Descriptors of every block of every layer region, region-major, as vLLM's
    ``_build_fa_local`` makes them: (address, page bytes, device id)."""
    import numpy as np

    rows = []
    for cache in pool:
        addrs = cache.data_ptr() + np.arange(geo.pool_blocks, dtype=np.uint64) * geo.page_bytes
        rows.append(np.stack([addrs, np.full_like(addrs, geo.page_bytes),
                              np.full_like(addrs, dev_id)], axis=1))
    return np.concatenate(rows).astype(np.uint64)


def _agent(name: str) -> Any:
    nixl_agent, nixl_agent_config = _nixl()
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _owner(geo: Geometry, device: str, flat_bytes: int, fault: int, conn: Any,
           env: dict[str, str]) -> None:
    """P's side: registers its pool and a flat buffer, publishes how to read them, then
    serves READs (polling notifications, which also progresses UCX) until told to stop."""
    os.environ.update(env)
    import torch

    dev, mem_type, dev_id = _device(device)
    pool = _pool(geo, dev)
    for layer, cache in enumerate(pool):
        values = _pattern(layer, torch.arange(geo.pool_blocks, device=dev), fault)
        cache.view(torch.uint8).view(geo.pool_blocks, -1)[:] = values.to(torch.uint8)[:, None]
    flat = torch.full((flat_bytes,), 0x5A, dtype=torch.uint8, device=dev)
    _sync(dev)
    agent = _agent("kvh-gpu-probe-owner")
    agent.register_memory([(c.data_ptr(), c.nbytes, dev_id, "") for c in pool], mem_type)
    agent.register_memory([(flat.data_ptr(), flat_bytes, dev_id, "")], mem_type)
    conn.send({"metadata": agent.get_agent_metadata(),
               "bases": [c.data_ptr() for c in pool], "flat": flat.data_ptr(),
               "dev_id": dev_id})
    while not conn.poll(0.0005):
        agent.get_new_notifs()
    conn.recv()
    flush_ucx_log()


def _wait(agent: Any, handle: Any, what: str) -> float:
    """Posts ``handle`` and polls it to the end; seconds from post to DONE."""
    t0 = time.perf_counter()
    state = agent.transfer(handle)
    while state not in ("DONE", "ERR"):
        if time.perf_counter() - t0 > READ_TIMEOUT_S:
            raise RuntimeError(f"{what}: no completion after {READ_TIMEOUT_S:.0f} s")
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - t0
    if state != "DONE":
        raise RuntimeError(f"{what}: NIXL READ ended in {state}")
    return elapsed


def _summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    ordered = sorted(seconds)
    best, median = ordered[0], ordered[len(ordered) // 2]
    return {"best_ms": round(best * 1e3, 4), "median_ms": round(median * 1e3, 4),
            "best_gbps": round(nbytes / best / 1e9, 3),
            "median_gbps": round(nbytes / median / 1e9, 3)}


def _timed_copy(dev: Any, repeats: int, run: Any) -> list[float]:
    out = []
    for i in range(repeats + 1):
        _sync(dev)
        t0 = time.perf_counter()
        run()
        _sync(dev)
        if i:
            out.append(time.perf_counter() - t0)
    return out


class Reader:
    """D's side: its own pool and flat buffer, P's descriptors prepared once, and the
    three measurements per parent length."""

    def __init__(self, geo: Geometry, device: str, flat_bytes: int, owner: dict[str, Any],
                 seed: int) -> None:
        import numpy as np
        import torch

        self.geo = geo
        self.dev, self.mem_type, self.dev_id = _device(device)
        self.rng = np.random.default_rng(seed)
        self.pool = _pool(geo, self.dev)
        self.flat = torch.zeros((flat_bytes,), dtype=torch.uint8, device=self.dev)
        self.agent = _agent(f"kvh-gpu-probe-reader-{os.getpid()}")
        self.agent.register_memory(
            [(c.data_ptr(), c.nbytes, self.dev_id, "") for c in self.pool], self.mem_type)
        self.agent.register_memory([(self.flat.data_ptr(), flat_bytes, self.dev_id, "")],
                                   self.mem_type)
        self.remote = self.agent.add_remote_agent(owner["metadata"])
        local = _block_descs(self.pool, geo, self.dev_id)
        remote = local.copy()
        for layer, base in enumerate(owner["bases"]):
            rows = slice(layer * geo.pool_blocks, (layer + 1) * geo.pool_blocks)
            remote[rows, 0] = local[rows, 0] - self.pool[layer].data_ptr() + base
        remote[:, 2] = owner["dev_id"]
        self.local_side = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.agent.get_xfer_descs(local, self.mem_type))
        self.remote_side = self.agent.prep_xfer_dlist(
            self.remote, self.agent.get_xfer_descs(remote, self.mem_type))
        self.owner_flat = owner["flat"]
        self.backend = ""

    def _indices(self, blocks: Any) -> Any:
        """Region-major descriptor indices of ``blocks`` (vLLM's ``_get_block_descs_ids``)."""
        import numpy as np

        return np.concatenate([layer * self.geo.pool_blocks + blocks
                               for layer in range(self.geo.layers)])

    def vllm_descs(self, tokens: int, repeats: int) -> dict[str, Any]:
        import torch

        n = self.geo.blocks_for(tokens)
        src = self.rng.choice(self.geo.pool_blocks, n, replace=False)
        dst = self.rng.choice(self.geo.pool_blocks, n, replace=False)
        local_ids, remote_ids = self._indices(dst), self._indices(src)
        nbytes = len(local_ids) * self.geo.page_bytes
        seconds = []
        for i in range(repeats + 1):  # the first READ sets up the connection: not timed
            for cache in self.pool:
                cache.view(torch.uint8).view(self.geo.pool_blocks, -1)[dst] = 0
            _sync(self.dev)
            handle = self.agent.make_prepped_xfer("READ", self.local_side, local_ids,
                                                  self.remote_side, remote_ids)
            elapsed = _wait(self.agent, handle, f"{tokens}-token READ")
            self.backend = self.agent.query_xfer_backend(handle)
            self.agent.release_xfer_handle(handle)
            if i:
                seconds.append(elapsed)
        self._check_blocks(src, dst)
        return {"descriptors": len(local_ids), "bytes": nbytes, **_summary(seconds, nbytes)}

    def _check_blocks(self, src: Any, dst: Any) -> None:
        """Every byte of D's block ``dst[i]`` of every layer is P's pattern for
        ``src[i]``: a READ that moved the wrong blocks, or none, fails here."""
        import torch

        src_t = torch.as_tensor(src, device=self.dev)
        dst_t = torch.as_tensor(dst, device=self.dev)
        for layer, cache in enumerate(self.pool):
            got = cache.view(torch.uint8).view(self.geo.pool_blocks, -1)[dst_t]
            want = _pattern(layer, src_t, 0).to(torch.uint8)[:, None]
            if not bool((got == want).all()):
                wrong = int((got != want).any(dim=1).sum())
                raise RuntimeError(f"layer {layer}: {wrong} of {len(dst)} blocks read hold "
                                   "other bytes than the P blocks they were read from")

    def one_desc(self, nbytes: int, repeats: int) -> dict[str, Any]:
        local = self.agent.get_xfer_descs([(self.flat.data_ptr(), nbytes, self.dev_id)],
                                          self.mem_type)
        remote = self.agent.get_xfer_descs([(self.owner_flat, nbytes, self.dev_id)],
                                           self.mem_type)
        seconds = []
        for i in range(repeats + 1):
            self.flat[:nbytes] = 0
            _sync(self.dev)
            handle = self.agent.initialize_xfer("READ", local, remote, self.remote)
            elapsed = _wait(self.agent, handle, f"{nbytes}-byte one-descriptor READ")
            self.agent.release_xfer_handle(handle)
            if i:
                seconds.append(elapsed)
        if not bool((self.flat[:nbytes] == 0x5A).all()):
            raise RuntimeError("the one-descriptor READ returned other bytes than P's")
        return {"descriptors": 1, "bytes": nbytes, **_summary(seconds, nbytes)}

    def copies(self, tokens: int, repeats: int) -> dict[str, Any]:
        """In this process: the same bytes copied contiguously, and the same number of
        blocks gathered from one pool region to another by shuffled index."""
        import torch

        n = self.geo.blocks_for(tokens)
        nbytes = n * self.geo.layers * self.geo.page_bytes
        target = torch.empty((nbytes,), dtype=torch.uint8, device=self.dev)
        flat = self.flat[:nbytes]
        contiguous = _timed_copy(self.dev, repeats, lambda: target.copy_(flat))
        src_ids = torch.as_tensor(self.rng.choice(self.geo.pool_blocks, n, replace=False),
                                  device=self.dev)
        dst_ids = torch.as_tensor(self.rng.choice(self.geo.pool_blocks, n, replace=False),
                                  device=self.dev)
        views = [c.view(torch.uint8).view(self.geo.pool_blocks, -1) for c in self.pool]

        def gather() -> None:
            for layer, view in enumerate(views):
                views[(layer + 1) % len(views)][dst_ids] = view[src_ids]

        gathered = _timed_copy(self.dev, repeats, gather)
        return {"bytes": nbytes, "contiguous": _summary(contiguous, nbytes),
                "blocks": _summary(gathered, nbytes)}

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local_side)
        self.agent.release_dlist_handle(self.remote_side)
        self.agent.remove_remote_agent(self.remote)
        flush_ucx_log()


def _ipc_child(tensors: Any, sums: Any) -> None:
    sums.put(float(tensors.get().sum()))  # the tensor arrives through cudaIpcOpenMemHandle


def cuda_ipc_check(device: str = "cuda") -> str:
    """Whether this machine lets one process map another's GPU memory (CUDA IPC, what
    UCX's ``cuda_ipc`` transport is made of): a CUDA tensor handed to a spawned process
    through torch.multiprocessing, which opens it with ``cudaIpcOpenMemHandle``.
    "ok", or what went wrong (the child's traceback goes to stderr). ``device="cpu"``
    runs the same exchange through shared host memory (its test here)."""
    import queue

    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    tensors, sums = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(tensors, sums), daemon=True)
    child.start()
    ones = torch.ones(1024, device=device)
    tensors.put(ones)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                got = sums.get(timeout=1)
                return "ok" if got == 1024 else f"the child read a sum of {got}, not 1024"
            except queue.Empty:
                if not child.is_alive():
                    return f"the child failed (exit {child.exitcode})"
        return "no answer from the child in 60 s"
    finally:
        child.join(5)
        if child.is_alive():
            child.kill()


def _device_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": device, "torch": torch.__version__,
                            "host": platform.node(), "python": platform.python_version()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count,
                    cuda=torch.version.cuda)
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        try:
            info["cuda_ipc"] = cuda_ipc_check()
        except Exception as e:  # a probe of the machine: report it, measure anyway
            info["cuda_ipc"] = f"the check itself failed: {e!r}"
    return info


def _reader(geo: Geometry, device: str, flat_bytes: int, owner: dict[str, Any],
            tokens: list[int], repeats: int, report: dict[str, Any], out: Path,
            env: dict[str, str]) -> None:
    os.environ.update(env)
    report["reader_pid"] = os.getpid()  # whose UCX log holds the READs' tables
    _write(report, out)
    reader = Reader(geo, device, flat_bytes, owner, seed=0)
    try:
        for n in tokens:
            row: dict[str, Any] = {"tokens": n, "blocks": geo.blocks_for(n)}
            report["rows"].append(row)
            row["vllm_descs"] = reader.vllm_descs(n, repeats)
            row["one_desc"] = reader.one_desc(row["vllm_descs"]["bytes"], repeats)
            row["copy"] = reader.copies(n, repeats)
            row["nixl_backend"] = reader.backend
            _write(report, out)
    finally:
        reader.close()


def _write(report: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(report, indent=1))


def run(device: str, tokens: list[int], geo: Geometry, repeats: int, out: Path,
        fault: int = 0, ucx_tls: str | None = None) -> dict[str, Any]:
    """Owner in a child process, reader in another; returns the report (also written to
    ``out``/probe.json). Raises if a READ fails, hangs or moves the wrong bytes."""
    from tools.ucx_report import read_transports_in, ucx_env

    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("ucx.*.log"):
        old.unlink()
    env = {**ucx_env(str(out / "ucx.%p.log")), **({"UCX_TLS": ucx_tls} if ucx_tls else {})}
    flat_bytes = geo.blocks_for(max(tokens)) * geo.layers * geo.page_bytes
    report: dict[str, Any] = {
        "geometry": {**asdict(geo), "page_bytes": geo.page_bytes,
                     "layout": "[num_blocks, kv_heads, block, 2*head_dim] per layer"},
        "repeats": repeats, "fault": fault,
        "ucx_env": {k: v for k, v in sorted({**os.environ, **env}.items())
                    if k.startswith("UCX_") and k not in ("UCX_LOG_FILE", "UCX_PROTO_INFO")},
        "info": _device_info(device), "rows": []}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(geo, device, flat_bytes, fault, child, env),
                        daemon=True)
    owner.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the owner did not publish its pool within 300 s")
        described = parent.recv()
        reader = ctx.Process(target=_reader, daemon=True,
                             args=(geo, device, flat_bytes, described, tokens, repeats,
                                   report, out, env))
        reader.start()
        reader.join()
        if reader.exitcode != 0:
            done = json.loads((out / "probe.json").read_text()) if (
                out / "probe.json").exists() else report
            raise RuntimeError(f"the reader failed (exit {reader.exitcode}); measured: "
                               f"{[r['tokens'] for r in done['rows'] if 'copy' in r]}")
    finally:
        parent.send("stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()
    report = json.loads((out / "probe.json").read_text())
    logs = sorted(out.glob("ucx.*.log"))
    report["read_transports"] = sorted(read_transports_in(
        [p for p in logs if p.name == f"ucx.{report['reader_pid']}.log"]))
    _write(report, out)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", default="1024,4096,16384",
                   help="parent lengths, comma-separated")
    p.add_argument("--layers", type=int, default=LLAMA3_8B["layers"])
    p.add_argument("--kv-heads", type=int, default=LLAMA3_8B["kv_heads"])
    p.add_argument("--head-dim", type=int, default=LLAMA3_8B["head_dim"])
    p.add_argument("--block", type=int, default=LLAMA3_8B["block"])
    p.add_argument("--pool-blocks", type=int, default=0,
                   help="blocks per layer in each pool (default: 1.5 x the longest parent)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ucx-tls", default=None, help="UCX_TLS for both processes")
    p.add_argument("--fault", type=int, default=0,
                   help="offset P's byte pattern: the READ check must fail")
    p.add_argument("--wheels", type=Path, default=None,
                   help="install the NIXL wheels in this folder first")
    p.add_argument("--out", type=Path, default=Path("out/gpu-probe"))
    args = p.parse_args(argv)
    if args.wheels is not None:
        site = _install_wheels(args.wheels)
        sys.path.insert(0, site)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [site, os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    tokens = [int(t) for t in args.tokens.split(",")]
    pool = args.pool_blocks or math.ceil(1.5 * math.ceil(max(tokens) / args.block))
    geo = Geometry(args.layers, args.kv_heads, args.head_dim, args.block,
                   LLAMA3_8B["dtype_bytes"], pool)
    report = run(args.device, tokens, geo, args.repeats, args.out, args.fault, args.ucx_tls)
    print(format_table(report))
    return 0


def format_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table (GB/s, best of the repeats)."""
    lines = ["| parent tokens | MiB | descriptors | NIXL READ, vLLM's descriptors (GB/s) "
             "| NIXL READ, 1 descriptor | copy in one process, contiguous | copy, same blocks "
             "| READ / contiguous copy |", "|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        v, one, copy = row["vllm_descs"], row["one_desc"], row["copy"]
        lines.append(
            f"| {row['tokens']} | {v['bytes'] / 2**20:.0f} | {v['descriptors']} "
            f"| {v['best_gbps']} | {one['best_gbps']} | {copy['contiguous']['best_gbps']} "
            f"| {copy['blocks']['best_gbps']} "
            f"| {v['best_gbps'] / copy['contiguous']['best_gbps']:.2f} |")
    lines.append(f"UCX transports of the READs: {', '.join(report['read_transports']) or '?'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

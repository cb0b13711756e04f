"""What the probe's machine is: versions, the GPU, and whether CUDA IPC works on it."""

from __future__ import annotations

import platform
import subprocess
import time
from typing import Any


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


def device_info(device: str) -> dict[str, Any]:
    """Versions and host; on ``cuda`` also the GPU, its driver and :func:`cuda_ipc_check`."""
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

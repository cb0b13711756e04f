"""D's side of the probe: its pools, P's descriptors, and one measurement per mode.

Every NIXL mode times each READ from post to DONE, best and median of ``repeats`` after
an untimed first READ (which sets the connection up), and checks D's destination blocks
afterwards: a READ of the wrong bytes raises instead of reporting a rate.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from connector.runs import merge
from kvhandoff.ucxlog import flush_ucx_log
from tools.gpu_probe.agents import agent, wait
from tools.gpu_probe.pools import (
    LAYER_OUTER,
    Geometry,
    block_descs,
    device,
    make_pool,
    region_major,
    sync,
)


def summary(seconds: list[float], nbytes: int) -> dict[str, float]:
    """Best and median of ``seconds``, as times and as GB/s of ``nbytes``."""
    ordered = sorted(seconds)
    best, median = ordered[0], ordered[len(ordered) // 2]
    return {"best_ms": round(best * 1e3, 4), "median_ms": round(median * 1e3, 4),
            "best_gbps": round(nbytes / best / 1e9, 3),
            "median_gbps": round(nbytes / median / 1e9, 3)}


def _timed_copy(dev: Any, repeats: int, run: Any) -> list[float]:
    out = []
    for i in range(repeats + 1):
        sync(dev)
        t0 = time.perf_counter()
        run()
        sync(dev)
        if i:
            out.append(time.perf_counter() - t0)
    return out


class Reader:
    """D's side: a pool per layout in ``layouts`` (vLLM's layer-outer one always) and a
    flat buffer, registered; P's descriptors per layout; vLLM's prepared once."""

    def __init__(self, geo: Geometry, device_name: str, flat_bytes: int,
                 owner: dict[str, Any], layouts: list[str], seed: int) -> None:
        import torch

        self.geo = geo
        self.dev, self.mem_type, self.dev_id = device(device_name)
        self.rng = np.random.default_rng(seed)
        self.pools = {layout: make_pool(geo, self.dev, layout)
                      for layout in dict.fromkeys([LAYER_OUTER, *layouts])}
        self.flat = torch.zeros((flat_bytes,), dtype=torch.uint8, device=self.dev)
        self.agent = agent(f"kvh-gpu-probe-reader-{os.getpid()}")
        for pool in self.pools.values():
            self.agent.register_memory(pool.regions(self.dev_id), self.mem_type)
        self.agent.register_memory([(self.flat.data_ptr(), flat_bytes, self.dev_id, "")],
                                   self.mem_type)
        self.remote = self.agent.add_remote_agent(owner["metadata"])
        #: Per layout, (D's, P's) descriptors of every block of every layer, region-major.
        self.rows = {layout: (block_descs(pool.bases, pool.stride, geo, self.dev_id),
                              block_descs(owner["pools"][layout], pool.stride, geo,
                                          owner["dev_id"]))
                     for layout, pool in self.pools.items()}
        local, remote = self.rows[LAYER_OUTER]
        self.local_side = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self.agent.get_xfer_descs(local, self.mem_type))
        self.remote_side = self.agent.prep_xfer_dlist(
            self.remote, self.agent.get_xfer_descs(remote, self.mem_type))
        self.owner_flat = owner["flat"]
        self.backend = ""

    def vllm_descs(self, tokens: int, repeats: int) -> dict[str, Any]:
        """vLLM's READ: random, shuffled blocks on both sides, one prepared descriptor
        per block per layer region."""
        n = self.geo.blocks_for(tokens)
        src = self.rng.choice(self.geo.pool_blocks, n, replace=False)
        dst = self.rng.choice(self.geo.pool_blocks, n, replace=False)
        local_ids, remote_ids = region_major(self.geo, dst), region_major(self.geo, src)
        nbytes = len(local_ids) * self.geo.page_bytes
        pool = self.pools[LAYER_OUTER]
        seconds = self._timed_reads(
            pool, dst, repeats, f"{tokens}-token READ",
            lambda: self.agent.make_prepped_xfer("READ", self.local_side, local_ids,
                                                 self.remote_side, remote_ids))
        pool.check(src, dst, f"vllm_descs, {tokens} tokens")
        return {"descriptors": len(local_ids), "bytes": nbytes, **summary(seconds, nbytes)}

    def _timed_reads(self, pool: Any, dst: np.ndarray, repeats: int, label: str,
                     make_handle: Any) -> list[float]:
        """``repeats`` timed READs of ``make_handle()``'s transfer into ``dst`` (cleared
        before each, the whole pool once), after an untimed first one that sets up the
        connection."""
        pool.clear()
        seconds = []
        for i in range(repeats + 1):
            pool.clear(dst)
            sync(self.dev)
            handle = make_handle()
            elapsed = wait(self.agent, handle, label)
            self.backend = self.agent.query_xfer_backend(handle)
            self.agent.release_xfer_handle(handle)
            if i:
                seconds.append(elapsed)
        return seconds

    def _run_ids(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """P's parent blocks and D's destination blocks, each one run of ``n``
        consecutive ids strictly inside the pool (a block before it and one after, so
        that a READ past either end shows), D's at another start than P's where the
        pool leaves room for one."""
        room = self.geo.pool_blocks - n - 1  # the last start that leaves a block after
        if room < 1:
            raise ValueError(f"a run of {n} blocks with a block on each side needs a pool "
                             f"of {n + 2} blocks, not {self.geo.pool_blocks}")
        src_start = int(self.rng.integers(1, room + 1))
        others = [s for s in range(1, room + 1) if s != src_start] or [src_start]
        dst_start = int(self.rng.choice(others))
        return (np.arange(src_start, src_start + n, dtype=np.int64),
                np.arange(dst_start, dst_start + n, dtype=np.int64))

    def runs(self, tokens: int, repeats: int, layout: str,
             merge_fault: str | None = None) -> dict[str, Any]:
        """The project's READ on ``layout``: a run of P's blocks into a run of D's,
        vLLM's descriptors for them merged by ``connector.runs.merge`` (with
        ``merge_fault``, a negative control) and posted as the connector posts them.
        ``descriptors``: merged; ``pieces``: vLLM's, before the merge."""
        n = self.geo.blocks_for(tokens)
        src, dst = self._run_ids(n)
        local_rows, remote_rows = self.rows[layout]
        local = local_rows[region_major(self.geo, dst)]
        remote = remote_rows[region_major(self.geo, src)]
        t0 = time.perf_counter()
        merged = merge(local, remote, merge_fault)
        merge_s = time.perf_counter() - t0
        local_descs = self.agent.get_xfer_descs(merged.local, self.mem_type)
        remote_descs = self.agent.get_xfer_descs(merged.remote, self.mem_type)
        nbytes = int(merged.local[:, 1].sum())
        pool = self.pools[layout]
        seconds = self._timed_reads(
            pool, dst, repeats, f"{tokens}-token merged READ ({layout})",
            lambda: self.agent.initialize_xfer("READ", local_descs, remote_descs,
                                               self.remote))
        pool.check(src, dst, f"runs ({layout}), {tokens} tokens")
        return {"descriptors": len(merged.local), "pieces": len(local), "bytes": nbytes,
                "src_start": int(src[0]), "dst_start": int(dst[0]),
                "merge_ms": round(merge_s * 1e3, 4), **summary(seconds, nbytes)}

    def one_desc(self, nbytes: int, repeats: int) -> dict[str, Any]:
        """``nbytes`` in one descriptor, P's flat buffer into D's."""
        local = self.agent.get_xfer_descs([(self.flat.data_ptr(), nbytes, self.dev_id)],
                                          self.mem_type)
        remote = self.agent.get_xfer_descs([(self.owner_flat, nbytes, self.dev_id)],
                                           self.mem_type)
        seconds = []
        for i in range(repeats + 1):
            self.flat[:nbytes] = 0
            sync(self.dev)
            handle = self.agent.initialize_xfer("READ", local, remote, self.remote)
            elapsed = wait(self.agent, handle, f"{nbytes}-byte one-descriptor READ")
            self.agent.release_xfer_handle(handle)
            if i:
                seconds.append(elapsed)
        if not bool((self.flat[:nbytes] == 0x5A).all()):
            raise RuntimeError("the one-descriptor READ returned other bytes than P's")
        return {"descriptors": 1, "bytes": nbytes, **summary(seconds, nbytes)}

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
        views = self.pools[LAYER_OUTER].views

        def gather() -> None:
            for layer, view in enumerate(views):
                views[(layer + 1) % len(views)][dst_ids] = view[src_ids]

        gathered = _timed_copy(self.dev, repeats, gather)
        return {"bytes": nbytes, "contiguous": summary(contiguous, nbytes),
                "blocks": summary(gathered, nbytes)}

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local_side)
        self.agent.release_dlist_handle(self.remote_side)
        self.agent.remove_remote_agent(self.remote)
        flush_ucx_log()

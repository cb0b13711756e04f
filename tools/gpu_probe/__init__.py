"""NIXL READ bandwidth in vLLM 0.32's KV layout, GPU memory to GPU memory between two
processes on one GPU (or host memory to host memory with ``--device cpu``, its test here),
against a copy of the same bytes inside one process.

Two processes, as P and D would be: the *owner* (P) holds a KV pool, one tensor per layer
in the layout vLLM 0.32's FlashAttention backend allocates on CUDA
(``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: blocks outermost, a block's K
and V together), registers it with NIXL and fills every block with a byte that names its
(layer, block). The *reader* (D) holds a pool of the same shape and READs a parent's
blocks into its own, in these modes (``--modes`` picks among the first three):

- ``vllm_descs``: what vLLM's NIXL connector posts: both pools prepared once as
  descriptor lists of one block per layer region (``_build_fa_local``), then one
  ``make_prepped_xfer`` whose indices are region-major (``_get_block_descs_ids``), the
  parent's blocks a random sample of P's pool and D's destination blocks a random
  sample of D's, both shuffled: nothing NIXL could merge.
- ``runs``: the project's scheme (``connector.runs``): P's parent blocks one run of
  consecutive block ids, D's destination blocks another (each at an offset in its pool,
  not at the same one), vLLM's descriptors for those blocks passed through
  ``connector.runs.merge`` and READ as they come out of it (``initialize_xfer``, as the
  connector posts them): one descriptor per layer region.
- ``runs_blocks_outer``: the same on a blocks-outermost pool on both sides (vLLM's
  BLHNC: one allocation, block ``b``'s row holds every layer's page side by side, each
  layer's view strided by the row): vLLM's per-layer descriptors
  (``base + b * row + layer * page``) merge into one descriptor.
- ``one_desc``: the same number of bytes as one descriptor, between flat buffers.
- ``copy``: inside the reader, a device copy of the same bytes (contiguous), and the
  same blocks gathered pool to pool by index (what a local block copy costs).

Every READ is checked: D's destination blocks must hold the bytes of the P blocks they
were read from, block by block and layer by layer (``--fault`` offsets the owner's
pattern, ``--merge-fault merge-short`` leaves a piece of a run unread: either way the
check must fail). UCX writes its protocol tables (``UCX_PROTO_INFO``) to a log per
process; the transports that READs used are read from the reader's
(``tools.ucx_report``).

Run by hand wherever CUDA is::

    python3 -m tools.gpu_probe --device cuda --wheels .whl --out out/gpu-probe

``--wheels DIR`` installs the NIXL wheels found in DIR into a private folder first (a
machine with no registry: carry ``nixl-cu13`` and the ``nixl`` meta package there). The
JSON report goes to ``--out``/probe.json, written again after every measurement, so a
run cut short keeps what it measured.

The package, by job: ``pools`` (geometry, the two layouts, vLLM's descriptors over them,
the byte pattern and its check), ``agents`` (NIXL, P's process), ``reader`` (D's side:
the measurements), ``machine`` (what the machine is, CUDA IPC), ``cli`` (the two
processes, the report, the command line).
"""

from __future__ import annotations

from tools.gpu_probe.cli import format_table, main, run
from tools.gpu_probe.machine import cuda_ipc_check
from tools.gpu_probe.pools import (
    BLOCKS_OUTER,
    LAYER_OUTER,
    LLAMA3_8B,
    MODES,
    Geometry,
)

__all__ = ["BLOCKS_OUTER", "LAYER_OUTER", "LLAMA3_8B", "MODES", "Geometry", "cuda_ipc_check",
           "format_table", "main", "run"]

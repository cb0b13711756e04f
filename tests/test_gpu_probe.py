"""tools/gpu_probe.py on host memory: the same two processes, descriptors and checks that
measured the READ on an H100 and an H200 (docs/performance.md, "On a GPU"), here with
NIXL's host-memory path and a small geometry."""

from __future__ import annotations

import pytest

from tools.gpu_probe import Geometry, cuda_ipc_check, format_table, run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

SMALL = Geometry(layers=2, kv_heads=2, head_dim=64, block=16, dtype_bytes=2, pool_blocks=24)


def test_the_probe_reads_a_parent_in_vllms_descriptors_and_checks_every_block(tmp_path):
    report = run("cpu", [64, 256], SMALL, repeats=1, out=tmp_path)
    assert [r["tokens"] for r in report["rows"]] == [64, 256]
    for row in report["rows"]:
        blocks = row["tokens"] // SMALL.block
        v = row["vllm_descs"]
        # One descriptor per block per layer region, as vLLM's connector posts them.
        assert v["descriptors"] == blocks * SMALL.layers
        assert v["bytes"] == blocks * SMALL.layers * SMALL.page_bytes
        assert row["one_desc"]["bytes"] == v["bytes"] and row["one_desc"]["descriptors"] == 1
        assert row["copy"]["bytes"] == v["bytes"]
        for rate in (v["best_gbps"], row["one_desc"]["best_gbps"],
                     row["copy"]["contiguous"]["best_gbps"], row["copy"]["blocks"]["best_gbps"]):
            assert rate > 0
        assert row["nixl_backend"] == "UCX"
    # UCX's own protocol table names the transport: on one host, cross-memory attach.
    assert report["read_transports"] == ["cma/memory"]
    assert (tmp_path / "probe.json").exists()
    assert "cma/memory" in format_table(report)


def test_a_read_of_the_wrong_bytes_fails_the_probe(tmp_path):
    """Negative control: P's pattern shifted by one, so every block D reads holds bytes
    other than the ones the check expects: the probe must refuse to report a rate."""
    with pytest.raises(RuntimeError, match="the reader failed"):
        run("cpu", [64], SMALL, repeats=1, out=tmp_path, fault=1)


def test_the_ipc_check_hands_a_tensor_to_another_process():
    # On CUDA this is cudaIpcOpenMemHandle (it said "ok" on the H100); here shared memory.
    assert cuda_ipc_check("cpu") == "ok"

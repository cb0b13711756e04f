"""tools/gpu_probe (a package: ``python3 -m tools.gpu_probe``) on host memory: the same two
processes, descriptors and checks that measured the READ on an H100 and an H200
(docs/performance.md, "On a GPU"), here with NIXL's host-memory path and a small
geometry: vLLM's descriptors, the project's runs merged by ``connector.runs.merge`` on
vLLM's layout and on a blocks-outermost one, and one descriptor."""

from __future__ import annotations

import numpy as np
import pytest

from connector.runs import merge
from tools.gpu_probe import BLOCKS_OUTER, Geometry, cuda_ipc_check, format_table, run
from tools.gpu_probe.pools import block_descs, make_pool, region_major

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

SMALL = Geometry(layers=2, kv_heads=2, head_dim=64, block=16, dtype_bytes=2, pool_blocks=24)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One probe run on host memory, every mode, two parent lengths."""
    out = tmp_path_factory.mktemp("probe")
    return run("cpu", [64, 256], SMALL, repeats=1, out=out), out


def test_the_probe_reads_a_parent_in_vllms_descriptors_and_checks_every_block(report):
    report, out = report
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
    assert (out / "probe.json").exists()
    assert "cma/memory" in format_table(report)


def test_the_projects_runs_read_in_one_descriptor_per_region_and_check_every_block(report):
    """A run of P's blocks into a run of D's (each away from block 0, at other starts):
    vLLM's per-block descriptors merge into one per layer region on vLLM's layout, one
    in all blocks-outermost; the same bytes move, checked block by block."""
    report, _ = report
    for row in report["rows"]:
        blocks = row["tokens"] // SMALL.block
        nbytes = blocks * SMALL.layers * SMALL.page_bytes
        for mode, merged in (("runs", SMALL.layers), ("runs_blocks_outer", 1)):
            r = row[mode]
            assert r["descriptors"] == merged, mode
            assert r["pieces"] == blocks * SMALL.layers and r["bytes"] == nbytes
            assert 1 <= r["src_start"] and 1 <= r["dst_start"] != r["src_start"]
            assert max(r["src_start"], r["dst_start"]) + blocks < SMALL.pool_blocks
            assert r["best_gbps"] > 0 and r["merge_ms"] >= 0
            assert row["ratios"][f"{mode}_vs_one_desc"] == pytest.approx(
                r["best_gbps"] / row["one_desc"]["best_gbps"], rel=1e-3)
    table = format_table(report)
    assert "runs / 1 descriptor" in table and "runs, blocks outer / 1 descriptor" in table
    assert f"| {16 * SMALL.layers} / {SMALL.layers} / 1 |" in table


def test_blocks_outermost_descriptors_are_vllms_per_layer_pages_and_a_run_merges_to_one():
    """No NIXL: the blocks-outer pool's descriptors are ``base + b * row + layer * page``
    (row = every layer's page), and a run of them, P's into D's, is one descriptor."""
    pool = make_pool(SMALL, "cpu", BLOCKS_OUTER)
    row = SMALL.layers * SMALL.page_bytes
    assert pool.stride == row
    descs = block_descs(pool.bases, pool.stride, SMALL, 0)
    base = pool.tensors[0].data_ptr()
    for layer in range(SMALL.layers):
        for b in (0, 5, SMALL.pool_blocks - 1):
            assert tuple(descs[layer * SMALL.pool_blocks + b]) == (
                base + b * row + layer * SMALL.page_bytes, SMALL.page_bytes, 0)
    src, dst = np.arange(3, 9), np.arange(11, 17)
    merged = merge(descs[region_major(SMALL, dst)], descs[region_major(SMALL, src)])
    assert merged.local.tolist() == [[base + 11 * row, 6 * row, 0]]
    assert merged.remote.tolist() == [[base + 3 * row, 6 * row, 0]]


def test_a_read_of_the_wrong_bytes_fails_the_probe(tmp_path):
    """Negative control: P's pattern shifted by one, so every block D reads holds bytes
    other than the ones the check expects: the probe must refuse to report a rate."""
    with pytest.raises(RuntimeError, match="the reader failed"):
        run("cpu", [64], SMALL, repeats=1, out=tmp_path, fault=1)


@pytest.mark.parametrize("mode, layout, fault, caught", [
    ("runs", "layer_outer", "merge-short", "hold other bytes"),
    ("runs_blocks_outer", "blocks_outer", "merge-short", "hold other bytes"),
    # merge-long needs a boundary to join across (one run has none: it does nothing
    # there); across the layer-outer probe's regions it may read past a registered
    # region and fail in NIXL instead, so the engine harness is its negative control.
])
def test_a_wrong_merge_fails_the_probe(tmp_path, mode, layout, fault, caught):
    """Negative control: ``connector.runs.merge``'s fault of a run one piece short must
    fail the probe's block-by-block check, not report a rate."""
    with pytest.raises(RuntimeError, match=f"the reader failed.*runs \\({layout}\\).*{caught}"):
        run("cpu", [64], SMALL, repeats=1, out=tmp_path, modes=[mode], merge_fault=fault)


def test_the_ipc_check_hands_a_tensor_to_another_process():
    # On CUDA this is cudaIpcOpenMemHandle (it said "ok" on the H100); here shared memory.
    assert cuda_ipc_check("cpu") == "ok"

"""``kvhandoff bench --chunks`` end to end on the built-in model at one short context:
the bench's own cluster, its chunk, its pairs and its check of the composition's
plumbing (a smoke test: the figures are the bench's to report; the chunk's KV against a
cold prefill, with its negative control, is tests/test_chunks.py's)."""

from __future__ import annotations

import pytest

from tools.bench.chunks import format_chunks, run_chunks

pytestmark = [pytest.mark.engines, pytest.mark.chunks, pytest.mark.timeout(600)]


def test_the_chunks_bench_runs_reads_the_chunk_and_checks_identity(tmp_path):
    result = run_chunks("builtin", reps=1, contexts=(128,), log_dir=tmp_path,
                        progress=lambda _: None)
    (row,) = result["rows"]
    assert row["identical"], row
    # The composed requests found the chunk's 4 full blocks; the whole ones nothing.
    assert (row["composed_cached_tokens"], row["whole_cached_tokens"]) == (128, 0)
    assert row["first_token_speedup"] > 0 and "identical" in format_chunks(result)

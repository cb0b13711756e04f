"""tools.bench.nixl_probe: the raw NIXL READ the bench sets the engines' READs against,
between two real processes on this host."""

from __future__ import annotations

import pytest

from tools.bench.nixl_probe import RawReader, read_gbps


@pytest.mark.timeout(120)
def test_raw_reader_reads_the_owners_bytes_at_any_size_up_to_its_capacity() -> None:
    """One owner process for many READs (the bench takes one beside every cold handoff):
    each size comes back checked (the reader zeroes its buffer after each READ, so a READ
    that moved nothing fails), median no faster than best; sizes outside the capacity
    are refused."""
    with RawReader(8 << 20) as raw:
        for size in (1 << 20, 8 << 20, 1 << 20):
            median, best = raw.gbps(size)
            assert 0 < median <= best
        with pytest.raises(ValueError):
            raw.gbps(16 << 20)
    assert read_gbps(4 << 20, 2) > 0

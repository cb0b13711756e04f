"""The proto contract: the checked-in stubs are exactly what scripts/gen-proto makes."""

from __future__ import annotations


def test_checked_in_stubs_match_the_protos(tmp_path):
    import filecmp
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([str(root / "scripts" / "gen-proto"), str(tmp_path)], check=True)
    generated = sorted((tmp_path / "kvhandoff" / "v1").glob("*_pb2*"))
    assert generated
    for path in generated:
        assert filecmp.cmp(path, root / "kvhandoff" / "v1" / path.name, shallow=False), \
            f"{path.name} is stale: run scripts/gen-proto"

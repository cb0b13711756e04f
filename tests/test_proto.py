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


def test_stage1_sampling_round_trips_and_unset_fields_take_the_defaults():
    from kvhandoff.types import Stage1Params
    from kvhandoff.v1 import common_pb2
    from wire import common as engine_pb

    params = Stage1Params(max_tokens=7, temperature=0.5, top_p=0.75, top_k=3, seed=11,
                          stop_token_ids=(2, 5), ignore_eos=True, min_tokens=4)
    assert engine_pb.stage1_from_pb(engine_pb.stage1_to_pb(params)) == params
    defaults = engine_pb.stage1_from_pb(common_pb2.Stage1Sampling(), default_stop_ids=(2,))
    assert defaults == Stage1Params(max_tokens=256, stop_token_ids=(2,), ignore_eos=False)

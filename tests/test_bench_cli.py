"""``kvhandoff bench --chunks MODE``: which measurements each mode runs, in which order,
and what its report and JSON hold (the measurements faked: they are
tests/test_bench_chunks.py's and tests/test_bench_blend.py's, on real engines); and
``--serve-scale``'s flags and outputs (its run faked: tests/test_bench_serve_scale.py
runs it on Ray)."""

from __future__ import annotations

import pytest

from cli.main import build_parser
from tools.bench import main as bench_main


@pytest.fixture
def ran(monkeypatch) -> list[str]:
    """The measurements run, in order; each returns a result naming itself."""
    import tools.bench.blend as blend
    import tools.bench.chunks as chunks

    calls: list[str] = []

    def fake(name: str):
        def measure(*args, **kwargs):
            calls.append(name)
            return {"name": name}
        return measure

    monkeypatch.setattr(chunks, "run_chunks", fake("exact"))
    monkeypatch.setattr(chunks, "format_chunks", lambda r: f"table {r['name']}")
    monkeypatch.setattr(blend, "run_blend_quality", fake("quality"))
    monkeypatch.setattr(blend, "run_blend_speed", fake("speed"))
    monkeypatch.setattr(blend, "format_blend", lambda s, q: f"blend {bool(s)} {bool(q)}")
    return calls


@pytest.mark.parametrize("words, want", [
    ([], ["exact", "quality", "speed"]),
    (["all"], ["exact", "quality", "speed"]),
    (["exact"], ["exact"]),
    (["approximate"], ["quality", "speed"]),
    (["speed"], ["speed"]),
    (["quality"], ["quality"]),
])
def test_each_chunks_mode_runs_its_measurements(ran, words, want, capsys):
    args = build_parser().parse_args(["bench", "--chunks", *words])
    assert bench_main.main_bench(args) == 0
    assert ran == want
    printed = capsys.readouterr().out
    assert ("table exact" in printed) == ("exact" in want)
    assert ("blend" in printed) == ("quality" in want or "speed" in want)


def test_an_unknown_chunks_mode_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--chunks", "blend"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("flags, drain, recomputed, rc", [
    ([], True, 0, 0),
    (["--no-drain"], False, 1, 1),   # a recomputed continuation fails the run
])
def test_serve_scale_runs_with_drain_or_its_control_and_writes_json_and_png(
        monkeypatch, tmp_path, capsys, flags, drain, recomputed, rc):
    """``--serve-scale`` (the run itself: tests/test_bench_serve_scale.py, on Ray): the
    drain flag reaches the run; the report, JSON and PNG come from its result."""
    import json

    import tools.bench.serve_scale as scale

    seen = {}

    def fake(*, drain: bool):
        seen["drain"] = drain
        timeline = [{"t": float(t), "rate": 1.0 if t < 3 else 0.0,
                     "Prefill_RUNNING": 2 if 1 <= t < 4 else 1, "Decode_RUNNING": 1}
                    for t in range(6)]
        calls = [{"call": "StartParent", "t": 0.5, "ok": True, "s": 0.4},
                 {"call": "Continue", "t": 4.5, "ok": True, "s": 0.2,
                  "recomputed": bool(recomputed), "failure": "gone" if recomputed else ""}]
        return scale.summarize(calls, timeline, drain)

    monkeypatch.setattr(scale, "run_serve_scale", fake)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    args = build_parser().parse_args(["bench", "--serve-scale", *flags, "--json", str(out),
                                      "--plot", str(png)])
    assert bench_main.main_bench(args) == rc
    assert seen["drain"] is drain
    result = json.loads(out.read_text())
    assert result["num_recomputed"] == recomputed and result["num_lost"] == 0
    assert result["peak_replicas"] == {"Prefill": 2, "Decode": 1}
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert f"{recomputed} of 1 continuations recomputed" in capsys.readouterr().out

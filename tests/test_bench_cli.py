"""``kvhandoff bench --chunks MODE``: which measurements each mode runs, in which order,
and what its report and JSON hold (the measurements faked: they are
tests/test_bench_chunks.py's and tests/test_bench_blend.py's, on real engines)."""

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

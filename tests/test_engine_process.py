"""What our code sets up inside vLLM's engine processes, without engines."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from connector.nixl_continuation import bound_shm_reader_waits


def test_shm_reader_waits_are_bounded_and_never_lengthened(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast

    monkeypatch.setattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", 5000)
    bound_shm_reader_waits(0)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 5000
    bound_shm_reader_waits(20)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20
    bound_shm_reader_waits(100)
    assert shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS == 20


@pytest.mark.parametrize("level, shown, hidden", [
    ("DEBUG", ["a debug line", "a warning line"], []),
    (None, ["a warning line"], ["a debug line"]),
])
def test_our_records_in_an_engine_process_carry_time_and_level(level, shown, hidden):
    # An engine process configures no root handler: our records must still come out,
    # formatted, at KVHANDOFF_LOG_LEVEL (default WARNING).
    code = textwrap.dedent("""
        import logging
        from connector.logs import use_vllm_handlers
        use_vllm_handlers("connector")
        log = logging.getLogger("connector.nixl_continuation")
        log.debug("a debug line")
        log.warning("a warning line")
    """)
    env = {"PATH": "/usr/bin:/bin"}
    if level:
        env["KVHANDOFF_LOG_LEVEL"] = level
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True, cwd=Path(__file__).parents[1]).stderr
    for text in shown:
        line = next(line for line in err.splitlines() if text in line)
        assert "connector.nixl_continuation" in line and ("WARNING" in line or "DEBUG" in line)
    for text in hidden:
        assert text not in err

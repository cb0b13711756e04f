"""Our log records from inside vLLM's engine processes.

vLLM's engine-core and worker processes configure only the ``vllm`` logger; records of
our modules there would go to Python's last-resort handler (warnings only, no time, no
process). This sends them through vLLM's handlers instead (its format: process, time,
file), at ``KVHANDOFF_LOG_LEVEL`` (``kvhandoff serve --log-level`` sets it for the
engine processes it starts).
"""

from __future__ import annotations

import logging
import os
import sys

LEVEL_ENV = "KVHANDOFF_LOG_LEVEL"


class _ViaVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers, configured or not yet."""

    def __init__(self) -> None:
        super().__init__()
        self._fallback = logging.StreamHandler(sys.stderr)
        self._fallback.setFormatter(logging.Formatter(
            "%(processName)s %(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        # Our loggers' level decides, not vLLM's (VLLM_LOGGING_LEVEL).
        for handler in logging.getLogger("vllm").handlers or [self._fallback]:
            handler.handle(record)


def use_vllm_handlers(*names: str) -> None:
    """Log ``names`` through vLLM's handlers in a process that has no root handler."""
    if logging.getLogger().handlers:
        return  # this process configured logging itself (a server, pytest)
    level = os.environ.get(LEVEL_ENV, "WARNING").upper()
    for name in names:
        package_logger = logging.getLogger(name)
        if package_logger.handlers:
            continue
        package_logger.addHandler(_ViaVllm())
        package_logger.setLevel(level)
        package_logger.propagate = False

"""UCX's log file, written out on demand.

UCX writes its log (``UCX_LOG_FILE``: the protocol tables ``tools.ucx_report`` reads a
READ's transport from) through a buffered stream, and a process that ends with
``os._exit`` (a vLLM worker) never flushes it: the tables written last, a READ's among
them, were lost at times. Light: ctypes only, no NIXL import (the libucs NIXL loaded is
found in this process's memory map)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


@functools.cache
def _ucs_log_flush() -> Any:
    """UCX's ``ucs_log_flush`` from the libucs this process already loaded (NIXL's),
    or None: no ``UCX_LOG_FILE``, or no libucs mapped."""
    if not os.environ.get("UCX_LOG_FILE"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps
                         if "/libucs" in line and ".so" in line), None)
        if path is None:
            return None
        flush = ctypes.CDLL(path).ucs_log_flush  # the loaded copy: same handle
    except (OSError, AttributeError) as e:
        logger.warning("UCX's log cannot be flushed (%s): its last lines may be lost", e)
        return None
    flush.restype = None
    return flush


def flush_ucx_log() -> None:
    """Write out what UCX holds for its log file; a no-op without ``UCX_LOG_FILE``.
    Call it after NIXL loaded UCX (where libucs is first looked up, once for the
    process), e.g. after READs complete, as the connector's worker does."""
    flush = _ucs_log_flush()
    if flush is not None:
        flush()

"""The router's own errors and the one mapping of any exception to the status a caller
sees, shared by the three fronts (gRPC, HTTP, Ray Serve)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import grpc

from kvhandoff.errors import status_for

if TYPE_CHECKING:
    from kvhandoff.types import BeamParams

#: How the router's own overload refusals begin (router.api.Admission); the metrics tell
#: them from a decode pool without room by it.
OVERLOAD_MESSAGE = "router busy"


class RouterError(Exception):
    """An error with a gRPC status decided by the router itself."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def grpc_error(code: grpc.StatusCode, message: str) -> RouterError:
    return RouterError(code, message)


def code_of(exc: BaseException) -> grpc.StatusCode:
    """The status of a router error or an engine call's error."""
    return exc.code if isinstance(exc, RouterError) else exc.code()


def details_of(exc: BaseException) -> str:
    if isinstance(exc, RouterError):
        return str(exc)
    return exc.details() or exc.code().name


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a router caller sees for ``exc`` (every front)."""
    if isinstance(exc, RouterError):
        return exc.code, str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    return status_for(exc)


def none_in_rotation(endpoints: list[Any], role: str, waited_s: float) -> RouterError:
    why = "; ".join(f"{ep.address}: {ep.out_reason or 'drained'}"
                    for ep in endpoints) or "none configured"
    return grpc_error(grpc.StatusCode.UNAVAILABLE,
                      f"no {role} engine is reachable (none in rotation for {waited_s:g} s: "
                      f"{why})")


# RESOURCE_EXHAUSTED answers carry the numbers a client needs to act on them.
def decode_too_small(need: int, biggest: Any, num_prompt_tokens: int,
               beam: BeamParams) -> RouterError:
    """No decode engine can ever hold the request: permanent (INVALID_ARGUMENT, HTTP 400
    without Retry-After), the limits named."""
    cap = biggest.capacity
    return grpc_error(grpc.StatusCode.INVALID_ARGUMENT,
                      f"decode pool too small: needs {need} blocks ({num_prompt_tokens}-token "
                      f"prompt, beam width {beam.beam_width}, {beam.max_tokens} beam "
                      f"tokens), the largest decode engine holds {cap.num_total_blocks} (beam "
                      f"width up to {cap.max_beam_width})")


def decode_queue_full(num_waiting: int, limit: int) -> RouterError:
    return grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"decode queue full: {num_waiting} requests wait for room on a decode "
                      f"engine (limit {limit})")


def no_room_in_time(need: int, most: Any, wait_s: float) -> RouterError:
    return grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"decode pool too small: no decode engine had room for {need} blocks "
                      f"within {wait_s:g} s (most unclaimed: {most.num_unclaimed_blocks} of "
                      f"{most.capacity.num_total_blocks})")


def adapter_named(adapter: str) -> str:
    """An adapter as an error message names it ("": the base model)."""
    return f"adapter {adapter!r}" if adapter else "no adapter (the base model)"

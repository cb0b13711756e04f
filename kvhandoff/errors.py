"""Errors to gRPC status codes, in one place (engine servers and router share it)."""

from __future__ import annotations

import asyncio

import grpc

from kvhandoff.types import HandoffError, InvalidRequest, StageError

#: StageError / HandoffError reasons -> status code. Unknown reasons are INTERNAL.
_REASON_CODES = {
    "capacity": grpc.StatusCode.RESOURCE_EXHAUSTED,
    # A beam group that waited for room (sequences, tokens, blocks) past its limit.
    "beam_room": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "expired": grpc.StatusCode.FAILED_PRECONDITION,
    "digest": grpc.StatusCode.INVALID_ARGUMENT,
    "protocol": grpc.StatusCode.INVALID_ARGUMENT,
    "model": grpc.StatusCode.INVALID_ARGUMENT,
    "malformed": grpc.StatusCode.INVALID_ARGUMENT,
    "missing": grpc.StatusCode.INVALID_ARGUMENT,
    "beam_width": grpc.StatusCode.INVALID_ARGUMENT,
    "import_failed": grpc.StatusCode.UNAVAILABLE,
    "unsigned": grpc.StatusCode.PERMISSION_DENIED,
    "signature": grpc.StatusCode.PERMISSION_DENIED,
    "target": grpc.StatusCode.PERMISSION_DENIED,
    "abort": grpc.StatusCode.CANCELLED,
    "catalog": grpc.StatusCode.NOT_FOUND,
    "no_adapter": grpc.StatusCode.NOT_FOUND,
    # An import under another adapter than the parent's (connector.adapters).
    "adapter": grpc.StatusCode.INVALID_ARGUMENT,
    # An import into a request under another cache salt (connector.blend).
    "salt": grpc.StatusCode.INVALID_ARGUMENT,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a client sees for ``exc`` (never a stack trace)."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (StageError, HandoffError)):
        return _REASON_CODES.get(exc.reason, grpc.StatusCode.INTERNAL), str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    if type(exc).__name__ == "EngineDeadError":
        # vLLM's engine core is gone; the server exits so a supervisor can restart it.
        return grpc.StatusCode.UNAVAILABLE, "engine is down (its engine core failed)"
    if any(t.__name__ == "VLLMClientError" for t in type(exc).__mro__):
        # vLLM refused the request itself (e.g. a sampling parameter it validates).
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ValueError):
        # vLLM's own input checks raise ValueError with a readable message.
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})"

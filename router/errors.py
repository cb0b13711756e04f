"""The router's own errors and the one mapping of any exception to the status a caller
sees, shared by the three fronts (gRPC, HTTP, Ray Serve)."""

from __future__ import annotations

import asyncio

import grpc

from kvhandoff.errors import status_for

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

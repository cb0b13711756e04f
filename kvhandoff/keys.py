"""Bearer keys: the one rule every guarded front applies, and the engine key.

**The rule** (:func:`grants`): a caller presents ``authorization: Bearer <key>`` (gRPC
metadata or the HTTP header); it is granted when that key equals the configured one,
compared in constant time. ``router.auth.Credentials`` (the router's client and operator
keys) and the engine servers (the engine key) both decide through it.

**The engine key**: a P or D given one (``--engine-key-file PATH``, else
``$KVHANDOFF_ENGINE_KEY_FILE``, else ``$KVHANDOFF_ENGINE_KEY``: loaded as the handoff
secret is, never from a command line, never logged) refuses every Engine call without it
(UNAUTHENTICATED, before the call runs); health and reflection stay open. Routers and
tools send it from the same flag or environment (:func:`key_interceptors`).

**Exposure** (:func:`check_exposure`): a server bound beyond loopback must be guarded, by
its key or by mutual TLS (a client CA); otherwise it is refused at start, naming the flag
to add, unless ``--insecure`` says the network itself is trusted (test namespaces).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc

from kvhandoff.ports import is_loopback

ENGINE_KEY_ENV = "KVHANDOFF_ENGINE_KEY"
ENGINE_KEY_FILE_ENV = "KVHANDOFF_ENGINE_KEY_FILE"
#: Fewer bytes than this are refused (a guessable key), as for the handoff secret.
MIN_ENGINE_KEY_BYTES = 16
#: What an engine answers a call without its key.
ENGINE_KEY_REFUSAL = "missing or wrong engine key: send 'authorization: Bearer <engine key>'"


def check_key_form(key: str, what: str) -> None:
    """ValueError unless ``key`` can travel as a bearer token (non-empty, no spaces)."""
    if not key or key != key.strip() or " " in key:
        raise ValueError(f"{what} must be non-empty, without spaces")


def presented_key(authorization: str | None) -> str | None:
    """The key of an ``authorization`` value ``Bearer <key>`` (None for anything else)."""
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" and key.strip() else None


def grants(authorization: str | None, key: str) -> bool:
    """Whether ``authorization`` presents ``key`` (constant-time comparison)."""
    presented = presented_key(authorization)
    return presented is not None and secrets.compare_digest(presented.encode(), key.encode())


def authorization_of(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The ``authorization`` entry of a gRPC call's metadata, if any."""
    for name, value in metadata or ():
        if name == "authorization":
            return value
    return None


def load_engine_key(path: str | None = None,
                    environ: dict[str, str] | None = None) -> str | None:
    """The engine key from ``path``, else ``$KVHANDOFF_ENGINE_KEY_FILE``, else
    ``$KVHANDOFF_ENGINE_KEY`` (empty values count as unset); None when there is none.
    ValueError naming the problem (unreadable file, too short, spaces)."""
    env = os.environ if environ is None else environ
    path = path or env.get(ENGINE_KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the engine key file {path}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    else:
        key = env.get(ENGINE_KEY_ENV, "").strip()
        if not key:
            return None
    check_key_form(key, "the engine key")
    if len(key.encode()) < MIN_ENGINE_KEY_BYTES:
        raise ValueError(f"the engine key is shorter than {MIN_ENGINE_KEY_BYTES} bytes")
    return key


# ---- servers ------------------------------------------------------------------------

def guard_servicer(servicer: Any, service: Any, key: str | None) -> Any:
    """``servicer`` with every method of ``service`` (a protobuf ServiceDescriptor)
    refusing callers that do not present ``key`` (UNAUTHENTICATED, before the method
    runs); ``servicer`` itself when ``key`` is None. Register the result in its place:
    the generated ``add_*Servicer_to_server`` reads only the methods by name."""
    if key is None:
        return servicer

    async def refuse_unless_granted(context: grpc.aio.ServicerContext) -> None:
        if not grants(authorization_of(context.invocation_metadata()), key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, ENGINE_KEY_REFUSAL)

    def unary(method):
        async def call(request, context):
            await refuse_unless_granted(context)
            return await method(request, context)
        return call

    def server_streaming(method):
        async def call(request, context):
            await refuse_unless_granted(context)
            async for item in method(request, context):
                yield item
        return call

    methods = {}
    for m in service.methods:
        assert not m.client_streaming, f"{m.full_name}: client streaming is not guarded"
        wrap = server_streaming if m.server_streaming else unary
        methods[m.name] = wrap(getattr(servicer, m.name))
    return SimpleNamespace(**methods)


def is_wildcard(host: str) -> bool:
    """Whether binding ``host`` listens on every interface."""
    return host.strip("[]") in ("", "0.0.0.0", "::", "*")


def check_exposure(host: str, *, guarded: bool, insecure: bool, add: str) -> None:
    """ValueError (one line naming the flags to add: ``add``) for a server about to
    bind ``host`` beyond loopback without a guard (a key, or mutual TLS), unless
    ``insecure`` says so on purpose."""
    if guarded or insecure or is_loopback(host):
        return
    raise ValueError(f"--host {host} takes calls from other hosts: add {add}, or mutual "
                     "TLS (--tls-cert, --tls-key, --tls-client-ca), or --insecure on a "
                     "trusted network")


# ---- clients ------------------------------------------------------------------------

def _with_key(details: grpc.aio.ClientCallDetails, key: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add("authorization", f"Bearer {key}")
    return details._replace(metadata=metadata)


class _KeyUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: str):
        self.key = key

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self.key), request)


class _KeyUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: str):
        self.key = key

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_key(client_call_details, self.key), request)


def key_interceptors(key: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a ``grpc.aio`` channel that send ``key`` on every call (none
    for ``None``)."""
    return [] if key is None else [_KeyUnaryUnary(key), _KeyUnaryStream(key)]


class _SyncKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, key: str):
        self.key = key

    def _details(self, details):
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {self.key}")]
        return _SyncDetails(details.method, details.timeout, metadata,
                            details.credentials, details.wait_for_ready,
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready = credentials, wait_for_ready
        self.compression = compression


def with_key(channel: grpc.Channel, key: str | None) -> grpc.Channel:
    """A blocking ``channel`` that sends ``key`` on every call (itself for ``None``)."""
    return channel if key is None else grpc.intercept_channel(channel, _SyncKey(key))


__all__ = ["ENGINE_KEY_ENV", "ENGINE_KEY_FILE_ENV", "MIN_ENGINE_KEY_BYTES", "check_exposure",
           "check_key_form", "grants", "guard_servicer", "is_wildcard", "key_interceptors",
           "load_engine_key", "presented_key", "with_key"]

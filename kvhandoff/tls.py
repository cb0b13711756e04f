"""Optional TLS and mutual TLS for every gRPC server and channel.

Servers: ``--tls-cert``/``--tls-key`` (PEM) turn TLS on; ``--tls-client-ca`` also requires
client certificates signed by that CA (mutual TLS). Channels (the router to its engines,
the client to the router): ``--tls-ca`` verifies the server; ``--tls-client-cert`` /
``--tls-client-key`` present a client certificate. Without them, plaintext, which is
meant for 127.0.0.1 (every server binds it unless ``--host`` says otherwise; a server
bound elsewhere needs a key or a client CA: ``kvhandoff.keys.check_exposure``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from kvhandoff.keys import key_interceptors


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _check_files(*paths: str | None) -> None:
    for path in paths:
        if path and not Path(path).is_file():
            raise ValueError(f"TLS file not found: {path}")


@dataclass(frozen=True)
class ServerTLS:
    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca),
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ChannelTLS:
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca),
                                            private_key=_read(self.key),
                                            certificate_chain=_read(self.cert))


def server_tls(cert: str | None, key: str | None, client_ca: str | None) -> ServerTLS | None:
    if not cert and not key and not client_ca:
        return None
    if not (cert and key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    _check_files(cert, key, client_ca)
    return ServerTLS(cert, key, client_ca)


def channel_tls(ca: str | None, cert: str | None, key: str | None) -> ChannelTLS | None:
    if not ca and not cert and not key:
        return None
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both --tls-client-cert and "
                         "--tls-client-key")
    _check_files(ca, cert, key)
    return ChannelTLS(ca, cert, key)


def add_port(server: grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


def aio_channel(address: str, tls: ChannelTLS | None, options: list | None = None,
                key: str | None = None) -> grpc.aio.Channel:
    """A channel to ``address`` (TLS with ``tls``) whose every call sends the bearer
    ``key`` (``kvhandoff.keys``: the engine key), if any."""
    interceptors = key_interceptors(key) or None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options,
                                   interceptors=interceptors)

"""ZMQ CURVE keys for an engine's KV events, from a secret file its routers share.

An engine whose events leave its host (``kvhandoff serve --kv-events HOST``) needs
``--kv-events-key FILE``: its event PUB and its replay ROUTER then take only CURVE
clients holding the key (encrypted, authenticated: ZMQ's ZAP checks the client's public
key), and a router given the same file reads them. Both key pairs are derived from the
file's bytes (SHA-256 under two labels; any 32 bytes are a Curve25519 secret), so one
secret, distributed like the handoff secret, is the whole set-up.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Fewer bytes of secret than this are refused (a guessable key).
MIN_SECRET_BYTES = 16


def _z85_secret(seed: bytes, label: bytes) -> bytes:
    from zmq.utils import z85

    return z85.encode(hashlib.sha256(label + seed).digest())


@dataclass(frozen=True)
class EventKeys:
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_file(cls, path: str | Path) -> EventKeys:
        """The keys of the secret in ``path``; ValueError naming the file when it cannot
        be read or is too short."""
        import zmq

        try:
            seed = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"KV events key {path}: {e.strerror or e}") from None
        if len(seed) < MIN_SECRET_BYTES:
            raise ValueError(f"KV events key {path}: {len(seed)} bytes, at least "
                             f"{MIN_SECRET_BYTES} needed")
        server = _z85_secret(seed, b"kvhandoff kv-events server\0")
        client = _z85_secret(seed, b"kvhandoff kv-events client\0")
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)

    @property
    def fingerprint(self) -> str:
        """A short, public name of these keys (for logs): the server key's hash."""
        return base64.b32encode(hashlib.sha256(self.server_public).digest())[:8].decode()

    def serve(self, sock: Any) -> None:
        """Make ``sock`` (before bind) a CURVE server with these keys."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)

    def connect(self, sock: Any) -> None:
        """Make ``sock`` (before connect) a CURVE client the server accepts."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

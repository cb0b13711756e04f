"""Who may call the router: one rule for every front (gRPC, HTTP, Ray Serve).

Two bearer keys, each optional, both compared in constant time:
- the **client key** (``--api-key``): every request (Generate, StartParent, Continue,
  completions) must carry it as ``authorization: Bearer <key>`` (gRPC metadata or the
  HTTP header);
- the **operator key** (``--operator-key``): Drain, Move, ReleaseParent, ListChunks and
  DeleteChunk, and any request that names a negative-control fault, must carry it. It also passes as a client.

With neither key set the router is open, as a loopback development setup is (mutual TLS,
where configured, still guards the connection). With a client key but no operator key,
operator calls are refused: the client's key never grants them. Health and reflection
stay open (load balancers probe them; they carry no data).

A key is granted by ``kvhandoff.keys.grants``, the one rule the engines' key follows too.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from kvhandoff.keys import authorization_of, check_key_form, grants
from router.errors import RouterError

CLIENT = "client"
OPERATOR = "operator"
#: Where a router (``kvhandoff serve --role router``, the Serve deployment) and the
#: clients take the keys from when no flag names them.
API_KEY_ENV = "KVHANDOFF_API_KEY"
OPERATOR_KEY_ENV = "KVHANDOFF_OPERATOR_KEY"


def need_of(fault: str | None) -> str:
    """What a request needs granted: OPERATOR when it names a negative-control fault
    (it breaks an engine on purpose), else CLIENT. Every front asks this, with the
    fault its wire carries."""
    return OPERATOR if fault else CLIENT


@dataclass(frozen=True)
class Credentials:
    client_key: str | None = None
    operator_key: str | None = None

    def __post_init__(self) -> None:
        for name in ("client_key", "operator_key"):
            key = getattr(self, name)
            if key is not None:
                check_key_form(key, name.replace("_", " "))
        if self.client_key and self.client_key == self.operator_key:
            raise ValueError("the operator key must differ from the client key")

    @property
    def open(self) -> bool:
        return self.client_key is None and self.operator_key is None

    def check(self, authorization: str | None, need: str) -> None:
        """Raises the caller's refusal (UNAUTHENTICATED: no or a wrong key;
        PERMISSION_DENIED: a client key where an operator call needs the operator's)
        unless ``authorization`` (the header's or metadata's value) grants ``need``."""
        if self.open:
            return
        operator = self.operator_key is not None and grants(authorization, self.operator_key)
        if need == OPERATOR:
            if operator:
                return
            if self.operator_key is None:
                raise RouterError(grpc.StatusCode.PERMISSION_DENIED,
                                  "operator calls (Drain, Move, ReleaseParent, chunk "
                                  "listing and deletion, faults) are "
                                  "off: the router has no --operator-key")
            if self.client_key is not None and grants(authorization, self.client_key):
                raise RouterError(grpc.StatusCode.PERMISSION_DENIED,
                                  "an operator call needs the operator key, not the "
                                  "client's")
            raise RouterError(grpc.StatusCode.UNAUTHENTICATED,
                              "an operator call needs 'authorization: Bearer <operator key>'")
        if operator or self.client_key is None or grants(authorization, self.client_key):
            return
        raise RouterError(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong API key: send 'authorization: Bearer <key>'")


def grpc_authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The ``authorization`` metadata of a gRPC call, if any."""
    return authorization_of(context.invocation_metadata())

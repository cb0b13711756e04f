"""Signed handoffs: a handoff is a capability only the right decode engine can redeem.

With a shared secret configured (a file holding at least 16 bytes, named by the engine's
``handoff_secret_file`` or ``KVHANDOFF_HANDOFF_SECRET_FILE``, or the secret itself in
``KVHANDOFF_HANDOFF_SECRET``; never on a command line, never logged), P signs every
export with HMAC-SHA256 over the fields that say what may be read and by whom: P's
engine, side-channel address and request, the block list, the token count and digest,
the lease end, and the target D engine id. D refuses, before any READ,
a handoff that is unsigned, whose signature does not match (tampered or signed with
another secret), that is addressed to another engine, or whose lease is over.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from connector.handoff import SIGNED_FIELDS
from connector.params import KEY
from kvhandoff.types import HandoffError

SECRET_FILE_ENV = "KVHANDOFF_HANDOFF_SECRET_FILE"
SECRET_ENV = "KVHANDOFF_HANDOFF_SECRET"
MIN_SECRET_BYTES = 16

#: Signed fields: vLLM's NIXL transport fields, then ours (under ``KEY``).
_TRANSPORT, _HANDOFF = SIGNED_FIELDS


def load_secret(path: str | None = None,
                environ: dict[str, str] | None = None) -> bytes | None:
    """The shared secret from ``path``, else from the environment; None when handoffs
    are not signed."""
    env = os.environ if environ is None else environ
    path = path or env.get(SECRET_FILE_ENV)
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as e:
            raise ValueError(f"cannot read the handoff secret file: {e}") from None
    else:
        secret = env.get(SECRET_ENV, "").encode()
        if not secret:
            return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"handoff secret shorter than {MIN_SECRET_BYTES} bytes")
    return secret


def _message(params: dict[str, Any]) -> bytes:
    fields = params.get(KEY) or {}
    data = {"transport": [params.get(k) for k in _TRANSPORT],
            "handoff": [fields.get(k) for k in _HANDOFF]}
    # Tuples and lists serialise alike: P holds tuples, D gets lists from the wire.
    return json.dumps(data, sort_keys=True, separators=(",", ":"), default=list).encode()


def sign(params: dict[str, Any], secret: bytes) -> str:
    return hmac.new(secret, _message(params), hashlib.sha256).hexdigest()


def verify(params: dict[str, Any], secret: bytes, engine_ids: set[str]) -> None:
    """Raise :class:`HandoffError` unless ``params`` carry a valid signature for one of
    ``engine_ids`` (this D's engine id and any group it answers for)."""
    fields = params.get(KEY) or {}
    signature = fields.get("signature")
    if not isinstance(signature, str) or not signature:
        raise HandoffError("unsigned", "handoff is not signed and this engine requires "
                                       "signed handoffs")
    try:
        expected = sign(params, secret)
    except (TypeError, ValueError):
        raise HandoffError("signature", "handoff signature does not match") from None
    if not hmac.compare_digest(expected, signature):
        raise HandoffError("signature", "handoff signature does not match (tampered, or "
                                        "signed with another secret)")
    target = fields.get("target_engine_id")
    if target not in engine_ids:
        raise HandoffError("target", f"handoff is addressed to engine {target!r}, not "
                                     "this one")

"""router.auth: who may call the router, the one rule every front applies. Each refusal
beside the call that passes with the right key."""

from __future__ import annotations

import grpc
import pytest

from router.auth import CLIENT, OPERATOR, Credentials
from router.errors import RouterError


def _code(creds: Credentials, authorization: str | None, need: str) -> grpc.StatusCode | None:
    try:
        creds.check(authorization, need)
    except RouterError as e:
        return e.code
    return None


OK = None
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("client_key,operator_key,authorization,need,want", [
    # No keys: open (a loopback development router).
    (None, None, None, CLIENT, OK),
    (None, None, None, OPERATOR, OK),
    # A client key: requests need it; operator calls are off without an operator key.
    ("ck", None, None, CLIENT, UNAUTH),
    ("ck", None, "Bearer wrong", CLIENT, UNAUTH),
    ("ck", None, "Basic ck", CLIENT, UNAUTH),
    ("ck", None, "Bearer ck", CLIENT, OK),
    ("ck", None, "bearer  ck ", CLIENT, OK),
    ("ck", None, "Bearer ck", OPERATOR, DENIED),
    # Both keys: the client's key never grants an operator call; the operator's grants both.
    ("ck", "ok", "Bearer ck", OPERATOR, DENIED),
    ("ck", "ok", None, OPERATOR, UNAUTH),
    ("ck", "ok", "Bearer ok", OPERATOR, OK),
    ("ck", "ok", "Bearer ok", CLIENT, OK),
    # Only an operator key: requests open, operator calls by key.
    (None, "ok", None, CLIENT, OK),
    (None, "ok", None, OPERATOR, UNAUTH),
    (None, "ok", "Bearer ok", OPERATOR, OK),
])
def test_the_rule(client_key, operator_key, authorization, need, want) -> None:
    assert _code(Credentials(client_key, operator_key), authorization, need) == want


def test_refusals_say_what_to_send() -> None:
    with pytest.raises(RouterError, match="Bearer"):
        Credentials("ck").check(None, CLIENT)
    with pytest.raises(RouterError, match="no --operator-key"):
        Credentials("ck").check("Bearer ck", OPERATOR)
    with pytest.raises(RouterError, match="not the client's"):
        Credentials("ck", "ok").check("Bearer ck", OPERATOR)


@pytest.mark.parametrize("client_key,operator_key", [("", None), ("a b", None), ("k", "k")])
def test_bad_keys_are_refused_at_start(client_key, operator_key) -> None:
    with pytest.raises(ValueError):
        Credentials(client_key, operator_key)

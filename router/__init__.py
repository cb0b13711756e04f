"""The gRPC router (``kvhandoff serve --role router``): a :class:`Router` wired from small
parts (``config``, ``errors``, ``plan``, ``endpoint``, ``snapshots``, ``decode_queue``,
``pool``, ``parents``, ``chunk_registry``, ``rotation``, ``stages``, ``moves``,
``executor``, ``continuations``, ``chunks``, ``warmup``; ``docs/structure.md`` has the
picture), one request API under its fronts (``api``: admission, runs, errors; it takes
and gives the types of ``requests``), and the fronts (``service``: gRPC, and
``deploy.router_server``: Ray Serve, both converting with ``grpc_wire``; ``http``:
OpenAI-compatible HTTP), which import nothing else of the router but ``auth``,
``errors`` and ``config``; ``main`` starts the process. Imports no engine: vLLM stays out of the router."""

from __future__ import annotations

from router.api import Admission, RouterAPI
from router.config import RouterConfig
from router.core import Router
from router.endpoint import ADMIT_S, Claim, Endpoint
from router.errors import RouterError, status_of
from router.plan import Outcome, Plan, to_result

__all__ = ["ADMIT_S", "Admission", "Claim", "Endpoint", "Outcome", "Plan", "Router",
           "RouterAPI", "RouterConfig", "RouterError", "status_of", "to_result"]

"""The gRPC router (``kvhandoff serve --role router``): plans each two-stage request
(``plan``, the only part that touches the Router service's protobuf), picks P and D from
capacity snapshots and claims (``capacity``), runs stage 1 on P and stage 2 on D with
failover (``core``), warms up each (P, D) pair (``warmup``), serves gRPC (``service``) and
Prometheus metrics (``metrics``). Imports no engine: vLLM stays out of the router."""

from __future__ import annotations

from router.capacity import ADMIT_S, Claim, Endpoint
from router.core import Router, RouterConfig
from router.plan import Outcome, Plan, RouterError, to_response

__all__ = ["ADMIT_S", "Claim", "Endpoint", "Outcome", "Plan", "Router", "RouterConfig",
           "RouterError", "to_response"]

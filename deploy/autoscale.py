"""The application-level autoscaling policy: Prefill and Decode replica counts decided
together, from what the engines report.

Serve's controller calls :class:`PDScalePolicy` every control-loop tick with one
``AutoscalingContext`` per autoscaled deployment of the application (named in the Serve
config's ``autoscaling_policy``; Prefill and Decode need ``autoscaling`` in the args).
Each engine replica reports its pool (``EngineServer.record_autoscaling_stats``: the
numbers the request routers also route by), which Serve averages per replica over
``look_back_period_s``:

- Prefill is sized by stage-1 queueing: the requests running or waiting in P's engines
  plus those queued in Serve's handles for Prefill, ``prefill_queue_per_replica`` each.
- Decode is sized by its reserved KV blocks (total - free), keeping
  ``decode_free_fraction`` of the pool free, and by its requests (running on D or queued
  for Decode), ``decode_requests_per_replica`` each: whichever asks more.
- Together: within ``max_engine_replicas`` (P + D), shared in proportion to what each
  role asks, each keeping its ``min_replicas``.

Serve then applies each deployment's bounds, factors and up/down delays (its wrapper of
application policies), and picks which replica to stop on a scale-down (its own rule:
not running yet, then by node, newest first). A stopping engine replica drains first
(``EngineServer.__del__``), so the policy needs no say in which one goes.

Serve pickles this module by value into its controller; what it imports there
(``deploy.args``) must be importable on the head node.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from deploy.args import PDScaling

logger = logging.getLogger("kvhandoff.deploy")

PREFILL, DECODE = "Prefill", "Decode"


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """One role as the policy sees it: its replicas and what they report (summed over the
    replicas that have reported; ``num_reporting`` 0: nothing known yet)."""

    num_replicas: int
    target_replicas: int
    min_replicas: int
    max_replicas: int
    num_reporting: int = 0
    outstanding: float = 0.0
    queued: float = 0.0
    free_blocks: float = 0.0
    total_blocks: float = 0.0


def prefill_replicas(p: RoleLoad, knobs: PDScaling) -> int:
    """P replicas for stage-1 queueing (the current target while nothing is reported)."""
    if not p.num_reporting:
        return p.target_replicas
    return math.ceil((p.outstanding + p.queued) / knobs.prefill_queue_per_replica)


def decode_replicas(d: RoleLoad, knobs: PDScaling) -> int:
    """D replicas for the KV its requests reserve and for their number."""
    if not d.num_reporting or d.total_blocks <= 0:
        return d.target_replicas
    per_replica = d.total_blocks / d.num_reporting
    reserved = d.total_blocks - d.free_blocks
    by_blocks = math.ceil(reserved / ((1.0 - knobs.decode_free_fraction) * per_replica))
    by_requests = math.ceil((d.outstanding + d.queued) / knobs.decode_requests_per_replica)
    return max(by_blocks, by_requests)


def _clip(n: int, role: RoleLoad) -> int:
    return max(role.min_replicas, min(role.max_replicas, n))


def decide(p: RoleLoad, d: RoleLoad, knobs: PDScaling) -> tuple[int, int]:
    """(P replicas, D replicas): each role's own need within its bounds, then, over
    ``max_engine_replicas``, the budget split in proportion to the needs (P rounded
    down, D the rest), neither below its minimum."""
    want_p, want_d = _clip(prefill_replicas(p, knobs), p), _clip(decode_replicas(d, knobs), d)
    cap = knobs.max_engine_replicas
    if cap is None or want_p + want_d <= cap:
        return want_p, want_d
    share_p = max(p.min_replicas, math.floor(cap * want_p / (want_p + want_d)))
    share_d = max(d.min_replicas, cap - share_p)
    return min(want_p, share_p), min(want_d, share_d)


def role_load(ctx: Any) -> RoleLoad:
    """A deployment's ``AutoscalingContext`` as a :class:`RoleLoad`: the custom metrics
    (per replica, averaged over the look-back window) summed over running replicas."""
    metrics = ctx.aggregated_metrics or {}
    running = set(ctx.running_replicas)

    def total(name: str) -> tuple[int, float]:
        values = [v for r, v in (metrics.get(name) or {}).items() if r in running]
        return len(values), float(sum(values))

    num_reporting, outstanding = total("outstanding")
    _, free = total("free_blocks")
    _, blocks = total("num_total_blocks")
    return RoleLoad(
        num_replicas=ctx.current_num_replicas, target_replicas=ctx.target_num_replicas,
        min_replicas=ctx.capacity_adjusted_min_replicas,
        max_replicas=ctx.capacity_adjusted_max_replicas,
        num_reporting=num_reporting, outstanding=outstanding,
        queued=float(ctx.total_queued_requests or 0.0), free_blocks=free,
        total_blocks=blocks)


class PDScalePolicy:
    """Serve's application-level policy object: built once with the config's
    ``policy_kwargs`` (validated as :class:`deploy.args.PDScaling`), then called each
    tick with the application's contexts by deployment id; returns the replica counts
    of Prefill and Decode (those present) and no state of its own."""

    def __init__(self, **policy_kwargs: Any):
        self.knobs = PDScaling.model_validate(policy_kwargs)

    def __call__(self, contexts: dict[Any, Any]) -> tuple[dict[Any, int], dict[Any, dict]]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        if PREFILL not in by_name or DECODE not in by_name:
            # One role fixed (no ``autoscaling``): the other keeps Serve's target.
            return {dep_id: ctx.target_num_replicas
                    for dep_id, ctx in contexts.items()}, {}
        (p_id, p_ctx), (d_id, d_ctx) = by_name[PREFILL], by_name[DECODE]
        p, d = role_load(p_ctx), role_load(d_ctx)
        n_p, n_d = decide(p, d, self.knobs)
        if (n_p, n_d) != (p.target_replicas, d.target_replicas):
            logger.info("P:D %d:%d -> %d:%d (P queue %.1f + %.1f; D reserved %.0f of %.0f "
                        "blocks, %.1f requests)", p.target_replicas, d.target_replicas,
                        n_p, n_d, p.outstanding, p.queued, d.total_blocks - d.free_blocks,
                        d.total_blocks, d.outstanding + d.queued)
        return {p_id: n_p, d_id: n_d}, {}

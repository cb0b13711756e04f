"""The application-level autoscaling policy (``deploy.autoscale``) over synthetic Serve
contexts, without a Ray cluster: P follows stage-1 queueing, D its reserved KV blocks
and its requests, both within their bounds and a shared budget; loaded through Serve's
own policy loader and wrapper, as the controller does."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from deploy.args import PDScaling
from deploy.autoscale import PDScalePolicy, RoleLoad, decide

APP = "kvhandoff"
KNOBS = PDScaling(prefill_queue_per_replica=2, decode_free_fraction=0.25,
                  decode_requests_per_replica=4)


def _role(**kw) -> RoleLoad:
    base = dict(num_replicas=1, target_replicas=1, min_replicas=1, max_replicas=4,
                num_reporting=1, total_blocks=100.0, free_blocks=100.0)
    return RoleLoad(**{**base, **kw})


def test_prefill_follows_stage1_queueing_and_decode_its_reserved_blocks():
    idle = decide(_role(), _role(), KNOBS)
    assert idle == (1, 1)
    # 5 running or waiting in P's engine + 2 queued in Serve's handles, 2 per replica.
    assert decide(_role(outstanding=5, queued=2), _role(), KNOBS) == (4, 1)
    assert decide(_role(outstanding=3), _role(), KNOBS) == (2, 1)
    # D: 2 replicas of 100 blocks with 170 reserved: 170 / 75 -> 3.
    d = _role(num_replicas=2, num_reporting=2, total_blocks=200, free_blocks=30)
    assert decide(_role(), d, KNOBS) == (1, 3)
    # D's requests ask more than its blocks: 9 requests, 4 each -> 3.
    assert decide(_role(), _role(outstanding=7, queued=2), KNOBS) == (1, 3)


def test_bounds_and_the_shared_budget():
    busy = _role(outstanding=100, free_blocks=0)
    assert decide(busy, busy, KNOBS) == (4, 4)
    capped = KNOBS.model_copy(update={"max_engine_replicas": 5})
    # Both want 4: 5 shared in proportion (P rounded down), each keeping its minimum.
    assert decide(busy, busy, capped) == (2, 3)
    assert decide(_role(outstanding=100), _role(), capped) == (4, 1)
    lone = KNOBS.model_copy(update={"max_engine_replicas": 2})
    assert decide(busy, busy, lone) == (1, 1)
    # Scaled in to the minimum when idle, never below.
    assert decide(_role(num_replicas=3, target_replicas=3), _role(min_replicas=2,
                  num_replicas=4, target_replicas=4), KNOBS) == (1, 2)


def test_nothing_reported_keeps_the_target():
    starting = _role(num_reporting=0, target_replicas=3, total_blocks=0)
    assert decide(starting, starting, KNOBS) == (3, 3)


def _ctx(name: str, replicas: int, metrics: dict[str, list[float]], queued: float = 0.0,
         lo: int = 1, hi: int = 3) -> tuple[DeploymentID, AutoscalingContext]:
    dep = DeploymentID(name=name, app_name=APP)
    ids = [ReplicaID(unique_id=f"{name}-{i}", deployment_id=dep) for i in range(replicas)]
    config = AutoscalingConfig(min_replicas=lo, max_replicas=hi, upscale_delay_s=0,
                               downscale_delay_s=0)
    aggregated = {k: dict(zip(ids, values, strict=True)) for k, values in metrics.items()}
    return dep, AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name=APP,
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=queued, total_queued_requests=queued,
        aggregated_metrics=aggregated, raw_metrics={}, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=time.time(), config=config)


def _serve_policy(**kwargs):
    """The policy as Serve's controller runs it: loaded from the config's import path
    and kwargs (pickled by value), wrapped with each deployment's bounds and delays."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config

    spec = AutoscalingPolicy(policy_function="deploy.autoscale:PDScalePolicy",
                             policy_kwargs=kwargs)
    return _apply_app_level_autoscaling_config(_resolve_policy_callable(spec))


def test_serve_loads_the_policy_and_scales_both_roles_from_the_engines_reports():
    policy = _serve_policy(prefill_queue_per_replica=2, decode_free_fraction=0.25)
    p_id, p = _ctx("Prefill", 1, {"outstanding": [6.0], "free_blocks": [90.0],
                                  "num_total_blocks": [100.0]}, queued=1)
    d_id, d = _ctx("Decode", 1, {"outstanding": [1.0], "free_blocks": [10.0],
                                 "num_total_blocks": [100.0]})
    decisions, _ = policy({p_id: p, d_id: d})
    # P: 7 / 2 -> 4, bounded to 3; D: 90 reserved of 100 -> 2.
    assert decisions == {p_id: 3, d_id: 2}
    # Idle again: back to the minimums (the delays are 0 here).
    p_id, p = _ctx("Prefill", 3, {"outstanding": [0.0] * 3, "free_blocks": [100.0] * 3,
                                  "num_total_blocks": [100.0] * 3})
    d_id, d = _ctx("Decode", 2, {"outstanding": [0.0] * 2, "free_blocks": [100.0] * 2,
                                 "num_total_blocks": [100.0] * 2})
    assert policy({p_id: p, d_id: d})[0] == {p_id: 1, d_id: 1}


def test_a_control_serve_default_policy_does_not_see_decode_kv():
    """The control: Serve's own policy counts calls only. One wide beam search is one
    call on D but reserves most of its KV (90 of 100 blocks here): Serve's policy keeps
    one D replica (1 call, 4 per replica), this policy adds one."""
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    d_id, d = _ctx("Decode", 1, {"outstanding": [1.0], "free_blocks": [10.0],
                                 "num_total_blocks": [100.0]})
    d._total_num_requests_value = 1.0
    d.config = AutoscalingConfig(min_replicas=1, max_replicas=3, upscale_delay_s=0,
                                 downscale_delay_s=0, target_ongoing_requests=4)
    assert math.ceil(replica_queue_length_autoscaling_policy(d)[0]) == 1
    p_id, p = _ctx("Prefill", 1, {"outstanding": [0.0]})
    assert PDScalePolicy()({p_id: p, d_id: d})[0][d_id] == 2


def test_bad_knobs_are_refused_when_serve_loads_the_policy():
    with pytest.raises(ValidationError, match="decode_free_fraction"):
        _serve_policy(decode_free_fraction=1.0)
    with pytest.raises(ValidationError, match="Extra inputs"):
        _serve_policy(prefill_queue=4)


def test_a_fixed_role_keeps_its_count():
    d_id, d = _ctx("Decode", 2, {"outstanding": [50.0, 50.0]})
    assert PDScalePolicy()({d_id: d}) == ({d_id: 2}, {})


class _Engine:
    """What ``EngineServer.__del__`` uses of an engine: a pool that becomes clean after
    ``clean_after_s``, and a shutdown."""

    engine_id = "p0"

    def __init__(self, clean_after_s: float):
        self.clean_at = time.monotonic() + clean_after_s
        self.waited_s: float | None = None
        self.stopped_at: float | None = None

    async def wait_pool_clean(self, timeout_s: float):
        from engine.stats import PoolSnapshot

        start = time.monotonic()
        while time.monotonic() < min(self.clean_at, start + timeout_s):
            await asyncio.sleep(0.01)
        self.waited_s = time.monotonic() - start
        used = 0 if time.monotonic() >= self.clean_at else 3
        return PoolSnapshot(num_total_blocks=10, num_used_blocks=used, num_running_reqs=0,
                            num_waiting_reqs=0, block_size=16)

    def shutdown(self) -> None:
        self.stopped_at = time.monotonic()


# Python's collector calls ``__del__`` again once the object goes (Serve awaited it
# already); that second call's coroutine is never run, which is what it should do.
@pytest.mark.filterwarnings("ignore:coroutine 'EngineServer.__del__' was never awaited")
@pytest.mark.parametrize("drain_s,clean_after_s,waits", [
    (1.0, 0.2, True),    # held KV let go within drain_s: stops once it is
    (0.3, 5.0, True),    # still held at drain_s: stops then
    (0.0, 5.0, False),   # the control: stops at once, whatever is held
])
def test_a_stopping_engine_replica_waits_for_its_kv_within_drain_s(drain_s, clean_after_s,
                                                                    waits):
    from deploy.engine_server import EngineServer

    server = EngineServer.func_or_class.__new__(EngineServer.func_or_class)
    server.drain_s, server.engine = drain_s, _Engine(clean_after_s)
    start = time.monotonic()
    asyncio.run(server.__del__())
    took = server.engine.stopped_at - start
    assert server.engine.stopped_at is not None
    if not waits:
        assert server.engine.waited_s is None and took < 0.1
    else:
        assert min(drain_s, clean_after_s) - 0.05 <= took <= min(drain_s, clean_after_s) + 0.5

"""``build_app(args) -> Application``: kvhandoff as a Ray Serve application.

``serve run deploy/config.yaml`` (GPU nodes) or ``deploy/config-cpu.yaml`` imports
``deploy.app:build_app`` with the YAML's ``args``; :class:`deploy.args.AppArgs` validates
them before anything starts. Deployments: ``Prefill`` and ``Decode`` (one vLLM engine per
replica) and ``Router``, the application's ingress (the ``kvhandoff.v1.Router`` gRPC
service via Serve's gRPC proxy, which must list
``kvhandoff.v1.router_pb2_grpc.add_RouterServicer_to_server``, and the router's
OpenAI-compatible HTTP front via Serve's HTTP proxy, under the route prefix).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from deploy.args import AppArgs, RoleArgs
from deploy.engine_server import EngineServer
from deploy.router_server import RouterServer

#: Calls a router replica takes beyond ``max_inflight`` (Move, Drain, health checks).
CONTROL_CALLS = 16

#: What Serve's gRPC proxy needs (``grpc_options.grpc_servicer_functions``).
GRPC_SERVICER_FUNCTIONS = ["kvhandoff.v1.router_pb2_grpc.add_RouterServicer_to_server"]


def role_options(a: AppArgs, role: RoleArgs, name: str) -> dict[str, Any]:
    actor: dict[str, Any] = {"num_cpus": role.num_cpus, "num_gpus": a.gpus(role)}
    if role.resources:
        actor["resources"] = dict(role.resources)
    if role.runtime_env:
        actor["runtime_env"] = role.runtime_env
    opts: dict[str, Any] = {
        "name": name,
        "ray_actor_options": actor,
        # A vLLM engine takes a while to start (weights, KV pool, NIXL registration).
        "health_check_period_s": 10,
        "health_check_timeout_s": 60,
        # Serve's wait for the calls running on a stopping replica, then the engine's
        # own for the KV it holds (``EngineServer.__del__``).
        "graceful_shutdown_timeout_s": 30 + a.drain_s(role),
        "max_ongoing_requests": max(8, role.engine.max_num_seqs),
    }
    if role.autoscaling is not None:
        opts["autoscaling_config"] = role.autoscaling.model_dump()
    else:
        opts["num_replicas"] = role.num_replicas
    return opts


def router_options(a: AppArgs) -> dict[str, Any]:
    owner: dict[str, Any] = {}
    if a.router.num_replicas > 1:
        # Calls naming a parent or a running request go to the replica owning its id.
        # Serve's proxy runs this router: it imports deploy.request_router (the repo on
        # its PYTHONPATH, or in the image); one replica needs no routing.
        owner["request_router_config"] = RequestRouterConfig(
            request_router_class="deploy.request_router:OwnerRouter",
            request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0)
    return {
        "name": "Router", "num_replicas": a.router.num_replicas, **owner,
        # Above max_inflight: calls reach the router's own admission, which refuses the
        # excess at once (RESOURCE_EXHAUSTED), instead of waiting in Serve's queue; the
        # margin lets Move and Drain through a full router.
        "max_ongoing_requests": a.router.max_inflight + CONTROL_CALLS,
        "ray_actor_options": {"num_cpus": a.router.num_cpus,
                              **({"resources": dict(a.router.resources)}
                                 if a.router.resources else {})},
    }


def resources_needed(a: AppArgs) -> dict[str, float]:
    """CPUs, GPUs and custom resources the application asks Ray for when every deployment
    runs its (minimum) replicas."""
    need = {"CPU": 0.0, "GPU": 0.0}

    def add(replicas: int, resources: dict[str, float]) -> None:
        for name, amount in resources.items():
            need[name] = need.get(name, 0.0) + replicas * amount

    for role in (a.prefill, a.decode):
        replicas = role.autoscaling.min_replicas if role.autoscaling else role.num_replicas
        add(replicas, {"CPU": role.num_cpus, "GPU": a.gpus(role), **role.resources})
    add(a.router.num_replicas, {"CPU": a.router.num_cpus, **a.router.resources})
    return need


def check_fits(a: AppArgs, cluster: dict[str, float]) -> None:
    """Refuse, with the numbers, an application the Ray cluster cannot hold even empty:
    Serve would otherwise wait forever for replicas it cannot schedule."""
    for resource, amount in resources_needed(a).items():
        have = float(cluster.get(resource, 0.0))
        if amount > have + 1e-9:
            raise ValueError(
                f"the application needs {amount:g} {resource}s (Prefill, Decode and Router "
                f"replicas x what each asks) but the Ray cluster has {have:g}: lower "
                "num_cpus / num_replicas / resources in the config, or add nodes")


def build_app(args: dict[str, Any] | AppArgs) -> Application:
    a = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    import ray

    if ray.is_initialized():  # serve run / serve deploy: the cluster is known here
        check_fits(a, ray.cluster_resources())
    prefill_opts = role_options(a, a.prefill, "Prefill")
    # Stop and Release reach the P replica they name; with placement by cache, stage 1
    # the replica holding its prompt (the router's handle passes prompts only then).
    prefill_opts["request_router_config"] = RequestRouterConfig(
        request_router_class="deploy.request_router:PrefillRouter",
        request_router_kwargs={"kv_events_key_file": a.router.kv_events_key_file},
        request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0)
    prefill = EngineServer.options(**prefill_opts).bind(
        "prefill", a.model, a.engine_kwargs(a.prefill),
        a.prefill.engine.side_channel_host, a.prefill.engine.side_channel_port,
        a.drain_s(a.prefill))
    decode_opts = role_options(a, a.decode, "Decode")
    decode_opts["request_router_config"] = RequestRouterConfig(
        request_router_class="deploy.request_router:CapacityRouter",
        request_routing_stats_period_s=1.0, request_routing_stats_timeout_s=5.0)
    # Replicas behind the handle share one handoff address: P signs for the group, and
    # whichever replica the handle routes stage 2 to may redeem it.
    decode = EngineServer.options(**decode_opts).bind(
        "decode", a.model, {**a.engine_kwargs(a.decode), "handoff_group": "Decode"},
        a.decode.engine.side_channel_host, a.decode.engine.side_channel_port,
        a.drain_s(a.decode))
    return RouterServer.options(**router_options(a)).bind(
        prefill, decode, a.model, a.router.colocated_below_tokens, a.router.max_beam_width,
        a.router.max_inflight, a.router.placement == "cache")

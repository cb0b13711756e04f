"""The Ray Serve application's arguments and YAML files, checked without starting Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deploy.args import AppArgs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["config.yaml", "config-cpu.yaml"])
def test_shipped_configs_validate_and_build(name):
    from ray.serve.schema import ServeDeploySchema

    from deploy.app import GRPC_SERVICER_FUNCTIONS, build_app

    cfg = yaml.safe_load((ROOT / "deploy" / name).read_text())
    ServeDeploySchema.model_validate(cfg)
    assert cfg["grpc_options"]["grpc_servicer_functions"] == GRPC_SERVICER_FUNCTIONS
    (app,) = cfg["applications"]
    assert app["import_path"] == "deploy.app:build_app"
    build_app(app["args"])
    if "autoscaling_policy" in app:  # the application's P:D policy and its knobs
        from deploy.args import PDScaling

        assert app["autoscaling_policy"]["policy_function"] == "deploy.autoscale:PDScalePolicy"
        PDScaling.model_validate(app["autoscaling_policy"].get("policy_kwargs", {}))
        assert all(app["args"][role].get("autoscaling") for role in ("prefill", "decode"))


@pytest.mark.parametrize("args,message", [
    ({"prefill": {"model": "/other"}}, "P and D must run the same model"),
    ({"decode": {"engine": {"block_size": 64}}}, "block sizes differ"),
    ({"decode": {"engine": {"max_logprobs": 16}}}, "needs decode.engine.max_logprobs >= 128"),
    ({"decode": {"num_gpus": 0.5}}, "fractional GPUs"),
    ({"decode": {"engine": {"tensor_parallel_size": 2}, "num_gpus": 1}}, ">= tensor_parallel_size"),
    ({"device": "cpu", "prefill": {"num_gpus": 1}}, "num_gpus must be 0"),
    ({"decode": {"engine": {"max_model_len": 1024}}}, "max_model_len must be >="),
    ({"prefill": {"runtime_env": {"pip": ["vllm==0.32.0"]}},
      "decode": {"runtime_env": {"pip": ["vllm==0.31.0"]}}}, "same vLLM"),
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas"),
    ({"prefill": {"engine": {"kv_cache_gb": 3}}}, "Extra inputs are not permitted"),
    # A search's beams run as one batch on D (issue 46: 512 beside 128 was accepted).
    ({"router": {"max_beam_width": 512}, "decode": {"engine": {"max_num_seqs": 128,
                                                                "max_logprobs": 1024}},
      "prefill": {"engine": {"max_logprobs": 1024}}},
     "needs decode.engine.max_num_seqs >= 512"),
    ({"router": {"num_replicas": 0}}, "greater than 0"),
    # KV events carry prompts: off loopback only with a key, and the router reads them
    # with the same key.
    ({"prefill": {"engine": {"kv_events_host": "10.0.0.5"}}}, "needs kv_events_key_file"),
    ({"prefill": {"engine": {"kv_events_host": "10.0.0.5", "kv_events_key_file": "/k"}}},
     "needs router.kv_events_key_file"),
    ({"router": {"placement": "random"}}, "'cache' or 'load'"),
])
def test_bad_args_are_refused_with_the_reason(args, message):
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(args)


@pytest.mark.parametrize("knobs,message", [
    ({"prefill_queue_per_replica": 0}, "greater than 0"),
    ({"decode_free_fraction": 1}, "less than 1"),
    ({"decode_free_fraction": -0.1}, "greater than or equal to 0"),
    ({"decode_requests_per_replica": -1}, "greater than 0"),
    ({"max_engine_replicas": 0}, "greater than 0"),
    ({"prefill_queue": 4}, "Extra inputs are not permitted"),
])
def test_bad_scaling_knobs_are_refused(knobs, message):
    from deploy.args import PDScaling

    with pytest.raises(ValidationError, match=message):
        PDScaling.model_validate(knobs)


def test_a_stopping_engine_drains_within_its_graceful_shutdown():
    """Serve's graceful shutdown of an engine replica covers Serve's wait for its calls
    (30 s) and the engine's own drain: for an autoscaled role P's lease + 15 s unless
    ``drain_s`` says; a fixed role does not drain unless told."""
    from deploy.app import role_options

    a = AppArgs.model_validate({"lease_s": 20, "decode": {"drain_s": 0},
                                "prefill": {"autoscaling": {"max_replicas": 3,
                                                            "downscale_delay_s": 5}}})
    assert a.drain_s(a.prefill) == 35 and a.drain_s(a.decode) == 0
    assert role_options(a, a.prefill, "Prefill")["graceful_shutdown_timeout_s"] == 65
    assert role_options(a, a.decode, "Decode")["graceful_shutdown_timeout_s"] == 30
    scaling = role_options(a, a.prefill, "Prefill")["autoscaling_config"]
    assert scaling["downscale_delay_s"] == 5 and scaling["max_replicas"] == 3
    fixed = AppArgs.model_validate({"decode": {"drain_s": 12}})
    assert fixed.drain_s(fixed.prefill) == 0 and fixed.drain_s(fixed.decode) == 12
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        AppArgs.model_validate({"prefill": {"drain_s": -1}})


def test_gpu_defaults_reserve_whole_gpus_per_replica():
    a = AppArgs.model_validate({"decode": {"engine": {"tensor_parallel_size": 2}}})
    assert a.gpus(a.decode) == 2 and a.gpus(a.prefill) == 1
    kw = a.engine_kwargs(a.decode)
    assert kw["tensor_parallel_size"] == 2 and kw["cpu_threads"] is None
    cpu = AppArgs.model_validate({"device": "cpu"})
    assert cpu.gpus(cpu.prefill) == 0 and cpu.engine_kwargs(cpu.prefill)["cpu_threads"] == 1


def test_the_cpu_config_fits_two_cores_and_one_that_cannot_fit_is_refused_with_the_numbers():
    """deploy/config-cpu.yaml asks for 1.75 CPUs: it fits the 2-core machines the README
    names. Its earlier values (1 + 1 + 0.5 = 2.5 CPUs) made Serve wait forever on 2
    cores; build_app now refuses such an application, naming what it needs and has."""
    from deploy.app import check_fits, resources_needed

    cfg = yaml.safe_load((ROOT / "deploy" / "config-cpu.yaml").read_text())
    args = AppArgs.model_validate(cfg["applications"][0]["args"])
    assert resources_needed(args) == {"CPU": 1.75, "GPU": 0.0}
    check_fits(args, {"CPU": 2.0})
    old = cfg["applications"][0]["args"]
    old["prefill"]["num_cpus"] = old["decode"]["num_cpus"] = 1
    old["router"]["num_cpus"] = 0.5
    with pytest.raises(ValueError, match=r"needs 2\.5 CPUs .* the Ray cluster has 2"):
        check_fits(AppArgs.model_validate(old), {"CPU": 2.0})
    gpu = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())
    with pytest.raises(ValueError, match="GPUs"):
        check_fits(AppArgs.model_validate(gpu["applications"][0]["args"]), {"CPU": 64.0})


def test_custom_resources_place_each_role_and_count_in_what_the_app_needs():
    """`resources` per role goes into the replicas' Ray options (how P and D land on
    different nodes) and into what the application needs; a cluster without such a
    node is refused naming the resource."""
    from deploy.app import check_fits, resources_needed, role_options

    args = AppArgs.model_validate({
        "device": "cpu", "prefill": {"num_cpus": 0.5, "resources": {"prefill_node": 1}},
        "decode": {"num_cpus": 0.5, "resources": {"decode_node": 1},
                   "engine": {"ucx_net_devices": "eth1"}},
        "router": {"num_cpus": 0.25, "resources": {"prefill_node": 0.1}}})
    assert role_options(args, args.prefill, "Prefill")["ray_actor_options"]["resources"] == {
        "prefill_node": 1}
    assert resources_needed(args) == {"CPU": 1.25, "GPU": 0.0, "prefill_node": 1.1,
                                      "decode_node": 1.0}
    assert args.engine_kwargs(args.decode)["ucx_net_devices"] == "eth1"
    assert args.engine_kwargs(args.prefill)["ucx_net_devices"] is None
    check_fits(args, {"CPU": 4.0, "prefill_node": 2.0, "decode_node": 1.0})
    with pytest.raises(ValueError, match=r"needs 1 decode_nodes .* has 0"):
        check_fits(args, {"CPU": 4.0, "prefill_node": 2.0})


def test_the_router_replica_takes_more_calls_than_its_max_inflight():
    """Serve queues calls beyond a replica's ``max_ongoing_requests`` with no time bound:
    the router's must be above ``router.max_inflight`` for its own guard to answer the
    excess at once (tests/test_ray_serve.py floods it)."""
    from deploy.app import CONTROL_CALLS, router_options

    opts = router_options(AppArgs.model_validate({"router": {"max_inflight": 7}}))
    assert opts["name"] == "Router" and opts["max_ongoing_requests"] == 7 + CONTROL_CALLS


def test_adapters_go_to_the_engines_of_their_role():
    args = AppArgs.model_validate({
        "device": "cpu", "prefill": {"engine": {"adapters": {"a": "/models/lora-a"}}},
        "decode": {"engine": {"adapters": {"a": "/models/lora-a"}}}})
    assert args.engine_kwargs(args.prefill)["adapters"] == (("a", "/models/lora-a"),)
    plain = AppArgs.model_validate({"device": "cpu"})
    assert "adapters" not in plain.engine_kwargs(plain.decode)  # LoRA stays off


def test_catalogs_go_to_the_engines_of_their_role():
    """``engine.catalogs`` (as ``kvhandoff serve --catalog``): EngineConfig's, per role;
    "builtin" is resolved on the replica (tests/test_ray_serve.py runs one)."""
    a = AppArgs.model_validate({"device": "cpu", "decode": {"engine": {
        "catalogs": {"shop": "builtin", "other": "/data/other.txt"}}}})
    assert a.engine_kwargs(a.decode)["catalogs"] == (("shop", "builtin"),
                                                     ("other", "/data/other.txt"))
    assert "catalogs" not in a.engine_kwargs(a.prefill)


def test_p_is_placed_by_cache_unless_the_config_says_load():
    """Prefill's request router is PrefillRouter (Stop and Release to the replica they
    name), with the router's events key; ``router.placement: cache`` (the default) has
    the router's handle pass prompts to place stage 1 by, ``load`` does not (Serve's
    own order)."""
    from deploy.app import build_app

    def prefill_and_router(args):
        router = build_app(AppArgs.model_validate(args))._bound_deployment
        return router.init_args[0]._bound_deployment, router

    keyed = {"device": "cpu", "router": {"kv_events_key_file": "/keys/events"},
             "prefill": {"engine": {"kv_events_host": "10.0.0.5",
                                    "kv_events_key_file": "/keys/events"}}}
    prefill, router = prefill_and_router(keyed)
    config = prefill._deployment_config.request_router_config
    assert config.request_router_class == "deploy.request_router:PrefillRouter"
    assert config.request_router_kwargs == {"kv_events_key_file": "/keys/events"}
    assert router.init_args[-1] is True
    a = AppArgs.model_validate(keyed)
    assert a.engine_kwargs(a.prefill)["kv_events_host"] == "10.0.0.5"
    prefill, router = prefill_and_router({"device": "cpu", "router": {"placement": "load"}})
    assert router.init_args[-1] is False

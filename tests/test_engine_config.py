"""EngineConfig -> vLLM engine arguments, without starting an engine."""

from __future__ import annotations

import socket

import pytest

from engine import EngineConfig, engine_env


def test_cpu_engines_prefill_a_prompt_in_one_step(model_dir):
    """vLLM 0.32's CPU worker kills the engine when a seeded request's prefill is chunked
    ("CPU Generator does not use offset"), so on CPU chunking is off and one step's token
    budget covers the longest prompt."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU default")
    args = EngineConfig(model=model_dir, role="prefill", max_model_len=8192,
                        max_num_batched_tokens=2048).engine_args("p")
    assert args.enable_chunked_prefill is False
    assert args.max_num_batched_tokens == 8192


def test_chunked_prefill_can_be_chosen(model_dir):
    args = EngineConfig(model=model_dir, role="decode", max_num_batched_tokens=2048,
                        chunked_prefill=True).engine_args("d")
    assert args.enable_chunked_prefill is True and args.max_num_batched_tokens == 2048


@pytest.mark.parametrize("field,value", [("role", "both"), ("block_size", 24),
                                         ("kv_cache_memory_bytes", 0), ("max_logprobs", 1),
                                         ("lease_safety_margin_s", 30.0),
                                         ("onednn_cache_capacity", -1)])
def test_bad_settings_are_refused(model_dir, field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        EngineConfig(**{"model": model_dir, "role": "prefill", field: value})


def test_engines_start_with_onednns_primitive_cache_bounded(model_dir, monkeypatch):
    # oneDNN's default (1024 batch shapes) grew P's worker ~320 KB per request under load.
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    config = EngineConfig(model=model_dir, role="prefill")
    assert engine_env(config, 5600)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")  # the operator's wins
    assert engine_env(config, 5600)["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    unbounded = EngineConfig(model=model_dir, role="prefill", onednn_cache_capacity=None)
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in engine_env(unbounded, 5600)


def test_engines_read_gpu_memory_with_cuda_ipc_where_ucx_sees_no_nvlink(model_dir, monkeypatch):
    # UCX's default ("auto") turns cuda_ipc READs off without NVLink: on an H100 the probe
    # (tools/gpu_probe) then read at 0.5 GB/s over tcp/lo, 1.5 TB/s with this set.
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    config = EngineConfig(model=model_dir, role="decode")
    assert config.on_cpu_host and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in engine_env(config, 5600)
    monkeypatch.setattr(EngineConfig, "on_cpu_host", property(lambda self: False))  # a GPU
    assert engine_env(config, 5600)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "y"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto")  # the operator's wins
    assert engine_env(config, 5600)["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"


def test_free_ports_are_distinct_bindable_and_not_ephemeral():
    from kvhandoff.ports import FREE_PORT_FLOOR, ephemeral_floor, free_port

    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(FREE_PORT_FLOOR <= p < ephemeral_floor() for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_ports_are_not_handed_to_two_processes(monkeypatch):
    """Two processes drawing from one narrow range (as the servers of one test lane do)
    never get the same port: 2 x 200 draws from 1000 ports would share ~40 without the
    host-wide reservation."""
    import subprocess
    import sys

    from kvhandoff.ports import FREE_PORT_FLOOR, free_port, port_range

    low = max(port_range()[0], FREE_PORT_FLOOR)
    monkeypatch.setenv("KVHANDOFF_PORT_RANGE", f"{low}-{low + 1000}")
    other = subprocess.run(
        [sys.executable, "-c", "from kvhandoff.ports import free_port\n"
         "print(' '.join(str(free_port()) for _ in range(200)))"],
        capture_output=True, text=True, check=True, timeout=60)
    theirs = {int(p) for p in other.stdout.split()}
    ours = {free_port() for _ in range(200)}
    assert len(theirs) == len(ours) == 200
    assert all(low <= p < low + 1000 for p in theirs | ours)
    assert not theirs & ours


def test_kv_events_stay_on_loopback_unless_asked(model_dir, tmp_path):
    """KV events carry every prompt's token ids: an engine whose side channel is on a
    network address still publishes them on loopback; ``serve --kv-events off`` turns
    them off, ``--kv-events HOST`` exposes them on purpose, and only with a key (CURVE:
    tests/test_kv_events_keys.py); without one it is refused naming the flag."""
    from cli.engine_args import engine_kwargs
    from cli.main import build_parser

    def kwargs(*flags: str) -> dict:
        args = build_parser().parse_args(["serve", "--role", "decode", "--model", model_dir,
                                          "--side-channel-host", "10.213.7.1", *flags])
        return engine_kwargs(args)

    default = EngineConfig(role="decode", **kwargs())
    assert default.side_channel_host == "10.213.7.1"
    assert default.kv_events and default.kv_events_host == "127.0.0.1"
    assert not EngineConfig(role="decode", **kwargs("--kv-events", "off")).kv_events
    key = tmp_path / "events.key"
    key.write_text("x" * 32)
    exposed = EngineConfig(role="decode", **kwargs("--kv-events", "10.213.7.1",
                                                   "--kv-events-key", str(key)))
    assert exposed.kv_events and exposed.kv_events_host == "10.213.7.1"
    assert exposed.kv_events_key_file == str(key)
    with pytest.raises(ValueError, match="--kv-events-key"):
        EngineConfig(role="decode", **kwargs("--kv-events", "10.213.7.1"))


def test_gpu_memory_share_from_the_environment(model_dir, monkeypatch):
    """Engines sharing one GPU each take a share of its memory (vLLM's
    gpu_memory_utilization), from the config or KVHANDOFF_GPU_MEMORY_SHARE; not on CPU."""
    monkeypatch.delenv("KVHANDOFF_GPU_MEMORY_SHARE", raising=False)
    assert EngineConfig(model=model_dir, role="decode").gpu_share is None
    monkeypatch.setenv("KVHANDOFF_GPU_MEMORY_SHARE", "0.3")
    config = EngineConfig(model=model_dir, role="decode")
    assert config.gpu_share == 0.3
    assert config.engine_args("d").gpu_memory_utilization != 0.3  # CPU: vLLM's own
    monkeypatch.setattr(EngineConfig, "on_cpu_host", property(lambda self: False))  # a GPU
    assert config.engine_args("d").gpu_memory_utilization == 0.3
    with pytest.raises(ValueError, match="gpu_memory_share"):
        EngineConfig(model=model_dir, role="decode", gpu_memory_share=1.5)

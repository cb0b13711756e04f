"""The CUDA runner, checked here: every engine runs vLLM's v1 model runner, whose
logits-processor interface the positional sampler implements (on CUDA with Triton vLLM
0.32 would pick Model Runner V2 and refuse it). The choice is an environment variable
(``engine.config.engine_env``); these tests pin that vLLM honours it where it would
choose V2, that the GPU config's engines are given it, and that a running engine's
processes decide by it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def _vllm_picks_v2(monkeypatch) -> bool:
    """vLLM's own choice (``VllmConfig.use_v2_model_runner``) on a machine with Triton
    and no feature that rules V2 out: what a CUDA node sees."""
    import vllm.config.vllm as vllm_config

    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)
    stub = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None),
                           _get_v2_model_runner_unsupported_features=lambda: [])
    return vllm_config.VllmConfig.use_v2_model_runner.fget(stub)


def test_vllm_would_pick_model_runner_v2_on_cuda_and_the_engines_setting_stops_it(
        monkeypatch):
    from engine.config import EngineConfig, engine_env

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert _vllm_picks_v2(monkeypatch), "vLLM no longer picks V2 by default: revisit"
    cfg = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())["applications"][0]
    from deploy.args import AppArgs

    args = AppArgs.model_validate(cfg["args"])
    assert args.device == "cuda"
    for name, role in (("prefill", args.prefill), ("decode", args.decode)):
        config = EngineConfig(model=str(ROOT), role=name, **args.engine_kwargs(role))
        env = engine_env(config, 5600)
        assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env["VLLM_USE_V2_MODEL_RUNNER"])
        assert not _vllm_picks_v2(monkeypatch)


def test_the_gpu_configs_engines_schedule_synchronously_as_on_cpu(model_dir):
    """vLLM turns async scheduling on by default on GPUs (off on CPU, by its platform);
    our schedulers subclass Scheduler, not AsyncScheduler, so every engine asks for it
    off (vLLM decides only where it is None: V/config/vllm.py, "async_scheduling is None")."""
    from deploy.args import AppArgs
    from engine.config import EngineConfig

    cfg = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())["applications"][0]
    args = AppArgs.model_validate(cfg["args"])
    config = EngineConfig(model=model_dir, role="decode", **args.engine_kwargs(args.decode))
    engine_args = config.engine_args("decode-test")
    assert engine_args.async_scheduling is False


@pytest.mark.parametrize("name", ["POSITIONAL_SAMPLER", "BEAM_SLOT_PROCESSOR"])
def test_model_runner_v2_refuses_our_logits_processors(name):
    """Why the pin: V2's loader refuses the v1-interface classes by name (the positional
    sampler and the beam slots' processor, both in every engine's list)."""
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_by_fqcns,
    )

    import engine.config

    qualname = getattr(engine.config, name)
    config = engine.config.EngineConfig(model="m", role="decode")
    assert qualname in config.engine_args("x").logits_processors
    with pytest.raises(ValueError, match="is not a subclass of"):
        _load_v2_logitsprocs_by_fqcns([qualname])


@pytest.mark.engines
def test_every_process_of_a_running_engine_decides_the_runner_by_our_setting(cluster):
    """vLLM's engine core decides its runner from the setting: with it, vLLM returns
    before its Triton check, so the warning that check logs ("Model Runner V2 requires
    Triton; using the V1 model runner instead", printed by every P and D here before the
    setting, and by the server process too) is in no server's log, while the engine
    core's own lines are. (/proc/PID/environ cannot say: vLLM renames its engine-core
    process, which overwrites that memory.)"""
    for server in (cluster["prefill"], *cluster["decode"]):
        log = server.log_path.read_text(errors="replace")
        assert "(EngineCore pid=" in log, f"{server.role}: no engine-core lines in its log"
        assert "Model Runner V2 requires Triton" not in log, (
            f"{server.role}: vLLM reached its own runner choice; VLLM_USE_V2_MODEL_RUNNER "
            "did not reach it")

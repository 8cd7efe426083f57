"""vLLM's eager or compiled mode per engine (`rollout.enforce_eager`): compiled with CUDA graphs on GPU by
default, eager on CPU and wherever the workers capture the routes themselves; the clash named; the CPU MLA
attention backend for fp32 latent-attention models (no vLLM, no Ray)."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.launcher import engine_specs
from megatron_rl.rollout import engine as engine_module
from megatron_rl.rollout.engine import EngineError, EngineSpec, VLLMEngine
from megatron_rl.rollout.engine_mode import core_in_process, cpu_attention_backend, eager_mode
from megatron_rl.rollout.teacher import teacher_specs
from megatron_rl.weights.engine.worker import WeightUpdateExtension

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


@pytest.mark.parametrize(
    ("enforce_eager", "hook_routes", "on_gpu", "eager"),
    [
        (None, False, True, False),  # GPU: torch.compile and CUDA graphs
        (None, False, False, True),  # CPU: eager
        (None, True, True, True),  # worker-side capture needs the eager model
        (True, False, True, True),
        (False, False, False, False),  # asked for on CPU: compiled
        (True, True, False, True),
    ],
)
def test_eager_mode_defaults_and_settings(enforce_eager, hook_routes, on_gpu, eager):
    assert eager_mode(enforce_eager, hook_routes, on_gpu) is eager


def test_compiled_mode_with_hook_capture_is_refused_naming_the_engine_and_setting():
    with pytest.raises(ValueError, match="enforce_eager=false cannot capture routes in the workers"):
        eager_mode(False, True, True)
    spec = EngineSpec("engine-3", "unused", capture_routes=True, native_routes=False, enforce_eager=False)
    with pytest.raises(EngineError, match=r"engine engine-3: rollout.enforce_eager=false"):
        VLLMEngine(spec)._eager()


def test_a_refused_mode_is_a_start_error_that_ready_reports(monkeypatch):
    monkeypatch.setattr(engine_module, "_vllm", lambda: types.SimpleNamespace(AsyncEngineArgs=dict, AsyncLLM=None))
    monkeypatch.setattr(engine_module, "prepare_engine_process", lambda spec, on_gpu: None)
    spec = EngineSpec("engine-3", "unused", capture_routes=True, native_routes=False, enforce_eager=False)
    engine = VLLMEngine(spec)

    async def start_then_ready():
        with pytest.raises(EngineError):
            await engine.start()
        await engine.ready(timeout_s=1.0)  # a waiting trainer: the start error, not a timeout

    with pytest.raises(EngineError, match=r"engine engine-3: vLLM did not start \(EngineError: .*enforce_eager=false"):
        asyncio.run(start_then_ready())


def test_native_routes_keep_the_gpu_default_compiled(monkeypatch):
    monkeypatch.setattr(engine_module, "_on_gpu", lambda: True)
    native = EngineSpec("e", "unused", capture_routes=True, native_routes=True)
    hooks = EngineSpec("e", "unused", capture_routes=True, native_routes=False)
    assert VLLMEngine(native)._eager() is False
    assert VLLMEngine(hooks)._eager() is True


def test_the_setting_reaches_policy_and_teacher_engines(tmp_path):
    cfg = load_config(QUICKSTART, ["rollout.enforce_eager=false", "rollout.num_engines=2"])
    assert [s.enforce_eager for s in engine_specs(cfg, str(tmp_path))] == [False, False]
    cfg = load_config(QUICKSTART, ["distill.teacher=snapshot", "rollout.enforce_eager=true"])
    assert [s.enforce_eager for s in teacher_specs(cfg)] == [True] * cfg.distill.num_engines
    assert load_config(QUICKSTART).rollout.enforce_eager is None


@pytest.mark.parametrize(
    ("asked", "workers", "on_gpu", "in_process"),
    [
        (None, 1, False, True),  # a one-worker CPU engine: its core in the actor's process
        (None, 2, False, False),  # tensor or data parallel: vLLM starts the workers from its core's process
        (None, 1, True, False),  # GPU: vLLM's own process schedules beside the device
        (False, 1, False, False),
        (True, 1, True, True),
    ],
)
def test_engine_core_in_process_defaults_and_settings(asked, workers, on_gpu, in_process):
    assert core_in_process(asked, workers, on_gpu) is in_process


def test_an_in_process_core_is_refused_for_several_workers():
    with pytest.raises(ValueError, match="engine_core_in_process=true needs engines of one worker, not 2"):
        core_in_process(True, 2, False)
    spec = EngineSpec("engine-5", "unused", tensor_parallel=2, engine_core_in_process=True)
    with pytest.raises(EngineError, match=r"engine engine-5: rollout.engine_core_in_process=true needs engines"):
        VLLMEngine(spec)._in_process()


def test_the_core_setting_reaches_policy_and_teacher_engines(tmp_path):
    assert load_config(QUICKSTART).rollout.engine_core_in_process is None
    cfg = load_config(QUICKSTART, ["rollout.engine_core_in_process=false", "rollout.num_engines=2"])
    assert [s.engine_core_in_process for s in engine_specs(cfg, str(tmp_path))] == [False, False]
    cfg = load_config(QUICKSTART, ["distill.teacher=snapshot", "rollout.engine_core_in_process=true"])
    assert [s.engine_core_in_process for s in teacher_specs(cfg)] == [True] * cfg.distill.num_engines


def test_routing_perturbation_is_refused_on_a_compiled_engine():
    worker = WeightUpdateExtension()
    worker.model_runner = types.SimpleNamespace(model_config=types.SimpleNamespace(enforce_eager=False))
    with pytest.raises(RuntimeError, match="needs an eager engine"):
        worker.mrl_perturb_routing(0.5)


@pytest.mark.parametrize(
    ("config", "dtype", "on_gpu", "backend"),
    [
        ({"kv_lora_rank": 512}, "float32", False, "CPU_MLA"),  # AMX hosts would pick a bf16-only backend
        ({"kv_lora_rank": 512}, "torch.float32", False, "CPU_MLA"),
        ({"kv_lora_rank": 512}, "bfloat16", False, None),  # vLLM's own choice (AMX where the CPU has it)
        ({"kv_lora_rank": 512}, "auto", False, None),
        ({"kv_lora_rank": 512}, "float32", True, None),
        ({"kv_lora_rank": None}, "float32", False, None),  # no latent attention
        ({"num_attention_heads": 4}, "float32", False, None),
        (None, "float32", False, None),  # no config.json: vLLM's choice (it names the problem)
    ],
)
def test_cpu_attention_backend(tmp_path, config, dtype, on_gpu, backend):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert cpu_attention_backend(tmp_path, dtype, on_gpu) == backend


def test_engine_args_ask_for_the_cpu_mla_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "_on_gpu", lambda: False)
    (tmp_path / "config.json").write_text(json.dumps({"kv_lora_rank": 512}))
    vllm = types.SimpleNamespace(AsyncEngineArgs=dict)
    args = VLLMEngine(EngineSpec("e", str(tmp_path), dtype="float32"))._engine_args(vllm)
    assert args["attention_backend"] == "CPU_MLA"
    assert VLLMEngine(EngineSpec("e", str(tmp_path)))._engine_args(vllm)["attention_backend"] is None  # bf16

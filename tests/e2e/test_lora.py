"""The LoRA quickstart end to end (issue 17, must-show 3): `configs/lora_quickstart.yaml` trains rank-8 adapters
on attention and every expert of the tiny Qwen3-MoE, each weight push carries the adapters only (merged by the
engine onto its W0), and the exported policy is the merged model."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open

from megatron_rl.config import load_config
from megatron_rl.launcher import run_training
from megatron_rl.metrics.logger import read_metrics
from megatron_rl.models import family_for_hf_config, read_hf_config
from megatron_rl.models.lora import adapter_rule_table, hf_adapter_shapes
from megatron_rl.run_state import step_dir
from megatron_rl.verify.parity import hf_logprobs
from megatron_rl.weights.convert import mcore_to_hf
from tests.distributed.test_lora_export import peft_logprobs

pytestmark = pytest.mark.e2e
CONFIG = "configs/lora_quickstart.yaml"


def adapter_bytes(hf: str, cfg) -> int:
    """Bytes of the run's peft-named adapter tensors (fp32), from the checkpoint's headers."""
    config = read_hf_config(hf)
    family = family_for_hf_config(config)
    table = adapter_rule_table(family, family.arch_from_hf(config), cfg.lora.targets)
    with safe_open(f"{hf}/model.safetensors", "pt") as f:
        shapes = hf_adapter_shapes(table, cfg.lora.rank, lambda name: tuple(f.get_slice(name).get_shape()))
    return 4 * sum(math.prod(shape) for shape in shapes.values())


def weight_bytes(hf: str) -> int:
    """Bytes of the whole checkpoint (what a full sync of this fp32 model carries)."""
    with safe_open(f"{hf}/model.safetensors", "pt") as f:
        return sum(4 * math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118


def _run(tmp_path, *overrides):
    cfg = load_config(CONFIG, [f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", *overrides])
    summary = run_training(cfg)
    return cfg, summary, read_metrics(tmp_path / "lora_quickstart" / "metrics.jsonl")


def _check_adapter_only_pushes(tmp_path, cfg, records) -> None:
    adapters = adapter_bytes(f"{tmp_path}/tiny", cfg)
    assert adapters < weight_bytes(f"{tmp_path}/tiny") / 5  # rank 8 on a hidden size of 64: 14%
    received = [r["sync/received_bytes"] for r in records]
    assert all(adapters <= b <= adapters * 1.01 for b in received), (received, adapters)


def test_lora_quickstart_three_steps_push_adapters_only(tmp_path):
    cfg, summary, records = _run(tmp_path, "steps=3", "checkpoint.export_final=false")
    assert len(records) == 3
    _check_adapter_only_pushes(tmp_path, cfg, records)
    acc = summary["accounting"]
    assert acc["consumed"] == cfg.steps * cfg.prompts_per_step


@pytest.mark.slow
def test_lora_quickstart_learns_within_ten_minutes(tmp_path):
    cfg, summary, records = _run(tmp_path, f"checkpoint.save_dir={tmp_path}/ckpt")  # saved after the last step
    assert len(records) == cfg.steps
    assert records[0]["reward/mean"] < 0.3, "reward should start near chance (about 0.06)"
    best = max(r["reward/mean"] for r in records)
    assert best >= 0.9, [round(r["reward/mean"], 3) for r in records]
    assert summary["wall_seconds"] < 600
    _check_adapter_only_pushes(tmp_path, cfg, records)
    acc = summary["accounting"]
    assert acc["produced"] == acc["consumed"] + acc["dropped"] + acc["buffered"] + acc["in_flight"]
    # The export is the merged policy: W0 + alpha/r B A, a plain HF checkpoint of the base's names.
    exported = tmp_path / "lora_quickstart" / "hf"
    out = {}
    for file in exported.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    with safe_open(f"{tmp_path}/tiny/model.safetensors", "pt") as f:
        base = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert set(out) == set(base)
    assert (out["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]).all()  # no adapter there
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (out[q] - base[q]).abs().max() > 1e-4  # merged: the adapters trained
    # The adapters alone (RUN_DIR/adapter), loaded by peft onto the base, give the merged export's logprobs.
    tokens = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    merged = hf_logprobs(exported, tokens)
    adapted = peft_logprobs(f"{tmp_path}/tiny", str(tmp_path / "lora_quickstart" / "adapter"), tokens)
    assert float((merged - adapted).abs().max()) <= 1e-4
    assert float((merged - hf_logprobs(f"{tmp_path}/tiny", tokens)).abs().max()) > 1e-2
    # `megatron-rl export` of the run's last checkpoint: the same merged model, and the adapter in OUT/adapter.
    report = mcore_to_hf(str(step_dir(tmp_path / "ckpt", cfg.steps)), str(tmp_path / "exported"))
    assert report["lora"] is True
    assert float((hf_logprobs(tmp_path / "exported", tokens) - merged).abs().max()) <= 1e-5
    again = peft_logprobs(f"{tmp_path}/tiny", str(tmp_path / "exported" / "adapter"), tokens)
    assert float((again - merged).abs().max()) <= 1e-4

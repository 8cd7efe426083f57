"""LoRA: the config section, the adapters' HF/peft names, and the planner's adapter bytes against a hand count."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, LoraConfig, RunConfig, load_config

ROOT = Path(__file__).parents[2]


def test_lora_is_off_by_default():
    cfg = RunConfig()
    assert not cfg.lora.enabled
    assert cfg.lora.rank == 0 and cfg.lora.scale == 0.0
    assert not cfg.lora.has("linear_qkv")


def test_lora_overrides_and_scale():
    cfg = load_config(None, ["lora.rank=8", "lora.alpha=32", "lora.targets=[linear_qkv, expert_fc2]"])
    assert cfg.lora.enabled and cfg.lora.scale == 4.0
    assert cfg.lora.targets == ("linear_qkv", "expert_fc2")
    assert cfg.lora.has("expert_fc2") and not cfg.lora.has("linear_fc1")


def test_targets_take_a_comma_list_and_drop_repeats():
    assert LoraConfig(rank=4, targets="linear_proj, linear_proj,linear_fc1").targets == ("linear_proj", "linear_fc1")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lora.rank=-1"], "lora.rank: Input should be greater than or equal to 0"),
        (["lora.alpha=0"], "lora.alpha: Input should be greater than 0"),
        (["lora.dropout=1.0"], "lora.dropout: Input should be less than 1"),
        (["lora.targets=[linear_qkvv]"], "lora.targets.0: must be one of 'linear_qkv', .* \\(got 'linear_qkvv'\\)"),
        (["lora.targets=[q_proj]"], "'q_proj' is a Hugging Face module name: name the Megatron layer 'linear_qkv'"),
        (["lora.targets=[]"], "lora.targets is empty"),
        (["lora.sync=peft"], "lora.sync: must be one of 'merge' or 'vllm'"),
        (["lora.rank=true"], "lora.rank: must be a number"),
    ],
)
def test_bad_lora_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_vllm_sync_refuses_expert_targets():
    with pytest.raises(
        ConfigError, match="vLLM's fused MoE experts do not take.*expert_fc1, expert_fc2.*lora.sync=merge"
    ):
        load_config(None, ["lora.rank=8", "lora.sync=vllm"])
    dense = load_config(None, ["lora.rank=8", "lora.sync=vllm", "lora.targets=[linear_qkv,linear_proj,linear_fc1]"])
    assert dense.lora.sync == "vllm"


ATTENTION_AND_EXPERTS = "lora.targets=[linear_qkv,linear_proj,expert_fc1,expert_fc2]"


def test_plan_of_qwen3_30b_at_rank_8_matches_a_hand_count():
    """configs/qwen3_30b_a3b.yaml (TP2 x EP8 x DP8, bf16, distributed optimizer; expert DP = 16 / 8 = 2), rank 8 on
    attention and experts: 48 layers, hidden 2048, 32 heads x 128, 4 KV heads, 128 experts of width 768."""
    from megatron_rl.planner import plan

    cfg = load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml", ["lora.rank=8", ATTENTION_AND_EXPERTS])
    p = plan(cfg)
    r, h, layers = 8, 2048, 48
    qkv = r * h + (32 + 2 * 4) * 128 * r // 2  # A whole, B split over tp 2
    proj = r * 32 * 128 // 2 + h * r  # A split over tp, B whole
    expert = (r * h + 2 * 768 * r) + (r * 768 + h * r)  # etp 1: fc1 A + B, fc2 A + B
    dense, experts = layers * (qkv + proj), layers * (128 // 8) * expert
    assert (dense, experts) == (3_342_336, 39_321_600)
    lora = p.lora
    assert lora.param_bytes == [2 * (dense + experts)]
    assert lora.grad_bytes == [4 * (dense + experts)]
    assert lora.optimizer_bytes == [12 * (dense // 8 + experts // 2)]  # m, v, fp32 main copy
    stage = p.trainer.stages[0]
    assert stage.grad_bytes == lora.grad_bytes[0] and stage.optimizer_bytes == lora.optimizer_bytes[0]
    base = load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml")
    assert stage.param_bytes == plan(base).trainer.stages[0].param_bytes + lora.param_bytes[0]
    # One sync: peft's tensors (q, k, v each with the shared A; gate, up each with theirs), bf16, every expert.
    per_layer = (3 * r * h + 5120 * r) + (r * 4096 + h * r) + 128 * (2 * r * h + 1536 * r + r * 768 + h * r)
    assert lora.sync_bytes == 2 * layers * per_layer == 843_841_536
    assert lora.full_sync_bytes == 2 * 30_532_122_624
    assert lora.sync_fraction <= 0.03  # issue 17, must-show 2: 1.38%
    assert lora.adapted_layers == {"linear_qkv": 48, "linear_proj": 48, "expert_fc1": 6144, "expert_fc2": 6144}
    d = p.to_dict()["lora"]
    assert d["per_gpu_bytes"][0]["optimizer"] == lora.optimizer_bytes[0] and d["sync_fraction"] == 0.01382


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "mixtral_8x7b"])
def test_every_production_config_plans_with_lora(name):
    from megatron_rl.planner import format_plan, plan

    p = plan(load_config(ROOT / "configs" / f"{name}.yaml", ["lora.rank=8"]))
    text = format_plan(p)
    assert "lora      rank 8" in text and "for a full sync" in text
    assert len(p.lora.param_bytes) == len(p.trainer.stages) and all(b > 0 for b in p.lora.optimizer_bytes)
    assert p.lora.sync_fraction < 0.03
    if name == "deepseek_v3":  # MLA attention has no fused linear_qkv: only its output projection is adapted
        assert "linear_qkv" not in p.lora.adapted_layers and p.lora.adapted_layers["linear_proj"] == 61


def test_plan_without_lora_has_no_lora_part():
    from megatron_rl.planner import plan

    p = plan(load_config(ROOT / "configs" / "qwen3_30b_a3b.yaml"))
    assert p.lora is None and "lora" not in p.to_dict()


@pytest.mark.parametrize("family_name", ["qwen3_moe", "mixtral", "deepseek_v3", "qwen3"])
def test_adapter_names_are_peft_names_and_unique(family_name):
    from megatron_rl.config.lora import LORA_TARGETS
    from megatron_rl.models import get_family
    from megatron_rl.models.lora import adapter_rule_table, parameter_rules

    family = get_family(family_name)
    arch = family.arch_from_hf(family.tiny_hf_config(512))
    rules = parameter_rules(adapter_rule_table(family, arch, LORA_TARGETS))
    hf = [name for rule in rules.values() for name in rule.hf]
    assert len(hf) == len(set(hf)) and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in hf)
    assert all(n.startswith("model.layers.") for n in hf)
    base = {n for rule in family.param_rules(arch) for n in rule.hf}
    assert all(n.replace(".lora_A.", ".").replace(".lora_B.", ".") in base for n in hf)  # beside a base tensor
    for name, a in rules.items():  # column-parallel: A whole, B split on rows; row-parallel: A split on columns
        if name.endswith(".lora_A"):
            assert (a.tp_dim, rules[name[: -len("A")] + "B"].tp_dim) in {(None, 0), (1, None)}, name

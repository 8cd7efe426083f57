"""LoRA: the config section, the adapters' HF/peft names, and the planner's adapter bytes against a hand count."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, LoraConfig, RunConfig, load_config


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

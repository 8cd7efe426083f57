"""Model families: recognition, parameter tables against real checkpoints, transforms against references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_rl.models import FAMILIES, CheckpointError, family_for_hf_config, get_family, sharding
from megatron_rl.models.base import ParamRule
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.models.naming import canonical_name
from megatron_rl.models.transforms import fuse_qkv, split_qkv
from tests.conftest import FAMILIES as FAMILY_NAMES


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rule_table_covers_checkpoint_exactly(family, tiny_dir):
    """Every tensor transformers saved is mapped once, and nothing else is."""
    fam = get_family(family)
    ckpt = HFCheckpoint(tiny_dir(family))
    hf_config = json.loads((ckpt.folder / "config.json").read_text())
    arch = fam.arch_from_hf(hf_config)
    mapped = [n for rule in fam.rule_table(arch).values() for n in rule.hf]
    assert sorted(mapped) == sorted(ckpt.names())


@pytest.mark.parametrize(
    "config, family",
    [
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "qwen3_moe"),
        ({"architectures": ["MixtralForCausalLM"]}, "mixtral"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "deepseek_v3"),
        ({"model_type": "qwen3"}, "qwen3"),
    ],
)
def test_family_recognition(config, family):
    assert family_for_hf_config(config).name == family


def test_unknown_architecture_is_named():
    with pytest.raises(CheckpointError, match="unknown architecture \\['GPT2LMHeadModel'\\]"):
        family_for_hf_config({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_missing_config_key_is_named():
    cfg = get_family("mixtral").tiny_hf_config(512)
    del cfg["num_local_experts"]
    with pytest.raises(CheckpointError, match="num_local_experts"):
        get_family("mixtral").arch_from_hf(cfg)


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen3_moe", {"hidden_size": "abc"}, r"/ckpt/config.json: not a valid qwen3_moe config \(ValueError"),
        ("qwen3", {"num_attention_heads": 0, "head_dim": None}, "/ckpt/config.json: not a valid qwen3 config"),
        ("qwen3_moe", {"mlp_only_layers": 5}, "TypeError"),
        ("qwen3", {"num_hidden_layers": -2}, "num_hidden_layers=-2 must be at least 1"),
        ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ("qwen3_moe", {"num_experts_per_tok": 100}, r"num_experts_per_tok=100 must be between 1 and .* \(8\)"),
        ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok=0 must be between 1"),
    ],
)
def test_bad_config_values_are_one_error_naming_the_file_and_key(family, change, message):
    fam = get_family(family)
    cfg = fam.tiny_hf_config(512)
    cfg.update(change)
    with pytest.raises(CheckpointError, match=message):
        fam.arch_from_hf(cfg, "/ckpt/config.json")


def test_a_config_that_is_not_an_object_is_named(tmp_path):
    from megatron_rl.models import read_hf_config

    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json: must hold a JSON object, got list"):
        read_hf_config(tmp_path)


def _reference_qkv(q, k, v, heads, groups, dim):
    # Written independently of fuse_qkv: walk group by group and append rows.
    per = heads // groups
    rows = []
    for g in range(groups):
        for h in range(per):
            rows.append(q[(g * per + h) * dim : (g * per + h + 1) * dim])
        rows.append(k[g * dim : (g + 1) * dim])
        rows.append(v[g * dim : (g + 1) * dim])
    return torch.cat(rows)


@pytest.mark.parametrize("heads, groups", [(4, 2), (8, 8), (8, 1)])
def test_qkv_fuse_matches_reference_and_splits_back(heads, groups):
    dim, hidden = 4, 6
    q, k, v = torch.randn(heads * dim, hidden), torch.randn(groups * dim, hidden), torch.randn(groups * dim, hidden)
    fused = fuse_qkv(q, k, v, heads, groups, dim)
    assert torch.equal(fused, _reference_qkv(q, k, v, heads, groups, dim))
    for got, want in zip(split_qkv(fused, heads, groups, dim), (q, k, v)):
        assert torch.equal(got, want)
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], heads, groups, dim)
    assert torch.equal(bias, fused[:, 0])


@pytest.mark.parametrize("chunks, dim, size", [(1, 0, 2), (1, 1, 4), (2, 0, 2), (2, 0, 4)])
def test_shard_unshard_round_trip(chunks, dim, size):
    rule = ParamRule("x", ("y",), tp_dim=dim, tp_chunks=chunks)
    full = torch.randn(16, 8)
    shards = [sharding.shard(full, rule, size, r) for r in range(size)]
    assert all(s.shape == sharding.shard_shape(full.shape, rule, size) for s in shards)
    assert torch.equal(sharding.unshard(shards, rule), full)


def test_fused_gate_up_shard_holds_its_gate_and_up_halves():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    rule = ParamRule("fc1", ("g", "u"), transform="gate_up", tp_dim=0, tp_chunks=2)
    full = rule.to_mcore([gate, up], None)
    assert torch.equal(sharding.shard(full, rule, 2, 1), torch.cat([gate[2:], up[2:]]))


@pytest.mark.parametrize(
    "local, layer_offset, expert_offset, canonical",
    [
        ("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4,
         "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"),
        ("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", 0, 0, "decoder.layers.1.input_layernorm.weight"),
        ("decoder.layers.0.mlp.experts.linear_fc2.weight3", 1, 4,
         "decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"),
        ("embedding.word_embeddings.weight", 3, 0, "embedding.word_embeddings.weight"),
    ],
)  # fmt: skip
def test_canonical_names(local, layer_offset, expert_offset, canonical):
    assert canonical_name(local, layer_offset, expert_offset) == canonical


def test_every_family_config_kwargs_are_plain():
    for family in FAMILIES.values():
        cfg = family.tiny_hf_config(512)
        kwargs = family.megatron_config_kwargs(family.arch_from_hf(cfg), cfg)
        assert kwargs["num_layers"] == cfg["num_hidden_layers"]
        assert kwargs["activation_func"] == "silu"


def _planner_case(name: str) -> dict:
    """A shipped config.json (configs/models), or a family's tiny config with a variation after `+`."""
    if not name.startswith("tiny_"):
        return json.loads((Path(__file__).parents[2] / "configs" / "models" / f"{name}.json").read_text())
    family, _, variant = name.removeprefix("tiny_").partition("+")
    hf = get_family(family).tiny_hf_config(512)
    if variant == "no_q_lora":
        hf["q_lora_rank"] = None
    elif variant == "qkv_bias":
        hf["attention_bias"] = True
    return hf


# Recorded from the planner's own formulas before they moved into the families (at a890f8b): attention
# parameters (tensor-parallel, replicated) of one layer, attention activation elements per token, and KV-cache
# values per token per layer at engine TP 1, 2, 4, 8.
@pytest.mark.parametrize(
    "name, attention, activation, kv",
    [
        ("deepseek_v3", (171966464, 15148032), 116800, (576, 576, 576, 576)),
        ("mixtral_8x7b", (41943040, 4096), 18432, (2048, 1024, 512, 256)),
        ("qwen3_235b_a22b", (71303168, 4352), 25600, (1024, 512, 256, 256)),
        ("qwen3_30b_a3b", (18874368, 2304), 13312, (1024, 512, 256, 256)),
        ("tiny_qwen3_moe", (49152, 192), 640, (128, 64, 64, 64)),
        ("tiny_mixtral", (49152, 128), 640, (128, 64, 64, 64)),
        ("tiny_deepseek_v3", (57344, 24864), 1504, (96, 96, 96, 96)),
        ("tiny_qwen3", (49152, 192), 640, (128, 64, 64, 64)),
        ("tiny_deepseek_v3+no_q_lora", (65536, 12480), 1312, (96, 96, 96, 96)),
        ("tiny_qwen3+qkv_bias", (49408, 192), 640, (128, 64, 64, 64)),
    ],
)
def test_family_planner_answers_equal_the_former_formulas(name, attention, activation, kv):
    hf = _planner_case(name)
    family = family_for_hf_config(hf)
    arch = family.arch_from_hf(hf)
    counts = family.attention_params(arch)
    assert (counts.tp, counts.replicated) == attention
    assert family.attention_activation_elements(arch) == activation
    assert tuple(family.kv_cache_elements(arch, tp) for tp in (1, 2, 4, 8)) == kv
    # The former check: only GQA key/value heads must divide engine_tp or be divided by it.
    assert family.kv_heads_fit(arch, 3) == (family.uses_mla() or arch.num_kv_heads % 3 == 0)


def test_only_qwen3_families_have_qk_norms():
    assert {name for name, family in FAMILIES.items() if family.qk_norm} == {"qwen3", "qwen3_moe"}

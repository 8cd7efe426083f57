"""The engine's side of an adapter-only sync, pure parts (`weights/engine/lora_merge.py`) and its plan JSON."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.config import LoraConfig
from megatron_rl.weights.engine.lora_merge import (
    BaseWeights,
    LoraMerge,
    LoraMergeError,
    adapter_pairs,
    by_layer,
    merged,
)
from megatron_rl.weights.lora_sync import merge_scale
from megatron_rl.weights.plan import (
    TensorSpec,
    lora_of_plan,
    lora_plan_to_json,
    plan_buckets,
    plan_from_json,
    plan_to_json,
)

Q = "model.layers.0.self_attn.q_proj"
EXPERT = "model.layers.1.mlp.experts.2"


def test_merged_is_w0_plus_scale_b_a_in_w0s_dtype():
    gen = torch.Generator().manual_seed(0)
    w0, a, b = (torch.randn(shape, generator=gen) for shape in ((6, 5), (2, 5), (6, 2)))
    assert torch.allclose(merged(w0, a, b, 0.5, "w"), w0 + 0.5 * b @ a)
    assert merged(w0.bfloat16(), a, b, 0.5, "w").dtype == torch.bfloat16
    with pytest.raises(LoraMergeError, match="'w'.*lora_B \\[5, 2\\]"):
        merged(w0, a, torch.zeros(5, 2), 0.5, "w")


def test_adapter_pairs_name_the_missing_half_and_foreign_tensors():
    a, b = torch.zeros(2, 4), torch.zeros(3, 2)
    pairs = adapter_pairs({f"{Q}.lora_A.weight": a, f"{Q}.lora_B.weight": b})
    assert list(pairs) == [f"{Q}.weight"] and pairs[f"{Q}.weight"][1] is b
    with pytest.raises(LoraMergeError, match="no lora_B for 'model.layers.0.self_attn.q_proj.weight'"):
        adapter_pairs({f"{Q}.lora_A.weight": a})
    with pytest.raises(LoraMergeError, match="no LoRA tensor"):
        adapter_pairs({f"{Q}.weight": a})


def test_by_layer_orders_groups_by_layer_index():
    names = ["model.layers.10.a.weight", "model.layers.2.b.weight", "model.embed_tokens.weight", "model.layers.2.c"]
    assert by_layer(names) == [
        ["model.embed_tokens.weight"], ["model.layers.2.b.weight", "model.layers.2.c"], ["model.layers.10.a.weight"]
    ]  # fmt: skip


class _Loader:
    """Records what an update loads (the in-place loader's interface)."""

    def __init__(self):
        self.calls, self.timings = [], {"load_s": 0.0}

    def begin_update(self, partial=False):
        self.calls.append(("begin", partial))

    def load(self, tensors):
        self.calls.append(("load", {n: t.clone() for n, t in tensors}))

    def finish(self):
        self.calls.append(("finish",))


def test_an_update_merges_onto_w0_each_time_and_loads_an_experts_other_weights_as_w0(tmp_path):
    gen = torch.Generator().manual_seed(1)
    base = {
        f"{Q}.weight": torch.randn(6, 4, generator=gen),
        f"{EXPERT}.gate_proj.weight": torch.randn(3, 4, generator=gen),
        f"{EXPERT}.down_proj.weight": torch.randn(4, 3, generator=gen),
    }
    save_file(base, str(tmp_path / "model.safetensors"))
    loader = _Loader()
    merge = LoraMerge(loader, BaseWeights(tmp_path, torch.float32), scale=2.0)
    for seed in (2, 3):  # the second update merges onto W0 again, not onto the first merge
        gen.manual_seed(seed)
        adapters = {
            f"{Q}.lora_A.weight": torch.randn(2, 4, generator=gen), f"{Q}.lora_B.weight": torch.randn(6, 2, generator=gen),
            f"{EXPERT}.gate_proj.lora_A.weight": torch.randn(2, 4, generator=gen),
            f"{EXPERT}.gate_proj.lora_B.weight": torch.randn(3, 2, generator=gen),
        }  # fmt: skip
        loader.calls.clear()
        merge.begin_update()
        assert merge.load(adapters.items()) == 4
        merge.finish()
        assert [c[0] for c in loader.calls] == ["begin", "load", "load", "finish"] and loader.calls[0][1] is True
        loaded = loader.calls[1][1] | loader.calls[2][1]
        assert set(loaded) == set(base)  # by layer: layer 0 first, then the expert's weights (down_proj as W0)
        for stem in (Q, f"{EXPERT}.gate_proj"):
            a, b = adapters[f"{stem}.lora_A.weight"], adapters[f"{stem}.lora_B.weight"]
            assert torch.allclose(loaded[f"{stem}.weight"], base[f"{stem}.weight"] + 2.0 * b @ a)
        assert torch.equal(loaded[f"{EXPERT}.down_proj.weight"], base[f"{EXPERT}.down_proj.weight"])
    assert merge.describe() == {"merged_weights": 2, "kept_w0": 3, "kept_w0_bytes": (24 + 12 + 12) * 4}


def test_base_weights_name_the_missing_weight_and_a_folder_without_safetensors(tmp_path):
    save_file({"x.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoraMergeError, match="'y.weight' is not in the engine's checkpoint"):
        BaseWeights(tmp_path, torch.float32).get("y.weight")
    with pytest.raises(LoraMergeError, match="no local folder of safetensors"):
        BaseWeights(tmp_path / "nothing", torch.float32).get("x.weight")


def test_lora_plan_json_carries_the_scale_and_the_same_buckets():
    specs = [TensorSpec(f"{Q}.lora_A.weight", (4, 64), "float32", 0, False)]
    buckets = plan_buckets(specs, 1 << 20)
    text = lora_plan_to_json(buckets, 2.0)
    assert lora_of_plan(text) == {"scale": 2.0} and plan_from_json(text) == buckets
    assert lora_of_plan(plan_to_json(buckets)) is None


def test_merge_scale_is_alpha_over_rank_in_both_engine_modes():
    assert merge_scale(LoraConfig()) is None
    assert merge_scale(LoraConfig(rank=8, alpha=32)) == 4.0
    assert merge_scale(LoraConfig(rank=8, alpha=32, sync="vllm", targets=["linear_qkv"])) == 4.0


def test_peft_form_of_expert_adapters_and_the_refused_dense_mlp_on_an_moe_model():
    from megatron_rl.weights.peft_export import PeftExportError, adapter_config, peft_tensors

    gen = torch.Generator().manual_seed(4)
    tensors = {}
    for e in range(2):
        a = torch.randn(3, 8, generator=gen)
        stem = f"model.layers.1.mlp.experts.{e}"
        tensors |= {f"{stem}.gate_proj.lora_A.weight": a, f"{stem}.up_proj.lora_A.weight": a}
        tensors |= {f"{stem}.{p}.lora_B.weight": torch.randn(5, 3, generator=gen) for p in ("gate_proj", "up_proj")}
    out = peft_tensors(tensors)
    a, b = (
        out["base_model.model.model.layers.1.mlp.experts.lora_A.weight"],
        out["base_model.model.model.layers.1.mlp.experts.lora_B.weight"],
    )
    assert a.shape == (2 * 3, 8) and b.shape == (10, 3 * 2)
    stem = "model.layers.1.mlp.experts.1"
    gate_up = torch.cat([tensors[f"{stem}.gate_proj.lora_B.weight"], tensors[f"{stem}.up_proj.lora_B.weight"]])
    # peft's ParamWrapper: expert e's A rows e*r.., its B columns k*E + e
    assert torch.equal(a.reshape(2, 3, 8)[1], tensors[f"{stem}.gate_proj.lora_A.weight"])
    assert torch.equal(b.reshape(10, 3, 2)[:, :, 1], gate_up)
    config = adapter_config(LoraConfig(rank=3, alpha=6.0), tensors, "base", has_experts=True)
    assert config["target_modules"] == [] and config["target_parameters"] == ["mlp.experts.gate_up_proj"]
    dense = {"model.layers.0.mlp.down_proj.lora_A.weight": torch.zeros(3, 8)}
    with pytest.raises(PeftExportError, match="dense MLP \\(down_proj\\) of a model with routed experts"):
        adapter_config(LoraConfig(rank=3), dense, "base", has_experts=True)
    assert adapter_config(LoraConfig(rank=3), dense, "base", has_experts=False)["target_modules"] == ["down_proj"]

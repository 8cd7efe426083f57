"""`lora.sync: vllm` without vLLM: the PEFT folder the engine's first worker writes,
the refusals (expert adapters, MoE checkpoints, ranks above vLLM's), and the engine's pause mode."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.rollout.engine_lora import EngineLora, EngineLoraError, check_dense, vllm_max_lora_rank
from megatron_rl.weights.engine.lora_adapter import LoraAdapterFolder
from megatron_rl.weights.engine.lora_merge import LoraMergeError


def _update(folder: LoraAdapterFolder, version: int, tensors: dict) -> dict:
    folder.version = version
    folder.begin_update()
    folder.load(tensors.items())
    folder.finish()
    return folder.describe()


def test_the_writer_writes_a_peft_folder_per_version_and_keeps_two(tmp_path):
    a, b = torch.randn(4, 6), torch.randn(10, 4)
    tensors = {"model.layers.0.self_attn.q_proj.lora_A.weight": a, "model.layers.0.self_attn.q_proj.lora_B.weight": b}
    writer = LoraAdapterFolder(tmp_path, writes=True, base="/base")
    writer.scale = 2.0
    for version in (1, 2, 3):
        report = _update(writer, version, tensors)
    assert report == {"mode": "vllm", "adapter_path": str(tmp_path / "v3"), "rank": 4, "adapted_weights": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]
    config = json.loads((tmp_path / "v3" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["q_proj"])
    weights = load_file(str(tmp_path / "v3" / "adapter_model.safetensors"))
    assert torch.equal(weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"], b)
    other = LoraAdapterFolder(tmp_path / "other", writes=False, base="/base")  # a worker that only checks
    assert _update(other, 1, tensors)["adapter_path"] is None and not (tmp_path / "other").exists()
    expert = {k.replace("self_attn.q_proj", "mlp.experts.0.down_proj"): v for k, v in tensors.items()}
    with pytest.raises(LoraMergeError, match="experts.0.down_proj.*routed expert.*lora.sync=merge"):
        _update(other, 2, expert)


def test_engines_refuse_moe_checkpoints_and_round_the_rank_up(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_experts": 4}))
    with pytest.raises(EngineLoraError, match="engine e0: lora.sync=vllm.*num_experts=4.*lora.sync=merge"):
        check_dense(str(tmp_path), "e0")
    with pytest.raises(EngineLoraError, match="routed experts"):
        EngineLora("e0", str(tmp_path), 8).engine_args()
    assert EngineLora("e0", str(tmp_path), 0).engine_args() == {}  # off: nothing asked of vLLM
    assert [vllm_max_lora_rank(r, "e0") for r in (1, 4, 8, 9, 512)] == [1, 8, 8, 16, 512]
    with pytest.raises(EngineLoraError, match="lora.rank=600"):
        vllm_max_lora_rank(600, "e0")
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"num_experts": 0}))
    lora = EngineLora("e0", str(dense), 4)
    args = lora.engine_args()
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 1, 8)
    assert "lm_head" not in args["lora_target_modules"] and "q_proj" in args["lora_target_modules"]
    assert (lora.pause_mode("keep"), lora.pause_mode("wait")) == ("abort", "wait")
    assert EngineLora("e0", str(dense), 0).pause_mode("keep") == "keep"

"""The PEFT adapter export (issue 17, must-show 4): a trainer at TP2 x EP2 (gloo) with non-zero adapters on
attention and every expert of a tiny Qwen3-MoE writes `adapter_config.json` + `adapter_model.safetensors`; peft
loads them onto the base HF checkpoint (experts in `target_parameters` form, transformers 5's 3-D expert
parameters) and gives the trainer's logprobs (fp32)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.parallel.torchrun import run_torchrun

WORKER = "tests.support.peft_worker"
TINY = {"num_experts": 4, "mlp_only_layers": [0]}
LORA = {"rank": 4, "alpha": 8.0, "targets": ["linear_qkv", "linear_proj", "expert_fc1", "expert_fc2"]}


def peft_logprobs(hf: str, adapter: str, tokens: torch.Tensor) -> torch.Tensor:
    """Logprobs of tokens[:, 1:] under the base checkpoint with the PEFT adapter loaded by peft itself."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_peft_export_from_tp2xep2_gives_the_trainers_logprobs(tmp_path):
    from megatron_rl.models.tiny import make_tiny
    from megatron_rl.verify.parity import hf_logprobs

    hf = str(make_tiny("qwen3_moe", tmp_path / "tiny", seed=0, overrides=TINY))
    tokens = torch.randint(3, 500, (4, 32), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    case = {"hf": hf, "layout": {"tp": 2, "ep": 2}, "lora": LORA, "seed": 3, "b_std": 0.1,
            "tokens": str(tmp_path / "tokens.pt"), "out": str(tmp_path)}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps({"cases": [case]}))
    run_torchrun(WORKER, [str(tmp_path / "spec.json")], 2, timeout_s=300, log_path=tmp_path / "log.txt")
    trainer = torch.load(tmp_path / "logprobs.pt")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    got = peft_logprobs(hf, str(tmp_path / "adapter"), tokens)
    assert float((got - trainer["logprobs"]).abs().max()) <= 1e-4
    assert float((hf_logprobs(hf, tokens) - trainer["logprobs"]).abs().max()) > 1e-2  # the adapters matter

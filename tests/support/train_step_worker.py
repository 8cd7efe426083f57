"""torchrun worker that runs RL train steps on saved batches at a layout and reports stats and logprobs.

Spec file (JSON): {"cases": [case, ...]}; each case:
    hf            HF checkpoint folder to start from
    layout        ParallelLayout fields
    algo          AlgorithmConfig fields (mini-batches, KL in the reward, guards: all as the learner runs them)
    proximal_pass (optional) compute proximal logprobs with a separate forward even for one mini-batch
    sampling      (optional) {"top_k", "top_p"}: the engines' sampling mask, applied to every logprob (the eval
                  logprobs too)
    optimizer     OptimizerConfig fields
    micro_batch_size, total_steps (LR schedule length), moe_aux_loss_coeff (default 0)
    micro_batching (optional) {"tokens", "pack", "uniform"}: `MicroBatching` fields beside micro_batch_size
    grads_out     (optional) path the stats owner writes each parameter's reduced gradient of the first step to
                  (world size 1: the whole gradient is on the one rank)
    batches       paths of saved global batches (dicts of TrainBatch fields), one per step
    eval_tokens   path of a [B, S] token tensor whose logprobs are reported before and after every step
    out           path the stats owner writes {"steps": [stats per step], "evals": [logprobs of eval_tokens before
                  the first step and after each step]} to
    save_dir, save_after   (optional) save model + optimizer + scheduler after this many steps
    optimizer_format       (optional) DistributedOptimizer checkpoint format (default fully_reshardable)
    load_dir      (optional) load model + optimizer + scheduler before the first step
    build         (optional) BuildOptions fields beside the defaults (e.g. {"grouped_experts": false})
    megatron_step (optional) update with Megatron's own `optimizer.step()` (which readies the gradients and
                  takes their norm again) instead of `step_clipped_by`: the two must give the same update

Several cases of the same world size share one launch: model-parallel groups are torn down and rebuilt between
cases while the default process group stays (as in parity_worker).
"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import torch

from megatron_rl.algorithms.sampling_mask import SamplingMask
from megatron_rl.config import AlgorithmConfig, OptimizerConfig
from megatron_rl.parallel.layout import ParallelLayout
from megatron_rl.trainer import train_step as train_step_module
from megatron_rl.trainer.batch import TrainBatch, replica_share
from megatron_rl.trainer.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.trainer.learner import train_batch
from megatron_rl.trainer.model import BuildOptions
from megatron_rl.trainer.optimizer import build_training, torch_optimizers
from megatron_rl.trainer.packing import MicroBatching
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.trainer.train_step import compute_logprobs, loss_spec, with_proximal_logprobs
from megatron_rl.workers import run_cases


def load_batch(path: str):
    """A TrainBatch from a saved dictionary of its fields."""
    return TrainBatch(**torch.load(path, weights_only=True))


def _stats_owner(ctx) -> bool:
    return ctx.is_last_stage and ctx.tp_rank == 0 and ctx.dp_rank == 0


def _one_step(state, ctx, batch, algo, mbs: MicroBatching, proximal_pass: bool, mask: SamplingMask) -> dict:
    """Shard the global batch for this DP rank and train on it as the learner does (`train_batch`)."""
    share = replica_share(batch, ctx.dp_rank, ctx.layout.data_parallel, algo.ppo_minibatches)
    spec = loss_spec(algo, max_new_tokens=24, sampling=mask)
    if proximal_pass:
        share = with_proximal_logprobs(state.model, ctx, share, mbs, spec.sampling_mask)
    start = time.perf_counter()
    stats = train_batch(state, ctx, share, algo, spec, mbs)
    stats["seconds"] = time.perf_counter() - start
    return stats


def _megatron_step(optimizer, grad_norm: float):
    """Megatron's whole `step()` in place of `step_clipped_by` (the norm it computes again must be the same)."""
    stepped, norm, zeros = optimizer.step()
    assert norm == grad_norm, (norm, grad_norm)
    return stepped, zeros


def _gradients(model) -> dict:
    """Each parameter's reduced gradient (Megatron's `main_grad` buffers keep it after the optimizer step)."""
    return {name: p.main_grad.detach().clone().cpu() for name, p in model.named_parameters() if p.requires_grad}


def _save(state, rank, case: dict, steps_done: int) -> None:
    meta = {"family": rank.family.name, "dtype": "float32", "layout": rank.ctx.layout.describe()}
    extra = {"scheduler": state.scheduler.state_dict(), "step": steps_done}
    save_checkpoint(
        state.model,
        rank.ctx,
        case["save_dir"],
        meta,
        hf_dir=case["hf"],
        optimizer=state.optimizer,
        extra=extra,
        optimizer_format=case.get("optimizer_format", "fully_reshardable"),
    )


def _load(state, case: dict) -> None:
    extra = load_checkpoint(state.model, case["load_dir"], optimizer=state.optimizer)
    state.scheduler.load_state_dict(extra["scheduler"])


def run_case(case: dict) -> None:
    """Bring the rank up, run the steps, let the stats owner write the report, tear down."""
    layout = ParallelLayout(**case["layout"])
    packed = bool(case.get("micro_batching", {}).get("pack", False))
    opts = BuildOptions(
        init_weights=False, moe_aux_loss_coeff=case.get("moe_aux_loss_coeff", 0.0), packed_sequences=packed,
        **case.get("build", {}),
    )  # fmt: skip
    rank = bring_up_from_hf(case["hf"], layout, opts)
    ctx = rank.ctx
    algo = AlgorithmConfig(**case.get("algo", {}))
    mbs = MicroBatching(size=int(case.get("micro_batch_size", 1)), **case.get("micro_batching", {}))
    state = build_training(rank.model, OptimizerConfig(**case.get("optimizer", {})), int(case.get("total_steps", 10)))
    if case.get("load_dir"):
        _load(state, case)
    eval_tokens = torch.load(case["eval_tokens"], weights_only=True)
    mask = SamplingMask(**case.get("sampling", {}))
    evals = [compute_logprobs(state.model, ctx, eval_tokens, mbs, mask)]
    steps = []
    stepper = contextlib.nullcontext()
    if case.get("megatron_step"):
        stepper = mock.patch.object(train_step_module, "step_clipped_by", _megatron_step)
    grouped = mock.patch.object(torch, "_grouped_mm", wraps=torch._grouped_mm)  # counts the grouped expert matmuls
    for i, path in enumerate(case["batches"]):
        with stepper, grouped as grouped_mm:
            steps.append(_one_step(state, ctx, load_batch(path), algo, mbs, bool(case.get("proximal_pass")), mask))
        steps[-1]["grouped_mm_calls"] = grouped_mm.call_count
        if i == 0 and case.get("grads_out") and _stats_owner(ctx):
            torch.save(_gradients(state.model), case["grads_out"])
        evals.append(compute_logprobs(state.model, ctx, eval_tokens, mbs, mask))
        if case.get("save_dir") and case.get("save_after") == i + 1:
            _save(state, rank, case, i + 1)
    if _stats_owner(ctx):
        fused = [all(g.get("fused") for g in opt.param_groups) for opt in torch_optimizers(state.optimizer)]
        torch.save({"steps": steps, "evals": [e.cpu() for e in evals], "fused_adam": fused}, case["out"])


if __name__ == "__main__":
    run_cases(run_case)

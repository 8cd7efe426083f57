"""Megatron's data-parallel wrapper, optimizer (Adam, optionally the DistributedOptimizer) and LR schedule.

`build_training(model, cfg, total_steps)` is the one call a trainer rank makes after building its GPTModel: it
wraps the model in Megatron's `DistributedDataParallel` (contiguous fp32 gradient buffers, no overlap: CPU and
gloo gain nothing from it), builds the optimizer with `get_megatron_optimizer` (a `ChainedOptimizer` of a dense and
an expert optimizer for MoE models) and an `OptimizerParamScheduler` for the learning rate.

Wiring Megatron expects (as its own `training.py` does): the model's TransformerConfig carries
`finalize_model_grads_func` (the data-parallel gradient reduction, sequence-parallel norm all-reduce and tied
embedding all-reduce run at the end of every forward-backward), `no_sync_func` and `grad_scale_func` (the loss
scale of fp16 training; 1 otherwise). These live on the config object because Megatron's schedules read them
there.

Before wrapping, two parameter attributes Megatron leaves wrong for this project's models are fixed
(`complete_tensor_parallel_attributes`, `mark_expert_params`; each docstring names the failure it prevents).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import clip_grads, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

from megatron_rl.config import OptimizerConfig

_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass
class TrainingState:
    """The wrapped model, its optimizer and LR scheduler on one trainer rank."""

    model: object
    """Megatron `DistributedDataParallel` around this rank's GPTModel (call it like the model)."""
    optimizer: object
    """Megatron optimizer (`ChainedOptimizer`, `DistributedOptimizer` or `FP32Optimizer`...)."""
    scheduler: object
    """Megatron `OptimizerParamScheduler`: `step(1)` after every successful update."""


def unwrap_model(model):
    """The GPTModel inside `model`: Megatron's DDP and our LoRA view (`lora.AdaptersOff`) each hold the model they
    wrap in `.module`, which Megatron's own modules do not have."""

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def complete_tensor_parallel_attributes(model) -> int:
    """Mark TP-sharded weights as such where Megatron did not; returns how many were marked.

    Megatron sets `tensor_model_parallel`/`partition_dim` on the weights of its parallel linear and embedding
    layers only inside its weight initialisers, which it skips when `perform_initialization=False` (models built
    to be overwritten by a checkpoint, `BuildOptions(init_weights=False)`). Without the marks the gradient norm
    counts each sharded weight on TP rank 0 only (`param_is_not_tensor_parallel_duplicate`): the TP2 grad norm
    came out 28% low on a tiny Qwen3-MoE (megatron-core 0.16.1). Here the marks are set as the initialisers
    would: dim 0 for column-parallel and embedding weights, dim 1 for row-parallel weights.
    """

    marked = 0
    for module in unwrap_model(model).modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is None or getattr(weight, "tensor_model_parallel", False):
            continue
        weight.tensor_model_parallel = True
        weight.partition_dim = dim
        if not hasattr(weight, "partition_stride"):
            weight.partition_stride = 1
        marked += 1
    return marked


def mark_expert_params(model) -> int:
    """Put every expert weight in DDP's expert buckets and the expert optimizer, at every layout; returns how
    many parameters were marked.

    Megatron files expert weights under the dense data-parallel reduction (`allreduce=True`) whenever
    `expert_model_parallel_size == 1`. Two things go wrong with that:
    - With ETP < TP the TP ranks hold the same expert weights but route different tokens (their sequence
      shards) through them, so the expert gradients must be summed over the expert data-parallel group, which
      includes those TP peers; the dense group does not, and the TP ranks' expert weights drift apart after the
      first step (megatron-core 0.16.1, TP2 x EP1 x ETP1).
    - `get_megatron_optimizer` builds one optimizer at EP = 1 but a chain of two (dense, expert) at EP > 1, and
      the optimizer checkpoint's keys and nesting follow the chain, so optimizer state saved at EP2 did not load
      at PP2 ("optimizer.state.param.... from model not in state dict").
    Marking them `allreduce=False`, as EP > 1 does, is equivalent when ETP == TP (the expert data-parallel group
    is then the dense one, with the same 1/DP gradient scaling) and fixes both.
    """

    marked = 0
    for module in unwrap_model(model).modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and getattr(module, "is_expert", False):
            for param in module.parameters(recurse=False):
                param.allreduce = False
                marked += 1
    return marked


def wrap_ddp(model, use_distributed_optimizer: bool, check_for_nan: bool = False):
    """Wrap a GPTModel in Megatron's DistributedDataParallel and install the gradient hooks on its config.

    Gradients accumulate in fp32 buffers (`grad_reduce_in_fp32`) whatever the parameter dtype; they are reduced
    once per step (no overlap with backward). With `use_distributed_optimizer` the reduction is a reduce-scatter
    and each data-parallel rank updates its shard of the parameters, then all-gathers them.
    """

    complete_tensor_parallel_attributes(model)
    mark_expert_params(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=check_for_nan,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    config = model.config
    # Megatron's schedules call these through the config; without finalize_model_grads the data-parallel
    # reduction and the sequence-parallel norm all-reduce never happen.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    return ddp


def megatron_optimizer_config(cfg: OptimizerConfig, model_config):
    """Megatron's OptimizerConfig for the project's optimizer settings and the model's precision."""

    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        # Low-precision parameters keep fp32 main copies in the optimizer.
        bf16=bool(model_config.bf16),
        fp16=bool(model_config.fp16),
        params_dtype=model_config.params_dtype,
    )


def build_optimizer(ddp_model, cfg: OptimizerConfig):
    """Megatron's optimizer over a DDP-wrapped model; sets the model config's `grad_scale_func`."""

    model_config = unwrap_model(ddp_model).config
    optimizer = get_megatron_optimizer(megatron_optimizer_config(cfg, model_config), [ddp_model])
    model_config.grad_scale_func = optimizer.scale_loss
    use_fused_cpu_adam(optimizer)
    return optimizer


def torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (one per chained part that has one)."""
    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [inner.optimizer for inner in chained if getattr(inner, "optimizer", None) is not None]


def use_fused_cpu_adam(optimizer) -> int:
    """Switch torch's Adam/AdamW inside `optimizer` to its fused kernel where every parameter is a CPU float
    tensor; return how many torch optimizers were switched.

    Without Apex or Transformer Engine Megatron builds torch's AdamW with its defaults, which on CPU is the
    per-tensor Python loop (torch picks `foreach` only for CUDA tensors); the fused CPU kernel does the same
    update in one call per parameter group. GPU optimizers (TE/Apex FusedAdam, or torch's on CUDA) are left
    as Megatron made them.
    """
    switched = 0
    for torch_opt in torch_optimizers(optimizer):
        if not isinstance(torch_opt, torch.optim.Adam | torch.optim.AdamW):
            continue
        params = [p for group in torch_opt.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" or not torch.is_floating_point(p) for p in params):
            continue
        if any(group.get("foreach") or group.get("differentiable") for group in torch_opt.param_groups):
            continue  # torch refuses fused with either
        torch_opt.defaults["fused"] = True
        for group in torch_opt.param_groups:
            group["fused"] = True
        switched += 1
    return switched


def step_clipped_by(optimizer, grad_norm: float) -> tuple[bool, float | None]:
    """(updated, zeros in the gradients or None) of one update whose gradients `prepare_grads()` readied and
    whose global norm `get_grad_norm()` gave as `grad_norm`: each part's gradients clipped by that norm, then
    stepped.

    The same update as Megatron's `step()` (megatron-core 0.16.1, `ChainedOptimizer` and the single
    optimizers), which would ready the gradients and compute the norm a second time: a pass over every
    gradient and a collective per update.
    """
    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        params = [] if getattr(part, "is_stub_optimizer", False) else part.get_parameters()
        if params and part.config.clip_grad > 0.0:
            clip_grads.clip_grad_by_total_norm_fp32(  # looked up at call time: patched on CPU
                params,
                max_norm=part.config.clip_grad,
                total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    zeros = optimizer.count_zeros() if optimizer.config.log_num_zeros_in_grad else None
    return bool(optimizer.step_with_ready_grads()), zeros


def build_scheduler(optimizer, cfg: OptimizerConfig, total_steps: int):
    """Megatron's LR scheduler: linear warm-up from 0 over `lr_warmup_steps`, then constant, linear or cosine
    decay to `min_lr` at `total_steps`. Weight decay is constant.

    Megatron's convention: the scheduler counts completed updates, so with warm-up the first update uses lr 0.
    """

    if cfg.lr_decay_style not in _DECAY_STYLES:
        raise ValueError(f"optimizer.lr_decay_style={cfg.lr_decay_style!r}: allowed {_DECAY_STYLES}")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps}: must be at least 1")
    # Megatron asserts warmup < decay steps; a warm-up longer than the run just never finishes.
    decay_steps = max(total_steps, cfg.lr_warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.lr_warmup_steps > 0 else cfg.lr,
        max_lr=cfg.lr,
        min_lr=min(cfg.min_lr, cfg.lr),
        lr_warmup_steps=cfg.lr_warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        # On resume only the step count comes from the checkpoint; lr, decay steps and style come from the config.
        # Taking them from the checkpoint made a run resumed with more `steps` decay to min_lr at the old end and
        # train at lr 0 after it, without a word.
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(optimizer) -> float:
    """The learning rate the next update uses (of the default parameter group)."""
    for group in optimizer.param_groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(optimizer.param_groups[0]["lr"])


def build_training(model, cfg: OptimizerConfig, total_steps: int) -> TrainingState:
    """Wrap `model` (this rank's GPTModel) in DDP, build the optimizer and the LR scheduler."""
    ddp = wrap_ddp(model, cfg.use_distributed_optimizer)
    optimizer = build_optimizer(ddp, cfg)
    scheduler = build_scheduler(optimizer, cfg, total_steps)
    return TrainingState(model=ddp, optimizer=optimizer, scheduler=scheduler)


def zero_grads(state: TrainingState) -> None:
    """Clear the DDP gradient buffers and the optimizer's gradients before a forward-backward."""
    state.model.zero_grad_buffer()
    state.optimizer.zero_grad()

"""One RL optimizer step through Megatron's forward-backward schedule (1F1B when PP > 1), with micro-batches.

Who holds what:
- Every rank of one data-parallel replica (its TP, PP and EP peers) passes the same `TrainBatch`, the replica's
  share of the global batch (`batch.data_parallel_shard`). First stages read the tokens; only the last pipeline
  stage evaluates the loss, so only it reads the masks, advantages and old logprobs. `compute_logprobs` (and so
  the proximal logprobs of decoupled PPO) therefore returns a tensor on last-stage ranks and None elsewhere, and
  `with_proximal_logprobs` fills the field on last-stage ranks only: the other stages never need it.
- Current logprobs come from the model called with labels (vocab-parallel cross entropy, logprob = -loss), so no
  rank holds full-vocabulary logits under TP.

Loss normalisation (the gradient equals that of the whole-batch loss, whatever the micro-batching and DP):
- Before the forward-backward, the last stage counts the loss's denominator over its whole share and all-reduces
  it over the data-parallel group: the number of tokens in the effective mask (`token_mean`; a masking IS
  correction removes tokens) or of sequences with at least one such token (`seq_mean`). The KL penalty gets its
  own count over the input mask, as `policy_loss` on the whole batch would use.
- Each micro-batch's loss is `policy_loss(..., normalizer=global count)`: its share of the whole-batch loss, so
  the shares sum to the whole-batch loss exactly.
- Megatron's schedule divides a 2-tuple loss by the number of micro-batches, and DDP scales gradients by
  1 / data-parallel size before summing them over DP (dense and expert parameters alike). The loss handed to
  the schedule is therefore multiplied by `num_microbatches * dp_size`, which cancels both, leaving the sum of
  the shares' gradients. The MoE auxiliary loss (Megatron adds it inside the MoE layer, with the model config's
  `moe_aux_loss_coeff`) keeps Megatron's own scaling: averaged over micro-batches and DP ranks.

Stats: the last stage gathers its share's inputs and current logprobs on data-parallel rank 0, which evaluates
`policy_loss` and `mismatch_metrics` on the whole global batch (exactly what an unsharded run would report) and
broadcasts the dictionary to every rank.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from megatron_rl.algorithms.importance import importance_weights
from megatron_rl.algorithms.kl import kl_penalty
from megatron_rl.algorithms.losses import policy_loss
from megatron_rl.algorithms.masked import as_bool_mask, masked_count, masked_mean
from megatron_rl.algorithms.metrics import mismatch_metrics
from megatron_rl.config import AlgorithmConfig
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.logprobs import forward_logprobs, model_inputs, stage_padding_mask
from megatron_rl.trainer.optimizer import TrainingState, current_lr, unwrap_model, zero_grads


@dataclasses.dataclass(frozen=True)
class Normalizers:
    """Global denominators of one step's loss (over every micro-batch and data-parallel rank)."""

    policy: float
    """Tokens (token_mean) or non-empty sequences (seq_mean) of the policy loss's effective mask."""
    kl: float
    """The same count over the input mask, for the KL penalty."""


def compute_logprobs(model, ctx: ParallelContext, tokens: Tensor, micro_batch_size: int = 1) -> Tensor | None:
    """Logprobs `[B, S-1]` of `tokens[:, 1:]` under the current weights, on last-stage ranks; None elsewhere.

    Only the last pipeline stage evaluates the loss, so only it needs these (as proximal logprobs of a step).
    """
    return forward_logprobs(model, ctx, tokens, micro_batch_size)


def with_proximal_logprobs(model, ctx: ParallelContext, batch: TrainBatch, micro_batch_size: int = 1) -> TrainBatch:
    """The batch with `proximal_logprobs` recomputed under the current weights (last stage; others unchanged)."""
    logprobs = compute_logprobs(model, ctx, batch.tokens, micro_batch_size)
    if logprobs is None:
        return batch
    return batch.replace(proximal_logprobs=logprobs.to(batch.behaviour_logprobs.dtype))


def effective_mask(batch: TrainBatch, algo: AlgorithmConfig) -> Tensor:
    """The mask the policy loss aggregates over: the loss mask, less what a masking IS correction drops."""
    mask = as_bool_mask(batch.loss_mask)
    if algo.loss != "decoupled_ppo":
        return mask
    if batch.proximal_logprobs is None:
        raise ValueError("decoupled_ppo needs proximal_logprobs (see with_proximal_logprobs)")
    return importance_weights(
        batch.proximal_logprobs, batch.behaviour_logprobs, mask, algo.correction, algo.is_cap
    ).mask


def local_count(mask: Tensor, agg: str) -> Tensor:
    """This share's contribution to a loss denominator: masked tokens, or sequences with a masked token."""
    if agg == "seq_mean":
        return masked_count(masked_count(mask, dim=-1) > 0)
    return masked_count(mask)


def local_counts(batch: TrainBatch, algo: AlgorithmConfig) -> Tensor:
    """This share's `[policy, kl]` denominator contributions (float64); summed over DP they give Normalizers."""
    policy = local_count(effective_mask(batch, algo), algo.loss_agg)
    kl = local_count(as_bool_mask(batch.loss_mask), algo.loss_agg)
    return torch.stack([policy, kl]).to(torch.float64)


def normalizers_from_counts(counts: Tensor) -> Normalizers:
    """Normalizers from global `[policy, kl]` counts; an empty count becomes 1 (the loss is then 0, not NaN)."""
    policy, kl = counts.clamp(min=1).tolist()
    return Normalizers(policy=policy, kl=kl)


def global_normalizers(batch: TrainBatch, algo: AlgorithmConfig, ctx: ParallelContext) -> Normalizers:
    """Loss denominators summed over the data-parallel group (last-stage ranks call this)."""
    counts = local_counts(batch, algo).to(ctx.device)
    dist.all_reduce(counts, group=ctx.dp_group)
    return normalizers_from_counts(counts.cpu())


def micro_batch_loss(
    logprobs: Tensor, mb: TrainBatch, algo: AlgorithmConfig, norms: Normalizers
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the whole-batch loss (policy loss plus KL penalty, global denominators)."""
    loss, stats = policy_loss(
        algo.loss,
        logprobs,
        mb.proximal_logprobs,
        mb.behaviour_logprobs,
        mb.advantages,
        mb.loss_mask,
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        correction=algo.correction,
        is_cap=algo.is_cap,
        agg=algo.loss_agg,
        normalizer=norms.policy,
    )
    if algo.kl_coef > 0:
        if mb.ref_logprobs is None:
            raise ValueError(f"kl_coef={algo.kl_coef} needs ref_logprobs in the batch")
        # Its own denominator: the input mask's, as policy_loss on the whole batch would use.
        term, _ = kl_penalty(logprobs, mb.ref_logprobs, mb.loss_mask, algo.kl_coef, "k3", algo.loss_agg, norms.kl)
        loss = loss + term
    return loss, stats


def _loss_func(mb: TrainBatch, algo: AlgorithmConfig, norms: Normalizers, scale: float, output_tensor: Tensor):
    """Megatron loss function: per-token cross entropy `[b, s]` -> (scaled loss, what the step keeps)."""
    logprobs = -output_tensor[:, :-1].float()
    loss, _ = micro_batch_loss(logprobs, mb, algo, norms)
    # The schedule divides by num_microbatches and DDP by the DP size: `scale` cancels both (module docstring).
    return loss * scale, {"loss": loss.detach(), "logprobs": logprobs.detach()}


def _train_forward_step(algo: AlgorithmConfig, norms: Normalizers | None, scale: float, data_iterator, model):
    """Megatron forward step: run the model with labels; the loss function exists on the last stage only."""
    item = next(data_iterator)
    output = model(**item["inputs"])
    if norms is None:  # not the last stage: the schedule never calls the loss function
        return output, None
    return output, partial(_loss_func, item["batch"], algo, norms, scale)


def _micro_batches(batch: TrainBatch, ctx: ParallelContext, micro_batch_size: int, model) -> list[dict]:
    """Model inputs (and, on the last stage, the loss inputs) of each micro-batch.

    RL batches are right-padded to their longest response, often more padding than tokens: the MoE routers get
    the padding mask so that padding tokens count in neither the load-balancing losses nor the expert-bias
    token counts (the latter needs `parallel/patches.py`'s expert-bias fix).
    """
    config = unwrap_model(model).config
    use_mask = bool(getattr(config, "num_moe_experts", None))
    items = []
    for mb in batch.split(micro_batch_size):
        loss_inputs = mb.to(ctx.device) if ctx.is_last_stage else None
        padding = stage_padding_mask(mb.padding_mask(), ctx, config.sequence_parallel) if use_mask else None
        items.append({"inputs": model_inputs(mb.tokens, ctx.device, padding), "batch": loss_inputs})
    return items


def forward_backward(
    model, ctx: ParallelContext, batch: TrainBatch, algo: AlgorithmConfig, micro_batch_size: int
) -> tuple[float | None, Tensor | None]:
    """Run Megatron's forward-backward over the micro-batches; gradients land in the DDP buffers (reduced).

    Returns (this share's loss, its current logprobs `[B, S-1]`) on last-stage ranks, (None, None) elsewhere.
    """

    norms = global_normalizers(batch, algo, ctx) if ctx.is_last_stage else None
    items = _micro_batches(batch, ctx, micro_batch_size, model)
    scale = float(len(items) * ctx.layout.data_parallel)
    model.train()
    outputs = get_forward_backward_func()(
        forward_step_func=partial(_train_forward_step, algo, norms, scale),
        data_iterator=iter(items),
        model=[model],
        num_microbatches=len(items),
        seq_length=batch.seq_len,
        micro_batch_size=micro_batch_size,
        forward_only=False,
    )
    if not ctx.is_last_stage:
        return None, None
    loss = float(sum(float(out["loss"]) for out in outputs))
    return loss, torch.cat([out["logprobs"] for out in outputs], dim=0)


def train_step(
    state: TrainingState, ctx: ParallelContext, batch: TrainBatch, algo: AlgorithmConfig, micro_batch_size: int = 1
) -> dict[str, float]:
    """One optimizer step on this replica's share `batch`; the step's stats on every rank.

    For `decoupled_ppo` the batch must carry `proximal_logprobs` on last-stage ranks (`with_proximal_logprobs`
    before the step). Stats: `loss` (the whole-batch loss that was differentiated), `grad_norm` (before
    clipping), `lr` (of this update), `update_successful`, the `ppo/*`, `is/*`, `kl/*`, `loss/*` stats of
    `policy_loss` and the `mismatch/*` metrics of current vs behaviour logprobs over the whole global batch.
    """
    batch.validate(ctx.layout.tp)
    if batch.batch_size % micro_batch_size:
        raise ValueError(f"batch of {batch.batch_size} is not divisible by micro_batch_size {micro_batch_size}")
    zero_grads(state)
    local_loss, logprobs = forward_backward(state.model, ctx, batch, algo, micro_batch_size)
    lr = current_lr(state.optimizer)
    update_successful, grad_norm, num_zeros = state.optimizer.step()
    if update_successful:
        state.scheduler.step(1)
    stats = None
    if ctx.is_last_stage:
        stats = _global_batch_stats(ctx, batch, logprobs, local_loss, algo)
    stats = _broadcast_from_owner(ctx, stats)
    stats.update(
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        lr=lr,
        update_successful=float(bool(update_successful)),
    )
    if num_zeros is not None:
        stats["num_zeros_in_grad"] = float(num_zeros)
    return stats


def _stats_owner(ctx: ParallelContext) -> int:
    """Global rank that computes the stats: last stage, TP rank 0, DP rank 0 (Megatron's rank order)."""
    return (ctx.layout.pp - 1) * ctx.layout.tp * ctx.layout.data_parallel


def _global_batch_stats(
    ctx: ParallelContext, batch: TrainBatch, logprobs: Tensor, local_loss: float, algo: AlgorithmConfig
) -> dict[str, float] | None:
    """On the owner: stats of the whole global batch from every DP share; None on other last-stage ranks."""
    loss = torch.tensor([local_loss], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(loss, group=ctx.dp_group)
    if ctx.tp_rank != 0:
        return None
    share = (batch.to("cpu"), logprobs.cpu())
    gathered = [None] * ctx.layout.data_parallel if ctx.dp_rank == 0 else None
    dist.gather_object(share, gathered, group=ctx.dp_group, group_dst=0)
    if ctx.dp_rank != 0:
        return None
    full = _concat([b for b, _ in gathered])
    current = torch.cat([lp for _, lp in gathered], dim=0)
    stats = batch_stats(current, full, algo)
    stats["loss"] = float(loss.item())
    return stats


def _concat(batches: list[TrainBatch]) -> TrainBatch:
    """One batch from DP shares (all of the same sequence length)."""
    fields = {}
    for f in dataclasses.fields(TrainBatch):
        values = [getattr(b, f.name) for b in batches]
        fields[f.name] = None if any(v is None for v in values) else torch.cat(values, dim=0)
    return TrainBatch(**fields)


def batch_stats(logprobs: Tensor, batch: TrainBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """The step's stats over a whole batch: what `policy_loss` reports, mismatch metrics, batch shape."""
    mask = as_bool_mask(batch.loss_mask)
    with torch.no_grad():
        _, stats = policy_loss(
            algo.loss,
            logprobs,
            batch.proximal_logprobs,
            batch.behaviour_logprobs,
            batch.advantages,
            mask,
            clip_low=algo.clip_low,
            clip_high=algo.clip_high,
            correction=algo.correction,
            is_cap=algo.is_cap,
            agg=algo.loss_agg,
            ref_logprobs=batch.ref_logprobs,
            kl_coef=algo.kl_coef,
        )
        stats.update(mismatch_metrics(logprobs, batch.behaviour_logprobs, mask))
        stats["batch/sequences"] = torch.tensor(float(batch.batch_size))
        stats["batch/response_tokens"] = masked_count(mask).double()
        stats["batch/mean_logprob"] = masked_mean(logprobs.double(), mask)
    return {k: float(v) for k, v in stats.items()}


def _broadcast_from_owner(ctx: ParallelContext, stats: dict[str, float] | None) -> dict[str, float]:
    """Send the owner's stats dictionary to every rank of the trainer."""
    box = [stats]
    dist.broadcast_object_list(box, src=_stats_owner(ctx))
    return dict(box[0])

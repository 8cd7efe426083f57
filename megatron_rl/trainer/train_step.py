"""One RL optimizer update through Megatron's forward-backward schedule (1F1B when PP > 1), with micro-batches.

Who holds what:
- Every rank of one data-parallel replica (its TP, PP and EP peers) passes the same `TrainBatch`, the replica's
  share of the (mini-)batch (`batch.data_parallel_shard`). First stages read the tokens; only the last pipeline
  stage evaluates the loss, so only it reads the masks, advantages and old logprobs. `compute_logprobs` (and so
  the proximal logprobs of the decoupled losses) therefore returns a tensor on last-stage ranks and None
  elsewhere, and `with_proximal_logprobs` fills the field on last-stage ranks only.
- The training forward returns each TP rank's slice of the logits; the loss function computes the logprobs
  (Megatron's vocab-parallel cross entropy) and the policy's entropy from them (`logprobs.logprobs_and_entropy`),
  so no rank holds full-vocabulary logits under TP.
- With the engines' top-k / top-p mask (`LossSpec.sampling_mask`) every logprob (training forward, proximal,
  reference) is taken under the masked distribution (`logprobs.masked_logprobs`), on the kept sets the engines
  returned (`TrainBatch.kept_tokens`; where a batch has none, the logits rows are gathered over TP to recompute
  the set); the entropy stays that of the unmasked tempered distribution.
- A batch without `proximal_logprobs` under a decoupled loss (one mini-batch: the proximal policy is the current
  one) takes them from this forward, detached: no second pass.

Loss normalisation (the gradient equals that of the whole-batch loss, whatever the micro-batching and DP):
- Before the forward-backward, the last stage counts the denominators over its whole share and all-reduces them
  over the data-parallel group (`objective.denominators`): the policy term's (over the input mask, or the kept
  mask with `is_normalizer: kept`) and the input mask's (KL and entropy terms).
- Each micro-batch's loss is `policy_loss(..., normalizer=global counts)`: its share of the whole-batch loss, so
  the shares sum to the whole-batch loss exactly.
- Megatron's schedule divides a 2-tuple loss by the number of micro-batches, and DDP scales gradients by
  1 / data-parallel size before summing them over DP (dense and expert parameters alike). The loss handed to
  the schedule is therefore multiplied by `num_microbatches * dp_size`, which cancels both, leaving the sum of
  the shares' gradients. The MoE auxiliary loss (Megatron adds it inside the MoE layer, with the model config's
  `moe_aux_loss_coeff`) keeps Megatron's own scaling: averaged over micro-batches and DP ranks.

Guard: an update whose loss (any rank) or gradient norm is not finite is skipped: no optimizer step, no LR step;
its stats say so (`guard/skipped` 1).

Stats: the last stage gathers its share's inputs, current logprobs and entropy on data-parallel rank 0, which
evaluates `policy_loss` and `mismatch_metrics` on the whole global batch (exactly what an unsharded run would
report) and broadcasts the dictionary to every rank.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch import Tensor

from megatron_rl.algorithms.distill import top_k_kl
from megatron_rl.algorithms.masked import as_bool_mask, masked_count, masked_mean
from megatron_rl.algorithms.metrics import fresh_mismatch_metrics, mismatch_metrics
from megatron_rl.algorithms.objective import LossSpec, denominators, policy_loss
from megatron_rl.algorithms.sampling_mask import KEEP_ALL, SamplingMask
from megatron_rl.config import AlgorithmConfig
from megatron_rl.models.routes import TOP_PAD_LOGPROB
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.logprobs import (
    forward_logprobs,
    forward_logprobs_and_untempered,
    logprobs_and_entropy,
    masked_logprobs,
    model_inputs,
    shifted_labels,
    stage_padding_mask,
    vocab_parallel_entropy,
    vocab_parallel_logprobs_at,
)
from megatron_rl.trainer.micro_batches import (
    LossLayout,
    loss_layout,
    packed_model_inputs,
    padding_of,
    plan_micro_batches,
    schedule_shape,
    sequence_lengths,
)
from megatron_rl.trainer.optimizer import TrainingState, current_lr, step_clipped_by, unwrap_model, zero_grads
from megatron_rl.trainer.packing import MicroBatching, MicroBatchPlan


def loss_spec(
    algo: AlgorithmConfig,
    max_new_tokens: int | None = None,
    sampling: SamplingMask | None = None,
    top_kl: tuple[str, float] = ("", 0.0),
    temperature: float = 1.0,
) -> LossSpec:
    """The objective's settings from the config; `max_new_tokens` is Dr. GRPO's constant when the config names
    none (`loss_agg_tokens`). KL in the reward leaves no KL term in the loss. `sampling` (the rollout's top-k /
    top-p) becomes the spec's mask when it can drop tokens and `algorithm.sampling_mask` is on. `top_kl`:
    distillation's top-k KL term (kind, weight), with the rollout `temperature` the logits are divided by."""
    mask = sampling if algo.sampling_mask and sampling is not None and sampling.active else None
    return LossSpec(
        kind=algo.loss, clip_low=algo.clip_low, clip_high=algo.clip_high, dual_clip=algo.dual_clip,
        gspo_clip_low=algo.gspo_clip_low, gspo_clip_high=algo.gspo_clip_high, correction=algo.correction,
        is_cap=algo.is_cap, is_cap_low=algo.is_cap_low, veto_max=algo.veto_max, veto_min=algo.veto_min,
        is_normalizer=algo.is_normalizer, agg=algo.loss_agg, norm_tokens=algo.loss_agg_tokens or max_new_tokens,
        kl_coef=algo.kl_coef if algo.kl_in == "loss" else 0.0, kl_kind=algo.kl_estimator,
        entropy_coef=algo.entropy_coef, sampling_mask=mask, top_kl=top_kl[0], top_kl_coef=top_kl[1],
        temperature=temperature,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Normalizers:
    """Global denominators of one update's loss (over every micro-batch and data-parallel rank)."""

    policy: float
    """The policy term's: tokens, sequences or rows x constant (`loss_agg`) of its mask (`is_normalizer`)."""
    input: float
    """The same count over the input mask, for the KL and entropy terms."""


def compute_logprobs(
    model,
    ctx: ParallelContext,
    tokens: Tensor,
    micro_batch_size: int | MicroBatching | MicroBatchPlan = 1,
    mask: SamplingMask | None = None,
    kept: Tensor | None = None,
    lengths: Tensor | None = None,
) -> Tensor | None:
    """Logprobs `[B, S-1]` of `tokens[:, 1:]` under the current weights (and the engines' `mask`, when given, on
    their kept sets `kept` where the batch has them), on last-stage ranks; None elsewhere.

    Only the last pipeline stage evaluates the loss, so only it needs these (as proximal logprobs of a batch).
    """
    return forward_logprobs(model, ctx, tokens, micro_batch_size, mask, kept, lengths)


def with_proximal_logprobs(
    model,
    ctx: ParallelContext,
    batch: TrainBatch,
    micro_batch_size: int | MicroBatching | MicroBatchPlan = 1,
    mask: SamplingMask | None = None,
) -> TrainBatch:
    """The batch with `proximal_logprobs` recomputed under the current weights (last stage; others unchanged)."""
    logprobs = compute_logprobs(model, ctx, batch.tokens, micro_batch_size, mask, batch.kept_tokens, batch.lengths)
    if logprobs is None:
        return batch
    return batch.replace(proximal_logprobs=logprobs.to(batch.behaviour_logprobs.dtype))


def with_proximal_and_untempered(
    model,
    ctx: ParallelContext,
    batch: TrainBatch,
    temperature: float,
    micro_batch_size: int | MicroBatching | MicroBatchPlan = 1,
    mask: SamplingMask | None = None,
) -> tuple[TrainBatch, Tensor | None]:
    """(the batch with `proximal_logprobs` as `with_proximal_logprobs` sets them, the untempered logprobs
    `[B, S-1]` of the same forward) on last-stage ranks; (the batch unchanged, None) elsewhere. On-policy
    distillation compares the untempered ones with the teacher's (`forward_logprobs_and_untempered`)."""
    both = forward_logprobs_and_untempered(
        model, ctx, batch.tokens, temperature, micro_batch_size, mask, batch.kept_tokens, batch.lengths
    )
    if both is None:
        return batch, None
    proximal, untempered = both
    return batch.replace(proximal_logprobs=proximal.to(batch.behaviour_logprobs.dtype)), untempered


def local_counts(batch: TrainBatch, spec: LossSpec) -> Tensor:
    """This share's `[policy, input]` denominator contributions (float64); summed over DP they give Normalizers."""
    if spec.kept_mask_matters and batch.proximal_logprobs is None:
        raise ValueError("is_normalizer=kept with a masking correction needs proximal_logprobs before the update")
    return denominators(spec, batch.proximal_logprobs, batch.behaviour_logprobs, batch.loss_mask)


def normalizers_from_counts(counts: Tensor) -> Normalizers:
    """Normalizers from global `[policy, input]` counts; an empty count becomes 1 (the loss is 0, not NaN)."""
    policy, inputs = counts.clamp(min=1).tolist()
    return Normalizers(policy=policy, input=inputs)


def global_normalizers(batch: TrainBatch, spec: LossSpec, ctx: ParallelContext) -> Normalizers:
    """Loss denominators summed over the data-parallel group (last-stage ranks call this)."""
    counts = local_counts(batch, spec).to(ctx.device)
    dist.all_reduce(counts, group=ctx.dp_group)
    return normalizers_from_counts(counts.cpu())


def micro_batch_loss(
    logprobs: Tensor, mb: TrainBatch, spec: LossSpec, norms: Normalizers, entropy: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the whole-batch loss (policy loss, KL and entropy terms, global denominators).

    Without `proximal_logprobs` a decoupled loss takes the current logprobs, detached, as the proximal ones.
    """
    proximal = mb.proximal_logprobs
    if proximal is None and spec.uses_proximal:
        proximal = logprobs.detach()
    return policy_loss(
        spec, logprobs, proximal, mb.behaviour_logprobs, mb.advantages, mb.loss_mask,
        normalizer=norms.policy, input_normalizer=norms.input,
        ref_logprobs=mb.ref_logprobs if spec.kl_coef > 0 else None, entropy=entropy,
    )  # fmt: skip


def _loss_func(
    mb: TrainBatch, spec: LossSpec, norms: Normalizers, scale: float, layout: LossLayout, output_tensor: Tensor
):
    """Megatron loss function: vocab-parallel logits on the rows the model ran -> (scaled loss, what the update
    keeps). Per-token results are computed there (`layout`: packed rows stay packed) and taken back to the batch
    layout `[b, S]` of the masks."""
    logits = layout.rows(output_tensor)
    labels = layout.labels(shifted_labels(mb.tokens))
    outside = top = None
    if spec.top_kl:  # first: the cross entropy below overwrites fp32 logits in place
        top = _top_kl_term(mb, spec, logits, layout)
    if spec.sampling_mask is None:
        logprobs, entropy = logprobs_and_entropy(logits, labels, entropy_grad=spec.entropy_coef > 0)
    else:
        entropy = vocab_parallel_entropy(logits, with_grad=spec.entropy_coef > 0)
        kept_sets = layout.per_position(mb.kept_tokens, KEEP_ALL)  # nothing is trained there: no set to recompute
        logprobs, outside = masked_logprobs(logits, labels, spec.sampling_mask, kept_sets)
        outside = layout.back(outside)[:, :-1]
    logprobs, entropy = layout.back(logprobs)[:, :-1], layout.back(entropy)[:, :-1]
    loss, _ = micro_batch_loss(logprobs, mb, spec, norms, entropy)
    if top is not None:  # a token mean over the global batch, like the KL and entropy terms
        loss = loss + spec.top_kl_coef * top.sum() / max(norms.input, 1.0)
    # The schedule divides by num_microbatches and DDP by the DP size: `scale` cancels both (module docstring).
    kept = {"loss": loss.detach(), "logprobs": logprobs.detach(), "entropy": entropy.detach(), "outside": outside}
    kept["top_kl"] = None if top is None else top.detach()
    return loss * scale, kept


def _top_kl_term(mb: TrainBatch, spec: LossSpec, logits: Tensor, layout: LossLayout) -> Tensor:
    """`[b, S-1]` the top-k KL to the teacher at each response position (0 elsewhere), with gradient: the
    student's untempered logprobs at the teacher's top-k ids against the teacher's (`algorithms.distill`)."""
    if mb.teacher_top_ids is None:
        raise ValueError("distill.loss is a top-k KL but the batch carries no teacher top-k (Sample.metadata)")
    ids = layout.per_position(mb.teacher_top_ids, 0)
    teacher = layout.per_position(mb.teacher_top_logprobs, TOP_PAD_LOGPROB)
    # Padded: the batch's `[b, S-1, k]` against all positions but the last; packed: every packed position.
    positions = logits if layout.packed is not None else logits[:, :-1]
    student = vocab_parallel_logprobs_at(positions * spec.temperature, ids)
    term = top_k_kl(student, teacher, spec.top_kl)
    if layout.packed is not None:
        term = layout.back(term)[:, :-1]
    return torch.where(as_bool_mask(mb.loss_mask), term, torch.zeros_like(term))


def _train_forward_step(spec: LossSpec, norms: Normalizers | None, scale: float, data_iterator, model):
    """Megatron forward step: run the model for its logits; the loss function exists on the last stage only."""
    item = next(data_iterator)
    output = model(**item["inputs"])
    if norms is None:  # not the last stage: the schedule never calls the loss function
        return output, None
    return output, partial(_loss_func, item["batch"], spec, norms, scale, item["layout"])


def _micro_batches(batch: TrainBatch, ctx: ParallelContext, plan: MicroBatchPlan, model) -> list[dict]:
    """Model inputs (and, on the last stage, the loss inputs in the batch layout) of each micro-batch of `plan`.

    RL batches are right-padded to their longest response, often more padding than tokens: the MoE routers get
    the padding mask so that padding tokens count in neither the load-balancing losses nor the expert-bias
    token counts (the latter needs `parallel/patches.py`'s expert-bias fix). Packed rows have padding only at
    their tail.
    """
    config = unwrap_model(model).config
    use_mask = bool(getattr(config, "num_moe_experts", None))
    batch_padding = batch.padding_mask() if use_mask else None
    items = []
    for index, rows in enumerate(plan.groups):
        mb = batch.select(rows)
        if plan.packed is None:
            inputs = model_inputs(mb.tokens, ctx.device, labels=False)
        else:
            inputs = packed_model_inputs(plan.packed[index], ctx.device, model, labels=False)
        if use_mask:
            padding = padding_of(plan, index, batch_padding, model)
            inputs["padding_mask"] = stage_padding_mask(padding, ctx, config.sequence_parallel).to(ctx.device)
        loss_inputs = mb.to(ctx.device) if ctx.is_last_stage else None
        items.append({"inputs": inputs, "batch": loss_inputs, "layout": loss_layout(plan, index)})
    return items


def forward_backward(
    model, ctx: ParallelContext, batch: TrainBatch, spec: LossSpec, micro: int | MicroBatching | MicroBatchPlan
) -> tuple[float | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Run Megatron's forward-backward over the micro-batches of `micro` (a size, the trainer's micro-batching or
    a plan); gradients land in the DDP buffers (reduced).

    Returns (this share's loss, its current logprobs `[B, S-1]`, its entropy `[B, S-1]`, which labels fell outside
    the sampling mask `[B, S-1]` or None without one, the top-k KL to the teacher `[B, S-1]` or None without that
    term) on last-stage ranks, five Nones elsewhere.
    """

    norms = global_normalizers(batch, spec, ctx) if ctx.is_last_stage else None
    plan = plan_micro_batches(batch.tokens, batch.lengths, micro, ctx)  # a given plan as it is
    items = _micro_batches(batch, ctx, plan, model)
    seq_length, rows = schedule_shape(plan, model)
    scale = float(len(items) * ctx.layout.data_parallel)
    model.train()
    outputs = get_forward_backward_func()(
        forward_step_func=partial(_train_forward_step, spec, norms, scale),
        data_iterator=iter(items),
        model=[model],
        num_microbatches=len(items),
        seq_length=seq_length,
        micro_batch_size=rows,
        forward_only=False,
    )
    if not ctx.is_last_stage:
        return None, None, None, None, None
    loss = float(sum(float(out["loss"]) for out in outputs))

    def joined(key: str) -> Tensor:
        return plan.restore([out[key] for out in outputs])

    outside = None if spec.sampling_mask is None else joined("outside")
    top = None if not spec.top_kl else joined("top_kl")
    return loss, joined("logprobs"), joined("entropy"), outside, top


def _global_loss(ctx: ParallelContext, local_loss: float | None) -> tuple[float, bool]:
    """(the whole-batch loss: the sum of the DP shares' losses, whether every rank's loss is finite), on every rank,
    from one all-reduce. Ranks without a loss (off the last stage) count as finite; TP ranks other than 0 add no
    share (theirs repeats rank 0's)."""
    has_loss = local_loss is not None
    share = local_loss if has_loss and ctx.tp_rank == 0 else 0.0
    bad = 0.0 if not has_loss or math.isfinite(local_loss) else 1.0
    both = torch.tensor([share, bad], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(both)
    loss, bad_ranks = both.tolist()
    return loss, bad_ranks == 0


def _guarded_optimizer_step(state: TrainingState, loss_finite: bool) -> tuple[bool, float, float | None]:
    """The optimizer step unless the loss or the gradient norm is not finite: (stepped, grad norm, zeros).

    The gradients are readied and their norm taken once, before the step decides (`step_clipped_by`).
    """
    found_inf = bool(state.optimizer.prepare_grads())
    grad_norm = float(state.optimizer.get_grad_norm())
    if found_inf or not loss_finite or not math.isfinite(grad_norm):
        return False, grad_norm, None
    update_successful, num_zeros = step_clipped_by(state.optimizer, grad_norm)
    if update_successful:
        state.scheduler.step(1)
    return bool(update_successful), grad_norm, num_zeros


def train_step(
    state: TrainingState,
    ctx: ParallelContext,
    batch: TrainBatch,
    spec: LossSpec,
    micro_batch_size: int | MicroBatching | MicroBatchPlan = 1,
    fresh_version: int | None = None,
) -> dict[str, float]:
    """One optimizer update on this replica's share `batch`; the update's stats.

    A decoupled loss uses the batch's `proximal_logprobs` (last-stage ranks) when given, else this forward's own
    logprobs, detached. Stats on every rank: `loss` (the whole-batch loss that was differentiated), `grad_norm`
    (before clipping), `lr` (of this update), `update_successful`, `guard/skipped` (1 when the loss or the gradient
    norm was not finite and nothing was updated), `batch/micro_batches`, `batch/token_fill`. On rank 0, which logs
    them (`stats_for_rank0`), also the `ppo/*`, `is/*`, `kl/*`, `loss/*`, `policy/entropy` stats of
    `policy_loss` and the `mismatch/*` metrics of current vs behaviour logprobs over the whole global batch;
    with `fresh_version` (the weights' version when the batch's first forward ran, given only when this update's
    proximal or current logprobs are that forward's) also `mismatch/fresh_*` over the tokens it sampled.
    """
    batch.validate(ctx.layout.tp)
    plan = plan_micro_batches(batch.tokens, batch.lengths, micro_batch_size, ctx)
    zero_grads(state)
    local_loss, logprobs, entropy, outside, top = forward_backward(state.model, ctx, batch, spec, plan)
    lr = current_lr(state.optimizer)
    loss, finite = _global_loss(ctx, local_loss)
    stepped, grad_norm, num_zeros = _guarded_optimizer_step(state, finite)
    stats = None
    if ctx.is_last_stage:
        stats = _global_batch_stats(ctx, batch, (logprobs, entropy, outside, top), spec, fresh_version)
    stats = stats_for_rank0(ctx, stats)
    stats.update(loss=loss, grad_norm=grad_norm, lr=lr, update_successful=float(stepped))
    stats["guard/skipped"] = float(not stepped)
    if num_zeros is not None:
        stats["num_zeros_in_grad"] = float(num_zeros)
    stats["batch/micro_batches"] = float(plan.num_micro_batches)
    stats["batch/token_fill"] = plan.token_fill(int(sequence_lengths(batch.tokens, batch.lengths).sum()))
    return stats


def _stats_owner(ctx: ParallelContext) -> int:
    """Global rank that computes the stats: last stage, TP rank 0, DP rank 0 (Megatron's rank order)."""
    return (ctx.layout.pp - 1) * ctx.layout.tp * ctx.layout.data_parallel


def _global_batch_stats(
    ctx: ParallelContext,
    batch: TrainBatch,
    outputs: tuple,
    spec: LossSpec,
    fresh_version: int | None = None,
) -> dict[str, float] | None:
    """On the owner: stats of the whole global batch from every DP share (`outputs`: this share's logprobs,
    entropy and labels outside the sampling mask, or None); None on other last-stage ranks."""
    if ctx.tp_rank != 0:
        return None
    share = (stats_view(batch), *outputs)
    gathered = [None] * ctx.layout.data_parallel if ctx.dp_rank == 0 else None
    dist.gather_object(_to_numpy(share), gathered, group=ctx.dp_group, group_dst=0)
    if ctx.dp_rank != 0:
        return None
    gathered = [_from_numpy(g) for g in gathered]
    full = concat_batches([g[0] for g in gathered])
    current, entropy = (torch.cat([g[i] for g in gathered], dim=0) for i in (1, 2))
    stats = batch_stats(current, full, spec, entropy, fresh_version)
    if spec.sampling_mask is not None:
        outside = torch.cat([g[3] for g in gathered], dim=0)
        stats["policy/outside_mask_frac"] = float(masked_mean(outside.double(), as_bool_mask(full.loss_mask)))
    if spec.top_kl:
        top = torch.cat([g[4] for g in gathered], dim=0)
        stats["distill/top_kl"] = float(masked_mean(top.double(), as_bool_mask(full.loss_mask)))
    return stats


STATS_FIELDS = (
    "tokens",
    "loss_mask",
    "advantages",
    "behaviour_logprobs",
    "proximal_logprobs",
    "ref_logprobs",
    "versions",
)
"""The `TrainBatch` fields `batch_stats` reads (`tokens` for the batch size): all of a share the stats owner gets."""


def stats_view(batch: TrainBatch) -> TrainBatch:
    """`batch` with only `STATS_FIELDS` (the rest None): the routes, kept sets and teacher tensors of a share would
    cost the stats owner memory and time that grow with the global batch, and the stats read none. (`_to_numpy`
    moves what is sent to the CPU.)"""
    return TrainBatch(**{f: getattr(batch, f) for f in STATS_FIELDS})


def _to_numpy(value):
    """`value` (a tensor, TrainBatch, tuple or None) with its tensors moved to the CPU and, where numpy has their
    dtype, as numpy arrays: those pickle as raw bytes, where a tensor pickles through torch.save (15x the CPU at
    the quickstart's size, measured)."""
    if isinstance(value, TrainBatch):
        return TrainBatch(**{f.name: _to_numpy(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, tuple):
        return tuple(_to_numpy(v) for v in value)
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        try:
            return value.numpy()
        except TypeError:  # a dtype numpy lacks (bfloat16, float8): it travels as a tensor
            return value
    return value


def _from_numpy(value):
    """The inverse of `_to_numpy` (arrays back to CPU tensors)."""
    if isinstance(value, TrainBatch):
        return TrainBatch(**{f.name: _from_numpy(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, tuple):
        return tuple(_from_numpy(v) for v in value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value


def concat_batches(batches: list[TrainBatch]) -> TrainBatch:
    """One batch from DP shares (all of the same sequence length)."""
    fields = {}
    for f in dataclasses.fields(TrainBatch):
        values = [getattr(b, f.name) for b in batches]
        fields[f.name] = None if any(v is None for v in values) else torch.cat(values, dim=0)
    return TrainBatch(**fields)


def batch_stats(
    logprobs: Tensor,
    batch: TrainBatch,
    spec: LossSpec,
    entropy: Tensor | None = None,
    fresh_version: int | None = None,
) -> dict[str, float]:
    """The update's stats over a whole batch: what `policy_loss` reports, mismatch metrics, batch shape.

    Without `proximal_logprobs` (one mini-batch) the proximal policy is the current one, as in the update. With
    `fresh_version` and the batch's `versions`, the mismatch of the batch-start logprobs (proximal, else current)
    on the tokens that version sampled (`fresh_mismatch_metrics`).
    """
    mask = as_bool_mask(batch.loss_mask)
    proximal = batch.proximal_logprobs
    if proximal is None and spec.uses_proximal:
        proximal = logprobs
    with torch.no_grad():
        _, stats = policy_loss(
            spec, logprobs, proximal, batch.behaviour_logprobs, batch.advantages, mask,
            ref_logprobs=batch.ref_logprobs if spec.kl_coef > 0 else None, entropy=entropy,
        )  # fmt: skip
        stats.update(mismatch_metrics(logprobs, batch.behaviour_logprobs, mask))
        if fresh_version is not None and batch.versions is not None:
            start = batch.proximal_logprobs if batch.proximal_logprobs is not None else logprobs
            stats.update(fresh_mismatch_metrics(start, batch.behaviour_logprobs, mask, batch.versions, fresh_version))
        stats["batch/sequences"] = torch.tensor(float(batch.batch_size))
        stats["batch/response_tokens"] = masked_count(mask).double()
        stats["batch/mean_logprob"] = masked_mean(logprobs.double(), mask)
    return {k: float(v) for k, v in stats.items()}


def stats_for_rank0(ctx: ParallelContext, stats: dict[str, float] | None) -> dict[str, float]:
    """The stats owner's dictionary (last stage, TP and DP rank 0) where rank 0, which logs it, can read it.

    Without pipeline parallelism the owner is rank 0: no collective, and the other ranks get {}. Otherwise one
    broadcast from the owner gives every rank the dictionary."""
    owner = _stats_owner(ctx)
    if owner == 0:
        return dict(stats or {}) if ctx.rank == 0 else {}
    box = [stats]
    dist.broadcast_object_list(box, src=owner)
    return dict(box[0])

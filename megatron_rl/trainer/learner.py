"""The learner: one trainer rank's policy model, optimizer and (with a KL penalty) frozen reference, and the RL
updates of one batch. No Ray and no rollout: the loop around it (`trainer/loop.py`) brings the batches.

One batch = `ppo_epochs` passes over `ppo_minibatches` contiguous mini-batches, one optimizer update each
(`train_step.train_step`). The proximal policy is the one the batch starts from: with more than one update its
logprobs are computed once, before the first (so the clip acts from the second update on); with one update they
come from the training forward itself. The loop pushes the new weights to the engines once per batch, and a weight
version counts batches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.algorithms.advantages import compute_advantages
from megatron_rl.algorithms.distill import distill_advantages, reverse_kl_sums
from megatron_rl.algorithms.kl import sequence_kl
from megatron_rl.algorithms.objective import LossSpec
from megatron_rl.algorithms.sampling_mask import SamplingMask
from megatron_rl.config import AlgorithmConfig, RunConfig
from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.parallel.groups import ParallelContext
from megatron_rl.parallel.layout import layout_from_config
from megatron_rl.trainer.batch import TrainBatch, replica_rows
from megatron_rl.trainer.checkpoint import load_checkpoint, load_rng, save_checkpoint, save_rng
from megatron_rl.trainer.hf_weights import load_hf_into_model
from megatron_rl.trainer.lora import AdaptersOff, add_lora
from megatron_rl.trainer.micro_batches import plan_micro_batches
from megatron_rl.trainer.model import BuildOptions, build_gpt_model
from megatron_rl.trainer.optimizer import TrainingState, build_training, unwrap_model
from megatron_rl.trainer.packing import MicroBatching, MicroBatchPlan
from megatron_rl.trainer.routing_replay import BatchRouting
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.trainer.train_step import (
    compute_logprobs,
    loss_spec,
    stats_for_rank0,
    train_step,
    with_proximal_and_untempered,
    with_proximal_logprobs,
)

SUMMED_STATS = ("batch/sequences", "batch/response_tokens", "mismatch/fresh_tokens")
"""Stats of an update that add up over a batch's mini-batches (of one epoch); the rest are averaged."""


class NonFiniteError(RuntimeError):
    """Too many updates in a row had a loss or gradient norm that is not finite, or the weights are not."""


def build_options(cfg: RunConfig) -> BuildOptions:
    """How the run's policy (and reference) model is built on every rank."""
    return BuildOptions(
        dtype=cfg.model.dtype, moe_dispatcher=cfg.trainer.moe_dispatcher, init_weights=False,
        max_sequence_length=cfg.model.max_sequence_length, moe_aux_loss_coeff=cfg.trainer.moe_aux_loss_coeff,
        recompute=cfg.trainer.recompute, logit_temperature=cfg.rollout.temperature,
        packed_sequences=cfg.trainer.pack_sequences,
        use_te=False if cfg.lora.enabled else None,  # adapters sit on Megatron's local linears
    )  # fmt: skip


def updates_per_batch(algo: AlgorithmConfig) -> int:
    """Optimizer updates one batch takes (the LR schedule counts these)."""
    return algo.ppo_minibatches * algo.ppo_epochs


class SkipCounter:
    """Updates skipped for a loss or gradient norm that is not finite: in all and in a row, with the limit."""

    def __init__(self, limit: int):
        self.limit, self.total, self.in_a_row = limit, 0, 0

    def record(self, skipped: bool, where: str) -> None:
        """Count one update; NonFiniteError when `limit` were skipped in a row."""
        self.total += int(skipped)
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"{self.in_a_row} updates in a row had a loss or gradient norm that is not finite (last: {where});"
                f" algorithm.max_skipped_updates_in_a_row={self.limit}"
            )


def kl_in_reward(batch: TrainBatch, ctx: ParallelContext, algo: AlgorithmConfig) -> tuple[TrainBatch, float]:
    """(Last-stage ranks) the share with advantages recomputed from `reward - kl_coef * sum_t KL_t` over the
    whole global batch (behaviour vs reference logprobs, `kl_estimator`), and the batch's mean penalty."""
    if batch.ref_logprobs is None or batch.rewards is None or batch.group_ids is None:
        raise ValueError("algorithm.kl_in=reward needs ref_logprobs, rewards and group_ids in the batch")
    kl = sequence_kl(batch.behaviour_logprobs, batch.ref_logprobs, batch.loss_mask, algo.kl_estimator)
    parts = torch.stack([batch.rewards.double(), batch.group_ids.double(), algo.kl_coef * kl.double()])
    gathered = [torch.empty_like(parts) for _ in range(ctx.layout.data_parallel)]
    dist.all_gather(gathered, parts.to(ctx.device).contiguous(), group=ctx.dp_group)
    dp, total = ctx.layout.data_parallel, batch.batch_size * ctx.layout.data_parallel
    order = torch.cat([replica_rows(total, r, dp, algo.ppo_minibatches) for r in range(dp)])
    full = torch.empty(3, total, dtype=torch.float64)
    full[:, order] = torch.cat([g.cpu() for g in gathered], dim=1)
    rewards, group_ids, penalties = full
    advantages = compute_advantages(algo.advantage, rewards - penalties, group_ids=group_ids.long())
    mine = advantages[replica_rows(total, ctx.dp_rank, dp, algo.ppo_minibatches)]
    return batch.replace(advantages=mine.to(batch.advantages.dtype)), float(penalties.mean())


@dataclasses.dataclass(frozen=True)
class Distillation:
    """On-policy distillation's settings in the trainer (`distill`), and its step on a batch."""

    kl_coef: float
    """lambda of the reverse-KL term."""
    use_reward: bool
    """Whether the reward's advantages stay in (false: pure distillation)."""
    temperature: float
    """The rollout temperature the model divides its logits by (the untempered logprobs undo it)."""
    in_advantage: bool = True
    """Whether the teacher's term goes into the advantages (`distill.loss: advantage`); else it is the loss's
    top-k KL term and the advantages are the reward's alone (zero in pure distillation)."""

    @classmethod
    def of(cls, cfg: RunConfig) -> Distillation | None:
        """The run's distillation, None without a teacher."""
        d = cfg.distill
        return cls(d.kl_coef, d.use_reward, cfg.rollout.temperature, not d.top_loss) if d.enabled else None

    def apply(self, batch: TrainBatch, untempered: Tensor, ctx: ParallelContext) -> tuple[TrainBatch, dict]:
        """(Last-stage ranks) the share with per-token advantages `use_reward * A - kl_coef * (student - teacher)`
        (`algorithms.distill.distill_advantages`), and the global batch's `distill/reverse_kl` (the mean over
        its response tokens of student - teacher, untempered logprobs) and `distill/reverse_kl_abs_max`."""
        if batch.teacher_logprobs is None:
            raise ValueError("distill.teacher is set but the batch has no teacher logprobs (Sample.teacher_logprobs)")
        teacher, mask = batch.teacher_logprobs, batch.loss_mask
        coef = self.kl_coef if self.in_advantage else 0.0
        advantages = distill_advantages(batch.advantages, untempered, teacher, mask, coef, self.use_reward)
        sums = reverse_kl_sums(untempered, teacher, mask)
        total, largest = sums[:3].to(ctx.device).contiguous(), sums[3:].to(ctx.device).contiguous()
        dist.all_reduce(total, group=ctx.dp_group)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ctx.dp_group)
        kl, tokens, k3 = total.cpu().tolist()
        stats = {
            "distill/reverse_kl": kl / max(tokens, 1.0), "distill/k3_kl": k3 / max(tokens, 1.0),
            "distill/reverse_kl_abs_max": float(largest.item()),
        }  # fmt: skip
        return batch.replace(advantages=advantages.to(batch.advantages.dtype)), stats


def aggregate_updates(updates: list[dict], per_epoch: int) -> dict:
    """One batch's stats from its updates' stats: sums of `SUMMED_STATS` over the first epoch, means of the
    rest over the updates that were not skipped (over all when every one was), and the guard's counts."""
    kept = [u for u in updates if not u.get("guard/skipped")] or updates
    keys = {k for u in updates for k in u}
    out = {k: sum(u[k] for u in kept if k in u) / max(1, sum(k in u for u in kept)) for k in keys}
    for key in SUMMED_STATS:
        if key in keys:
            out[key] = sum(u.get(key, 0.0) for u in updates[:per_epoch])
    out["grad_norm_max"] = max(u["grad_norm"] for u in updates)
    out["ppo/updates"] = float(len(updates))
    out["guard/skipped_updates"] = float(sum(u.get("guard/skipped", 0.0) for u in updates))
    out["guard/skipped"] = float(all(u.get("guard/skipped", 0.0) for u in updates))
    return out


def train_batch(
    state: TrainingState,
    ctx: ParallelContext,
    batch: TrainBatch,
    algo: AlgorithmConfig,
    spec: LossSpec,
    micro: int | MicroBatching,
    reference=None,
    skips: SkipCounter | None = None,
    distill: Distillation | None = None,
    routing: BatchRouting | None = None,
    version: int | None = None,
) -> dict:
    """Every update of one batch (this replica's share): proximal and reference logprobs when needed (under the
    spec's sampling mask, as the current ones), KL in the reward, the teacher's term in the advantages (with
    `distill`), then `ppo_epochs` x `ppo_minibatches` updates; the aggregated stats (`aggregate_updates`). `micro`:
    the micro-batch size or the trainer's micro-batching (`trainer/packing.py`). With `routing`, every forward of
    the policy replays the engines' experts (or only measures agreement, in the first forward of the batch).
    `version` (the weights' at the start) adds `mismatch/fresh_*` to the updates whose proximal or current
    logprobs are the batch start's."""
    updates = updates_per_batch(algo)
    mask = spec.sampling_mask
    untempered = None
    proximal = distill is not None or (spec.uses_proximal and (updates > 1 or spec.kept_mask_matters))
    whole = plan_micro_batches(batch.tokens, batch.lengths, micro, ctx) if proximal or reference is not None else None
    with _routed(routing, batch, whole, measure=True) if proximal else contextlib.nullcontext():
        if distill is not None:  # one forward: the proximal logprobs and the untempered ones the teacher's compare
            batch, untempered = with_proximal_and_untempered(state.model, ctx, batch, distill.temperature, whole, mask)
        elif proximal:
            batch = with_proximal_logprobs(state.model, ctx, batch, whole, mask)
    extra = {}
    if reference is not None:
        ref = compute_logprobs(reference, ctx, batch.tokens, whole, mask, batch.kept_tokens, batch.lengths)
        if ref is not None:  # last stage
            batch = batch.replace(ref_logprobs=ref.to(batch.behaviour_logprobs.dtype))
    if ctx.is_last_stage:  # only the last stage reads the advantages
        if algo.kl_in == "reward":
            batch, extra["kl/reward_penalty_mean"] = kl_in_reward(batch, ctx, algo)
        if distill is not None:  # after KL in the reward, which recomputes the reward's advantages
            batch, distill_stats = distill.apply(batch, untempered, ctx)
            extra |= distill_stats
    if algo.kl_in == "reward" or distill is not None:
        extra = stats_for_rank0(ctx, extra)
    minibatches = batch.minibatches(algo.ppo_minibatches)
    plans = [_minibatch_plan(mb, micro, ctx) for mb in minibatches]
    results = []
    for epoch in range(algo.ppo_epochs):
        for index, (mb, plan) in enumerate(zip(minibatches, plans)):
            with _routed(routing, mb, plan, measure=not proximal and epoch == 0):
                start = version if proximal or (epoch == 0 and index == 0) else None  # batch-start logprobs
                stats = train_step(state, ctx, mb, spec, plan, fresh_version=start)
            results.append(stats)
            if skips is not None:
                where = f"epoch {epoch} mini-batch {index}: loss {stats.get('loss')}, grad norm {stats['grad_norm']}"
                skips.record(bool(stats["guard/skipped"]), where)
    if routing is not None:
        extra |= routing.stats(ctx.dp_group)
    return aggregate_updates(results, len(minibatches)) | extra


def _minibatch_plan(mb: TrainBatch, micro: int | MicroBatching, ctx: ParallelContext) -> MicroBatchPlan:
    """The micro-batches of one mini-batch (the same in every epoch), ValueError naming the settings that clash."""
    try:
        return plan_micro_batches(mb.tokens, mb.lengths, micro, ctx)
    except ValueError as err:
        raise ValueError(
            f"a mini-batch of {mb.batch_size} sequences (this replica's share / algorithm.ppo_minibatches) does not"
            f" split into micro-batches: {err}"
        ) from err


def _routed(routing: BatchRouting | None, batch: TrainBatch, plan: MicroBatchPlan | None, measure: bool):
    """`routing.forward(...)` around one forward of the policy, or nothing without routing replay/measurement."""
    return contextlib.nullcontext() if routing is None else routing.forward(batch, plan, measure)


def weights_finite(model) -> bool:
    """(Every rank, collectively) whether every parameter and buffer of every rank's model is finite.

    Each tensor's fp32 sum is finite exactly when its elements are, unless finite elements sum past fp32's range;
    the sums (one fast reduction each, one host synchronisation for all) decide, and only a tensor whose sum is
    not finite is checked element by element."""
    model = unwrap_model(model)  # Megatron's DDP wrapper shadows `buffers` with its gradient buffers
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    bad = 0.0
    if tensors:
        sums = torch.stack([t.detach().sum(dtype=torch.float32) for t in tensors])
        suspects = (~torch.isfinite(sums)).nonzero().flatten().tolist()
        bad = float(any(not bool(torch.isfinite(tensors[i]).all()) for i in suspects))
    flag = torch.tensor([bad], device=next(model.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


class Learner:
    """This rank's model, optimizer and the settings of a step."""

    def __init__(self, cfg: RunConfig):
        opts = build_options(cfg)
        self.cfg = cfg
        layout = layout_from_config(cfg.trainer.parallel)
        self.rank = bring_up_from_hf(cfg.model.hf_path, layout, opts, timeout_s=cfg.trainer.collective_timeout_s)
        if cfg.lora.enabled:  # the base frozen, adapters beside its targeted linears, before DDP and the optimizer
            r = self.rank
            add_lora(r.model, cfg.lora, r.family, r.arch, r.ctx, seed=cfg.trainer.seed)
        self.state = build_training(
            self.rank.model, cfg.trainer.optimizer, cfg.steps * updates_per_batch(cfg.algorithm)
        )
        self.reference = self._reference_model(opts) if cfg.algorithm.kl_coef > 0 else None
        sampling = SamplingMask(cfg.rollout.top_k, cfg.rollout.top_p)
        top_kl = (cfg.distill.top_loss, cfg.distill.kl_coef)
        self.spec = loss_spec(cfg.algorithm, cfg.rollout.max_new_tokens, sampling, top_kl, cfg.rollout.temperature)
        self.skips = SkipCounter(cfg.algorithm.max_skipped_updates_in_a_row)
        self.distill = Distillation.of(cfg)
        mode = cfg.algorithm.routing
        self.routing = None if mode == "free" else BatchRouting(self.rank.model, mode)

    def _reference_model(self, opts: BuildOptions):
        """A frozen copy of the starting policy at the same layout, for the KL penalty; with LoRA the policy's
        own base, its adapters off (no second model)."""
        r = self.rank
        if self.cfg.lora.enabled:
            return AdaptersOff(r.model)
        model = build_gpt_model(r.family, r.arch, r.hf_config, r.ctx, opts)
        load_hf_into_model(model, HFCheckpoint(self.cfg.model.hf_path), r.family, r.arch, r.ctx)
        model.requires_grad_(False)
        return model

    def step(self, batch: TrainBatch, version: int | None = None) -> dict:
        """Every update of one batch (`train_batch`) from the weights of `version` (for `mismatch/fresh_*`);
        stats with the guard's counts and the time taken."""
        t0 = time.perf_counter()
        stats = train_batch(
            self.state, self.rank.ctx, batch, self.cfg.algorithm, self.spec, MicroBatching.of(self.cfg.trainer),
            self.reference, self.skips, self.distill, self.routing, version,
        )  # fmt: skip
        stats["guard/skipped_updates_total"] = float(self.skips.total)
        stats["time/train_s"] = time.perf_counter() - t0
        return stats

    def check_weights(self, step: int, doing: str = "pushing them to the engines") -> None:
        """(Every rank) NonFiniteError instead of letting weights that are not finite reach the engines (or what
        `doing` names)."""
        if not weights_finite(self.state.model):
            raise NonFiniteError(f"the weights after step {step} are not finite: not {doing}")

    def save(self, folder: Path, step: int) -> None:
        """(Every rank) model, optimizer (layout-independent), LR scheduler and this rank's RNG into `folder`."""
        r = self.rank
        meta = {"family": r.family.name, "dtype": self.cfg.model.dtype, "layout": r.ctx.layout.describe(), "step": step}
        if self.cfg.lora.enabled:  # the adapters in it, and the base they go on (`megatron-rl export`)
            meta |= {"lora": self.cfg.lora.model_dump(mode="json"), "base_hf_path": str(self.cfg.model.hf_path)}
        extra = {"scheduler": self.state.scheduler.state_dict(), "step": step}
        save_checkpoint(
            self.state.model, r.ctx, folder, meta, hf_dir=self.cfg.model.hf_path, optimizer=self.state.optimizer,
            extra=extra,
        )  # fmt: skip
        save_rng(folder, r.ctx.rank)

    def load(self, folder: Path) -> int:
        """(Every rank) continue from a run checkpoint (saved at any layout); returns its step."""
        extra = load_checkpoint(self.state.model, folder, optimizer=self.state.optimizer)
        if extra is None or "scheduler" not in extra:
            raise CheckpointError(f"{folder}: the trainer checkpoint has no LR scheduler state (extra.pt)")
        self.state.scheduler.load_state_dict(extra["scheduler"])
        load_rng(folder, self.rank.ctx.rank)
        return int(extra["step"])

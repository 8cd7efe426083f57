"""The learner: one trainer rank's policy model, optimizer and (with a KL penalty) frozen reference, and one RL
step on a batch. No Ray and no rollout: the loop around it (`trainer/loop.py`) brings the batches.
"""

from __future__ import annotations

import time
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.parallel.layout import layout_from_config
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.checkpoint import load_checkpoint, load_rng, save_checkpoint, save_rng
from megatron_rl.trainer.hf_weights import load_hf_into_model
from megatron_rl.trainer.model import BuildOptions, build_gpt_model
from megatron_rl.trainer.optimizer import build_training
from megatron_rl.trainer.setup import bring_up_from_hf
from megatron_rl.trainer.train_step import compute_logprobs, train_step, with_proximal_logprobs


def build_options(cfg: RunConfig) -> BuildOptions:
    """How the run's policy (and reference) model is built on every rank."""
    return BuildOptions(
        dtype=cfg.model.dtype, moe_dispatcher=cfg.trainer.moe_dispatcher, init_weights=False,
        max_sequence_length=cfg.model.max_sequence_length, moe_aux_loss_coeff=cfg.trainer.moe_aux_loss_coeff,
        recompute=cfg.trainer.recompute, logit_temperature=cfg.rollout.temperature,
    )  # fmt: skip


class Learner:
    """This rank's model, optimizer and the settings of a step."""

    def __init__(self, cfg: RunConfig):
        opts = build_options(cfg)
        self.cfg = cfg
        layout = layout_from_config(cfg.trainer.parallel)
        self.rank = bring_up_from_hf(cfg.model.hf_path, layout, opts, timeout_s=cfg.trainer.collective_timeout_s)
        self.state = build_training(self.rank.model, cfg.trainer.optimizer, cfg.steps)
        self.reference = self._reference_model(opts) if cfg.algorithm.kl_coef > 0 else None

    def _reference_model(self, opts: BuildOptions):
        """A frozen copy of the starting policy at the same layout, for the KL penalty."""
        r = self.rank
        model = build_gpt_model(r.family, r.arch, r.hf_config, r.ctx, opts)
        load_hf_into_model(model, HFCheckpoint(self.cfg.model.hf_path), r.family, r.arch, r.ctx)
        model.requires_grad_(False)
        return model

    def step(self, batch: TrainBatch) -> dict:
        """Proximal logprobs (decoupled objective), then one optimizer step."""
        mbs = self.cfg.trainer.micro_batch_size
        t0 = time.perf_counter()
        if self.cfg.algorithm.loss == "decoupled_ppo":
            batch = with_proximal_logprobs(self.state.model, self.rank.ctx, batch, mbs)
        if self.reference is not None:
            ref = compute_logprobs(self.reference, self.rank.ctx, batch.tokens, mbs)  # last stage only, like the loss
            if ref is not None:
                batch = batch.replace(ref_logprobs=ref.to(batch.behaviour_logprobs.dtype))
        stats = train_step(self.state, self.rank.ctx, batch, self.cfg.algorithm, mbs)
        stats["time/train_s"] = time.perf_counter() - t0
        return stats

    def save(self, folder: Path, step: int) -> None:
        """(Every rank) model, optimizer (layout-independent), LR scheduler and this rank's RNG into `folder`."""
        r = self.rank
        meta = {"family": r.family.name, "dtype": self.cfg.model.dtype, "layout": r.ctx.layout.describe(), "step": step}
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

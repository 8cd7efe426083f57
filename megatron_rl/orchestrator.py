"""The RL loop, run by every trainer rank under torchrun (`megatron-rl train` launches it).

Rank 0 talks to Ray (buffer, engines); every rank trains and takes part in the weight sync. Generation runs
elsewhere all the time (rollout/driver.py); the trainer only waits when the buffer has no batch ready.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import RunConfig


def train_loop(cfg: RunConfig, spec: dict) -> None:
    """Pull a batch, recompute proximal logprobs, take an optimizer step, push the new weights; repeat."""
    trainer, buffer, sync, metrics = set_up(cfg, spec)
    engines = EngineMeter(sync.engines) if trainer.rank.ctx.rank == 0 else None
    version = 0
    for step in range(1, cfg.steps + 1):
        t0 = time.perf_counter()
        groups = pull_groups(buffer, cfg, version, trainer.rank.ctx)  # waits only when the buffer is empty
        t_data = time.perf_counter() - t0
        batch = to_train_batch(groups, cfg, trainer)
        stats = trainer.step(batch)
        version = step
        sync_report = sync.push(version)
        if trainer.rank.ctx.rank == 0:
            buffer.set_trainer_version.remote(version)
            step_s = time.perf_counter() - t0
            record = collect_metrics(groups, stats, sync_report, buffer, version, t_data, step_s)
            metrics.log(step, record | engines.measure())
    finish(cfg, trainer, metrics, spec)


# ---------------------------------------------------------------------------------------------------------------
# The pieces of the loop.


class Trainer:
    """This rank's model, optimizer and the settings of a step."""

    def __init__(self, cfg: RunConfig):
        from megatron_rl.tools.train import layout_of
        from megatron_rl.trainer.model import BuildOptions
        from megatron_rl.trainer.optimizer import build_training
        from megatron_rl.trainer.setup import bring_up_from_hf

        opts = BuildOptions(
            dtype=cfg.model.dtype, moe_dispatcher=cfg.trainer.moe_dispatcher, init_weights=False,
            max_sequence_length=cfg.model.max_sequence_length, moe_aux_loss_coeff=cfg.trainer.moe_aux_loss_coeff,
            recompute=cfg.trainer.recompute,
        )  # fmt: skip
        self.cfg = cfg
        self.rank = bring_up_from_hf(cfg.model.hf_path, layout_of(cfg), opts, timeout_s=cfg.trainer.timeout_s)
        self.state = build_training(self.rank.model, cfg.trainer.optimizer, cfg.steps)
        self.reference = self._reference_model(opts) if cfg.algorithm.kl_coef > 0 else None

    def _reference_model(self, opts):
        """A frozen copy of the starting policy at the same layout, for the KL penalty."""
        from megatron_rl.models.hf_checkpoint import HFCheckpoint
        from megatron_rl.trainer.hf_weights import load_hf_into_model
        from megatron_rl.trainer.model import build_gpt_model

        r = self.rank
        model = build_gpt_model(r.family, r.arch, r.hf_config, r.ctx, opts)
        load_hf_into_model(model, HFCheckpoint(self.cfg.model.hf_path), r.family, r.arch, r.ctx)
        model.requires_grad_(False)
        return model

    def step(self, batch) -> dict:
        """Proximal logprobs (decoupled objective), then one optimizer step."""
        from megatron_rl.trainer.train_step import compute_logprobs, train_step, with_proximal_logprobs

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


def set_up(cfg: RunConfig, spec: dict):
    """Trainer, buffer handle (rank 0), weight sync with every engine, metrics logger (rank 0)."""
    import ray

    from megatron_rl.metrics import MetricsLogger
    from megatron_rl.rollout.ray_utils import join_ray
    from megatron_rl.weights.sync import EngineHandle, TrainerWeightSync

    trainer = Trainer(cfg)
    is_rank0 = trainer.rank.ctx.rank == 0
    buffer, metrics = None, None
    if is_rank0:
        join_ray(spec["ray_address"])
        buffer = ray.get_actor(spec["buffer"])
        metrics = MetricsLogger(spec["run_dir"], cfg.steps, cfg.wandb_project, config=cfg.model_dump(mode="json"))
    handles = [
        EngineHandle(name, ray.get_actor(name) if is_rank0 else None, workers) for name, workers in spec["engines"]
    ]
    sync = TrainerWeightSync(
        _WeightView(trainer), handles, cfg.sync.bucket_mb << 20, cfg.sync.timeout_s, inflight=_inflight_mode(cfg)
    )
    sync.setup()
    return trainer, buffer, sync, metrics


class _WeightView:
    """What the weight sync needs of the trainer: the GPTModel itself (not its DDP wrapper)."""

    def __init__(self, trainer: Trainer):
        from megatron_rl.trainer.optimizer import unwrap_model

        rank = trainer.rank
        self.ctx, self.family, self.arch, self.hf_config = rank.ctx, rank.family, rank.arch, rank.hf_config
        self.model = unwrap_model(trainer.state.model)


def _inflight_mode(cfg: RunConfig) -> str:
    return "keep" if cfg.sync.inflight == "pause" else "abort"


def pull_groups(buffer, cfg: RunConfig, version: int, ctx) -> list:
    """Rank 0 waits for a batch of groups; every rank receives them (as plain dicts, then rebuilt)."""
    import ray

    from megatron_rl.rollout.types import Group

    payload = [None]
    if ctx.rank == 0:
        groups = []
        deadline = time.monotonic() + cfg.trainer.timeout_s
        while not groups:
            if time.monotonic() > deadline:
                stats = ray.get(buffer.stats.remote(), timeout=60)
                raise TimeoutError(
                    f"no batch of {cfg.prompts_per_step} groups within trainer.timeout_s={cfg.trainer.timeout_s:.0f} s "
                    f"(buffer: buffered={stats.get('buffered')}, in_flight={stats.get('in_flight')}, "
                    f"dropped={stats.get('dropped_by_reason')}); is generation running?"
                )
            groups = ray.get(buffer.get_batch.remote(cfg.prompts_per_step, version, 10.0), timeout=120)
        payload = [[g.to_dict() for g in groups]]
    dist.broadcast_object_list(payload, src=0)
    return [Group.from_dict(d) for d in payload[0]]


def to_train_batch(groups: list, cfg: RunConfig, trainer: Trainer):
    """This data-parallel replica's share of the step's batch."""
    from megatron_rl.batching import groups_to_batch
    from megatron_rl.trainer.batch import data_parallel_shard

    ctx = trainer.rank.ctx
    batch = groups_to_batch(groups, cfg.algorithm.advantage, ctx.layout.tp)
    return data_parallel_shard(batch, ctx.dp_rank, ctx.layout.data_parallel)


def collect_metrics(groups, stats: dict, sync_report: dict, buffer, version: int, t_data: float, step_s: float) -> dict:
    """Everything logged for one step (rank 0)."""
    import ray

    from megatron_rl.batching import rollout_stats

    buffer_stats = ray.get(buffer.stats.remote(), timeout=60)
    tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
    return {
        **rollout_stats(groups, version - 1),
        **{k: v for k, v in stats.items() if isinstance(v, (int, float))},
        "version": version,
        "sync/seconds": sync_report["seconds"],
        "time/step_s": step_s,
        "time/data_wait_s": t_data,
        "time/trainer_idle_frac": t_data / step_s if step_s else 0.0,
        "throughput/trained_tokens_per_s": tokens / step_s if step_s else 0.0,
        "buffer/buffered": buffer_stats.get("buffered"),
        "buffer/in_flight": buffer_stats.get("in_flight"),
        "buffer/dropped": buffer_stats.get("dropped"),
        "buffer/dropped_by_reason": buffer_stats.get("dropped_by_reason"),
    }


class EngineMeter:
    """Engine idle fraction and generated tokens/s between two calls, from the engines' own counters."""

    def __init__(self, handles):
        self.handles = handles
        self.last = self._snapshot()

    def _snapshot(self) -> tuple[float, float, float]:
        import ray

        reports = ray.get([h.actor.health.remote() for h in self.handles], timeout=60)
        busy = sum(r["busy_seconds"] for r in reports)
        tokens = sum(r["generated_tokens"] for r in reports)
        return time.perf_counter(), busy, tokens

    def measure(self) -> dict:
        """Metrics since the previous call."""
        now = self._snapshot()
        wall = max(1e-9, now[0] - self.last[0])
        busy, tokens = now[1] - self.last[1], now[2] - self.last[2]
        self.last = now
        return {
            "time/engine_idle_frac": max(0.0, 1.0 - busy / (wall * len(self.handles))),
            "throughput/generated_tokens_per_s": tokens / wall,
        }


def finish(cfg: RunConfig, trainer: Trainer, metrics, spec: dict) -> None:
    """Save the final distributed checkpoint if configured; close the metrics."""
    if cfg.checkpoint.save_dir:
        from megatron_rl.trainer.checkpoint import save_checkpoint

        meta = {
            "family": trainer.rank.family.name,
            "dtype": cfg.model.dtype,
            "layout": trainer.rank.ctx.layout.describe(),
            "step": cfg.steps,
        }
        save_checkpoint(
            _WeightView(trainer).model, trainer.rank.ctx, cfg.checkpoint.save_dir, meta, hf_dir=cfg.model.hf_path
        )
    if metrics is not None:
        metrics.close()


def main(spec_path: str) -> None:
    """Entry point of each torchrun process."""
    from megatron_rl.parallel.groups import destroy_distributed

    spec = json.loads(Path(spec_path).read_text())
    cfg = RunConfig.model_validate(spec["config"])
    if cfg.trainer.cpu_affinity:
        os.sched_setaffinity(0, set(cfg.trainer.cpu_affinity))
    train_loop(cfg, spec)
    destroy_distributed()


if __name__ == "__main__":
    main(sys.argv[1])

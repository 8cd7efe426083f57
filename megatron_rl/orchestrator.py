"""The RL loop, run by every trainer rank under torchrun (`megatron-rl train` launches it).

Rank 0 talks to Ray (buffer, engines); every rank trains and takes part in the weight sync. Generation runs
elsewhere all the time (rollout/driver.py); the trainer only waits when the buffer has no batch ready.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.recovery import RecoveringSync
from megatron_rl.run_state import ResumeError, is_due, load_rng, mark_latest, save_rng, step_dir, write_run_state

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_MARGIN_S = 120.0
"""Added to trainer.timeout_s for the trainer's process groups. The other ranks wait for rank 0's batch in a
broadcast while rank 0 waits up to trainer.timeout_s for the buffer (after its own per-step work), so rank 0's
deadline, and its error that says why, must come before the broadcast's."""


class BatchWaitError(RuntimeError):
    """(Ranks other than 0) rank 0 stopped waiting for a batch; the message is rank 0's error."""


def collective_timeout_s(cfg: RunConfig) -> float:
    """The timeout of the trainer's collectives: trainer.timeout_s plus `COLLECTIVE_TIMEOUT_MARGIN_S`."""
    return cfg.trainer.timeout_s + COLLECTIVE_TIMEOUT_MARGIN_S


def train_loop(cfg: RunConfig, spec: dict) -> None:
    """Pull a batch, recompute proximal logprobs, take an optimizer step, push the new weights; repeat."""
    run = Run(cfg, spec)
    for step in range(run.step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        groups = run.next_batch()  # waits only when the buffer is empty; follows engine restarts
        if groups is None:  # task.epochs used up: no batch can be formed any more
            run.end_out_of_prompts()
            break
        t_data = time.perf_counter() - t0
        stats = run.trainer.step(to_train_batch(groups, cfg, run.trainer))
        if cfg.checkpoint.save_dir and is_due(step, cfg.checkpoint.save_interval, cfg.steps):
            run.save_checkpoint(step)  # before the engines see version `step`: see run_state.py
        sync_report = run.sync.push(step)
        run.finish_step(step, groups, stats, sync_report, t_data, time.perf_counter() - t0)
    run.close()


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
            recompute=cfg.trainer.recompute, logit_temperature=cfg.rollout.temperature,
        )  # fmt: skip
        self.cfg = cfg
        self.rank = bring_up_from_hf(cfg.model.hf_path, layout_of(cfg), opts, timeout_s=collective_timeout_s(cfg))
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

    def save(self, folder: Path, step: int) -> None:
        """(Every rank) model, optimizer (layout-independent), LR scheduler and this rank's RNG into `folder`."""
        from megatron_rl.trainer.checkpoint import save_checkpoint

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
        from megatron_rl.trainer.checkpoint import load_checkpoint

        extra = load_checkpoint(self.state.model, folder, optimizer=self.state.optimizer)
        if extra is None or "scheduler" not in extra:
            raise ResumeError(f"{folder}: the trainer checkpoint has no LR scheduler state (extra.pt)")
        self.state.scheduler.load_state_dict(extra["scheduler"])
        load_rng(folder, self.rank.ctx.rank)
        return int(extra["step"])


class Run:
    """One trainer rank's view of the run: trainer, weight sync, and (rank 0) buffer, run control and metrics."""

    def __init__(self, cfg: RunConfig, spec: dict):
        import ray

        from megatron_rl.metrics import MetricsLogger
        from megatron_rl.rollout.ray_utils import join_ray
        from megatron_rl.weights.sync import TrainerWeightSync, engine_handles, ray_get_named

        self.cfg, self.spec = cfg, spec
        self.trainer = Trainer(cfg)
        self.is_rank0 = self.trainer.rank.ctx.rank == 0
        self.buffer = self.control = self.metrics = self.meter = None
        if self.is_rank0:
            join_ray(spec["ray_address"])
            self.buffer = ray.get_actor(spec["buffer"])
            self.control = ray.get_actor(spec["control"])
        resume = spec.get("resume_from")
        self.step = self.trainer.load(Path(resume)) if resume else 0
        self.saved_step = self.step  # the last step with a checkpoint in save_dir (a resumed one is there)
        self.end_message = ""
        handles = engine_handles(spec["engines"], self.is_rank0)
        if self.is_rank0:  # the launcher starts the engines while the trainer loads
            ready = {h.name: h.actor.ready.remote(cfg.sync.timeout_s) for h in handles}
            ray_get_named(ready, cfg.sync.timeout_s + 30, "waiting for the engines to start")
        sync = TrainerWeightSync(
            _WeightView(self.trainer), handles, cfg.sync.bucket_mb << 20, cfg.sync.timeout_s,
            host=cfg.sync.bind_host, inflight=_inflight_mode(cfg), streams=cfg.sync.gloo_streams,
        )  # fmt: skip
        sync.setup()
        self.sync = RecoveringSync(sync, self.control, cfg.sync.timeout_s)
        if self.step:  # the engines start from the HF weights: bring them to the resumed ones
            self.sync.push(self.step)
        if self.is_rank0:
            self.buffer.set_trainer_version.remote(self.step)
            self.metrics = MetricsLogger(
                spec["run_dir"], cfg.steps, cfg.wandb_project, config=cfg.model_dump(mode="json")
            )
            self.meter = EngineMeter(lambda: self.sync.sync.engines)
            self._report("running")

    def _report(self, state: str, message: str = "") -> None:
        import ray

        ray.get(self.control.report_trainer.remote(state, self.step, message), timeout=60)

    def next_batch(self) -> list | None:
        """The step's groups on every rank (sorted by prompt index, so a batch's order does not depend on timing),
        or None on every rank when the prompt stream is used up (task.epochs) and no batch can be formed any more.

        Rank 0 waits for the buffer; when the launcher restarted an engine meanwhile, every rank re-forms the
        weight groups and brings it to the current weights first (in sync mode nothing else would). When rank 0
        gives up (no batch within trainer.timeout_s, or a failed call), it raises its error and every other rank
        raises BatchWaitError with the same message.
        """
        from megatron_rl.rollout.types import Group

        while True:
            payload = [self._rank0_payload() if self.is_rank0 else None]
            dist.broadcast_object_list(payload, src=0)
            kind, data = payload[0]
            if kind == "groups":
                return sorted((Group.from_dict(d) for d in data), key=lambda g: g.prompt_index)
            if kind == "exhausted":
                return None
            if kind == "error":  # never on rank 0: it raised its own error already
                raise BatchWaitError(f"rank 0 stopped waiting for a batch: {data}")
            self.sync.resync(data, self.step)

    def _rank0_payload(self) -> tuple[str, object]:
        """What rank 0 broadcasts: its batch, a new roster, the end of the prompts; on an error, an error marker
        (then it raises), so the other ranks stop with rank 0's message instead of a broadcast timeout."""
        try:
            return self._wait_for_batch()
        except Exception as err:
            _tell_other_ranks(err)
            raise

    def _wait_for_batch(self) -> tuple[str, object]:
        import ray

        cfg = self.cfg
        deadline = time.monotonic() + cfg.trainer.timeout_s
        while time.monotonic() < deadline:
            roster = self.sync.roster_changed()
            if roster is not None:
                return "roster", roster
            groups = self._take_batch(2.0)
            if groups:
                return "groups", [g.to_dict() for g in groups]
            if self._prompts_finished():  # no group can arrive any more; the last one may have come meanwhile
                groups = self._take_batch(0.0)
                return ("groups", [g.to_dict() for g in groups]) if groups else ("exhausted", None)
            self._report("running")  # the launcher's watchdog: waiting for data is not being dead
        stats = ray.get(self.buffer.stats.remote(), timeout=60)
        raise TimeoutError(
            f"no batch of {cfg.prompts_per_step} groups within trainer.timeout_s={cfg.trainer.timeout_s:.0f} s "
            f"(buffer: buffered={stats.get('buffered')}, in_flight={stats.get('in_flight')}, "
            f"dropped={stats.get('dropped_by_reason')}); is generation running?"
        )

    def _take_batch(self, timeout_s: float) -> list:
        import ray

        return ray.get(self.buffer.get_batch.remote(self.cfg.prompts_per_step, self.step, timeout_s), timeout=120)

    def _prompts_finished(self) -> bool:
        """Whether the buffer says no group can arrive any more (prompt stream exhausted, nothing in flight)."""
        import ray

        return bool(ray.get(self.buffer.stats.remote(), timeout=60)["finished"])

    def end_out_of_prompts(self) -> None:
        """(Every rank) the prompt stream is used up (task.epochs) and no batch can be formed: checkpoint the last
        step when saving is configured (unless it is saved already), and let the run end normally."""
        cfg = self.cfg
        if cfg.checkpoint.save_dir and self.step > self.saved_step:
            self.save_checkpoint(self.step)
        self.end_message = f"prompt stream exhausted after step {self.step} (task.epochs={cfg.task.epochs})"
        if self.is_rank0:
            log.warning("%s: the run ends before steps=%d", self.end_message, cfg.steps)

    def save_checkpoint(self, step: int) -> None:
        """(Every rank) the whole-run checkpoint of `step`: trainer state, RNG, buffer contents and data position."""
        import ray

        folder = step_dir(self.cfg.checkpoint.save_dir, step)
        self.trainer.save(folder, step)
        if self.is_rank0:
            write_run_state(folder, step, ray.get(self.buffer.state_dict.remote(), timeout=120))
        dist.barrier()
        if self.is_rank0:
            mark_latest(self.cfg.checkpoint.save_dir, folder)
        self.saved_step = step

    def finish_step(self, step: int, groups, stats: dict, sync_report: dict, t_data: float, step_s: float) -> None:
        """The new version is out: tell the buffer and run control, log the step's metrics (rank 0)."""
        self.step = step
        if not self.is_rank0:
            return
        self.buffer.set_trainer_version.remote(step)
        self._report("running")
        record = collect_metrics(groups, stats, sync_report, self.buffer, step, t_data, step_s)
        record["sync/resyncs"] = self.sync.resyncs
        self.metrics.log(step, record | self.meter.measure())

    def close(self) -> None:
        """Report the end of training (and why it came early, if it did) and close the metrics."""
        if self.is_rank0:
            self._report("done", self.end_message)
            self.metrics.close()


class _WeightView:
    """What the weight sync needs of the trainer: the GPTModel itself (not its DDP wrapper)."""

    def __init__(self, trainer: Trainer):
        from megatron_rl.trainer.optimizer import unwrap_model

        rank = trainer.rank
        self.ctx, self.family, self.arch, self.hf_config = rank.ctx, rank.family, rank.arch, rank.hf_config
        self.model = unwrap_model(trainer.state.model)


def _tell_other_ranks(err: BaseException) -> None:
    """(Rank 0) broadcast an error marker in place of the batch; best effort (rank 0's own error matters most)."""
    try:
        dist.broadcast_object_list([("error", f"{type(err).__name__}: {err}")], src=0)
    except Exception as broadcast_err:
        log.warning("could not tell the other ranks why rank 0 stops: %s", broadcast_err)


def _inflight_mode(cfg: RunConfig) -> str:
    return "keep" if cfg.sync.inflight == "pause" else "abort"


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
    """Engine idle fraction and generated tokens/s between two calls, from the engines' own counters.

    An engine that does not answer (dead, being restarted) is left out; a restarted one's counters start at 0.
    """

    def __init__(self, handles: Callable[[], list]):
        self.handles = handles
        self.last_time, self.last = time.perf_counter(), self._snapshot()

    def _snapshot(self) -> dict[str, tuple[float, float]]:
        import ray

        counters = {}
        for handle in self.handles():
            try:
                report = ray.get(handle.actor.health.remote(), timeout=10)
            except Exception:  # a dead engine: the supervisor restarts it; metrics go on without it
                continue
            counters[handle.name] = (report["busy_seconds"], report["generated_tokens"])
        return counters

    def measure(self) -> dict:
        """Metrics since the previous call."""
        now_time, now = time.perf_counter(), self._snapshot()
        wall = max(1e-9, now_time - self.last_time)
        busy = tokens = 0.0
        for name, (b, t) in now.items():
            b0, t0 = self.last.get(name, (0.0, 0.0))
            restarted = b < b0 or t < t0
            busy += b if restarted else b - b0
            tokens += t if restarted else t - t0
        self.last_time, self.last = now_time, now
        return {
            "time/engine_idle_frac": max(0.0, 1.0 - busy / (wall * max(1, len(now)))),
            "throughput/generated_tokens_per_s": tokens / wall,
            "engines/answering": len(now),
        }


def main(spec_path: str) -> None:
    """Entry point of each torchrun process (launched by `megatron-rl train`, or by hand/SLURM with
    `--external-trainer`, in which case the spec file may not exist yet)."""
    from megatron_rl.parallel.groups import destroy_distributed

    spec = json.loads(wait_for_file(Path(spec_path), float(os.environ.get("MRL_SPEC_WAIT_S", "900"))).read_text())
    cfg = RunConfig.model_validate(spec["config"])
    if cfg.trainer.cpu_affinity:
        os.sched_setaffinity(0, set(cfg.trainer.cpu_affinity))
    try:
        train_loop(cfg, spec)
    except BaseException as err:
        report_failure(spec, err)
        raise
    destroy_distributed()


def report_failure(spec: dict, err: BaseException) -> None:
    """(Rank 0) tell the launcher why the trainer stops, so it need not wait out its watchdog; best effort."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        import ray

        from megatron_rl.rollout.ray_utils import join_ray

        join_ray(spec["ray_address"])
        message = f"rank 0: {type(err).__name__}: {str(err).splitlines()[0][:500] if str(err) else ''}"
        ray.get(ray.get_actor(spec["control"]).report_failure.remote(message), timeout=30)
    except Exception:  # noqa: S110 (the original error is what matters; it is re-raised)
        pass


def wait_for_file(path: Path, timeout_s: float) -> Path:
    """`path` once it exists (the launcher writes the spec after Ray and the engines are up)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(
                f"{path}: the trainer spec did not appear within {timeout_s:.0f} s (MRL_SPEC_WAIT_S)"
            )
        time.sleep(0.5)
    return path


if __name__ == "__main__":
    main(sys.argv[1])

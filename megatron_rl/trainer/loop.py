"""The trainer ranks' process: the RL loop that every torchrun rank runs (`megatron-rl train` launches it).

Rank 0 talks to Ray (buffer, run control, engines); every rank trains (`trainer/learner.py`) and takes part in
the weight sync. Generation runs elsewhere all the time (`rollout/driver.py`, in the launcher); the trainer only
waits when the buffer has no batch ready.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from megatron_rl.config import RunConfig
from megatron_rl.config.trainer import CheckpointConfig
from megatron_rl.metrics.background import BackgroundReporter
from megatron_rl.metrics.evals import EvalInbox
from megatron_rl.metrics.logger import EVAL_RECORD, MetricsLogger
from megatron_rl.metrics.step import EngineMeter, ZeroVarianceShare, collect_metrics
from megatron_rl.models.base import CheckpointError
from megatron_rl.parallel.groups import destroy_distributed
from megatron_rl.parallel.processes import enable_stack_dumps
from megatron_rl.parallel.scheduling import place_process
from megatron_rl.rollout.control import TrainerHeartbeat
from megatron_rl.rollout.ray_utils import join_ray
from megatron_rl.rollout.types import Group
from megatron_rl.run_state import attempt, continue_from, is_due, other_checkpoints, save_run_checkpoint
from megatron_rl.trainer.batch import TrainBatch, groups_to_batch, replica_share
from megatron_rl.trainer.checkpoint import CorruptCheckpointError, agree
from megatron_rl.trainer.learner import Learner
from megatron_rl.trainer.optimizer import unwrap_model
from megatron_rl.weights.export import export_hf_folder
from megatron_rl.weights.lora_sync import merge_scale
from megatron_rl.weights.peft_export import PEFT_EXPORT_DIR, export_lora_adapter
from megatron_rl.weights.recovery import RecoveringSync
from megatron_rl.weights.snapshot import SnapshotTeachers
from megatron_rl.weights.sync import TrainerWeightSync, engine_handles, ray_get_named

log = logging.getLogger(__name__)

FINAL_EXPORT_DIR = "hf"
"""The run folder's Hugging Face export of the final policy (`checkpoint.export_final`)."""
CHECKPOINT_EXPORT_DIR = "huggingface"
"""A whole-run checkpoint's Hugging Face export of its policy (`checkpoint.export_hf`)."""


class BatchWaitError(RuntimeError):
    """(Ranks other than 0) rank 0 stopped waiting for a batch; the message is rank 0's error."""


def run_loop(cfg: RunConfig, spec: dict) -> None:
    """Pull a batch, take its updates (proximal logprobs, mini-batches), push the new weights; repeat."""
    loop = TrainerLoop(cfg, spec)
    for step in range(loop.step + 1, cfg.steps + 1):
        t0 = time.perf_counter()
        groups = loop.next_batch()  # waits only when the buffer is empty; follows engine restarts
        if groups is None:  # task.epochs used up: no batch can be formed any more
            loop.end_out_of_prompts()
            break
        t_data = time.perf_counter() - t0
        loop.heartbeat.phase(loop.step, f"training step {step}")
        stats = loop.learner.step(to_train_batch(groups, cfg, loop.learner), version=step - 1)  # weights of step - 1
        if cfg.checkpoint.save_dir and is_due(step, cfg.checkpoint.save_interval, cfg.steps):
            loop.save_checkpoint(step, last=step == cfg.steps)  # before the engines see version `step`: run_state.py
        sync_report = loop.push(step)
        loop.finish_step(step, groups, stats, sync_report, t_data, time.perf_counter() - t0)
    if cfg.checkpoint.export_final:
        loop.export_hf(Path(spec["run_dir"]) / FINAL_EXPORT_DIR, loop.step)
    loop.close()


class TrainerLoop:
    """One trainer rank's view of the run: learner, weight sync, and (rank 0) buffer, run control and metrics."""

    def __init__(self, cfg: RunConfig, spec: dict):

        self.cfg, self.spec = cfg, spec
        self.is_rank0 = os.environ.get("RANK", "0") == "0"  # before the Learner: rank 0 reports its start-up
        self.metrics = self.meter = self.zero_variance = None
        rank0 = connect_rank0(spec, cfg.stall_timeout_s) if self.is_rank0 else (None, None, None)
        self.buffer, self.control, self.heartbeat = rank0
        self.heartbeat = self.heartbeat or TrainerHeartbeat(None)  # the other ranks: reports nothing
        self.learner = Learner(cfg)
        resume = spec.get("resume_from")
        self.step = load_resumed(self.learner, cfg.checkpoint, Path(resume), self.is_rank0) if resume else 0
        self.saved_step = self.step  # the last step with a checkpoint in save_dir (a resumed one is there)
        self.end_message = ""
        self.heartbeat.phase(self.step, "connecting to the engines", state="starting")
        sync = engine_sync(cfg, self.learner, spec["engines"], self.is_rank0, _inflight_mode(cfg), "engines")
        sync.setup()
        # As long as the launcher may take to find a hung engine and restart it.
        restart_wait_s = cfg.rollout.hang_timeout_s + cfg.rollout.restart_timeout_s
        self.sync = RecoveringSync(sync, self.control, restart_wait_s, on_phase=self._phase)
        self.lagged = LaggedWeights(unwrap_model(self.learner.state.model), cfg.algorithm.forced_lag)
        self.heartbeat.phase(self.step, "connecting to the teacher engines", state="starting")
        self.teachers = snapshot_teachers(cfg, spec, self.learner, self.is_rank0)
        if self.step:  # the engines start from the HF weights: bring them to the resumed ones
            self.heartbeat.phase(self.step, "bringing the engines to the resumed weights", state="starting")
            self.sync.push(self.step)
            if self.teachers is not None:  # and the teachers to them: their snapshot went with the old run
                self.teachers.refresh({"reform": False}, self.step)
        if self.is_rank0:
            ray.get(self.buffer.configure_admission.remote(**admission(cfg)), timeout=60)
            self.buffer.set_trainer_version.remote(self.step)
            self.metrics = MetricsLogger(
                spec["run_dir"], cfg.steps, cfg.wandb_project, config=cfg.model_dump(mode="json")
            )
            self.meter = EngineMeter(lambda: self.sync.sync.engines)
            self.teacher_meter = EngineMeter(lambda: named_handles(spec.get("teachers", [])), TEACHER_METER_KEYS)
            self.evals = EvalInbox(spec["run_dir"])
            self.zero_variance = ZeroVarianceShare()
            self.reporter = BackgroundReporter()

    def _phase(self, what: str) -> None:
        """(Rank 0) the heartbeat's phase is now `what` (the state it had: starting or running)."""
        self.heartbeat.phase(self.step, what, self.heartbeat.state)

    def next_batch(self) -> list | None:
        """The step's groups on every rank (sorted by prompt index, so a batch's order does not depend on timing),
        or None on every rank when the prompt stream is used up (task.epochs) and no batch can be formed any more.

        Rank 0 waits for the buffer; when the launcher restarted an engine meanwhile, every rank re-forms the
        weight groups and brings it to the current weights first (in sync mode nothing else would). When rank 0
        gives up (no batch within trainer.timeout_s, or a failed call), it raises its error and every other rank
        raises BatchWaitError with the same message.
        """
        while True:
            self.heartbeat.phase(self.step, f"waiting for the batch of step {self.step + 1}")
            payload = [self._rank0_payload() if self.is_rank0 else None]
            dist.broadcast_object_list(payload, src=0)
            kind, data = payload[0]
            if kind == "groups":
                return sorted(data, key=lambda g: g.prompt_index)
            if kind == "exhausted":
                return None
            if kind == "error":  # never on rank 0: it raised its own error already
                raise BatchWaitError(f"rank 0 stopped waiting for a batch: {data}")
            if kind == "teachers":  # a snapshot teacher was restarted: it waits for its weights
                self.heartbeat.phase(self.step, "refreshing the teacher engines' weights")
                self.teachers.refresh(data, self.step)
                continue
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
        cfg = self.cfg
        deadline = time.monotonic() + cfg.trainer.timeout_s
        while time.monotonic() < deadline:
            roster = self.sync.roster_changed()
            if roster is not None:
                return "roster", roster
            plan = self.teachers.plan(self.step, due=False) if self.teachers is not None else None
            if plan is not None:
                return "teachers", plan
            groups = self._take_batch(2.0)
            if groups:
                return "groups", groups  # pickled as they are: 10x cheaper than through to_dict/from_dict
            if self._prompts_finished():  # no group can arrive any more; the last one may have come meanwhile
                groups = self._take_batch(0.0)
                return ("groups", groups) if groups else ("exhausted", None)
        stats = ray.get(self.buffer.stats.remote(), timeout=60)
        raise TimeoutError(
            f"no batch of {cfg.prompts_per_step} groups within trainer.timeout_s={cfg.trainer.timeout_s:.0f} s "
            f"(buffer: buffered={stats.get('buffered')}, in_flight={stats.get('in_flight')}, "
            f"dropped={stats.get('dropped_by_reason')}); is generation running?"
        )

    def _take_batch(self, timeout_s: float) -> list:
        return ray.get(self.buffer.get_batch.remote(self.cfg.prompts_per_step, self.step, timeout_s), timeout=120)

    def _prompts_finished(self) -> bool:
        """Whether the buffer says no group can arrive any more (prompt stream exhausted, nothing in flight)."""
        return bool(ray.get(self.buffer.stats.remote(), timeout=60)["finished"])

    def end_out_of_prompts(self) -> None:
        """(Every rank) the prompt stream is used up (task.epochs) and no batch can be formed: checkpoint the last
        step when saving is configured (unless it is saved already), and let the run end normally."""
        cfg = self.cfg
        if cfg.checkpoint.save_dir and self.step > self.saved_step:
            self.save_checkpoint(self.step, last=True)
        self.end_message = f"prompt stream exhausted after step {self.step} (task.epochs={cfg.task.epochs})"
        if self.is_rank0:
            log.warning("%s: the run ends before steps=%d", self.end_message, cfg.steps)

    def save_checkpoint(self, step: int, last: bool = False) -> None:
        """(Every rank) the whole-run checkpoint of `step`: trainer state, RNG, buffer contents and data position,
        staged and committed by `run_state.save_run_checkpoint` (a failed save leaves the previous one in charge);
        with `checkpoint.export_hf`, the policy as a Hugging Face folder inside it too. When the `last` save of
        the run fails, the final export (`checkpoint.export_final`) is still written before its error is raised:
        the run's result does not go with the save."""
        ckpt = self.cfg.checkpoint
        buffer_state = (lambda: ray.get(self.buffer.state_dict.remote(), timeout=120)) if self.is_rank0 else None
        export = (lambda folder: self._export(folder / CHECKPOINT_EXPORT_DIR, step)) if ckpt.export_hf else None
        self.heartbeat.phase(self.step, f"saving the checkpoint of step {step}")
        # It would become `latest`, and older ones are pruned: a resume (or a Slurm requeue) would load it.
        self.learner.check_weights(step, doing="saving them as a checkpoint")
        try:
            save_run_checkpoint(
                ckpt.save_dir, step, ckpt.keep_last, lambda folder: self.learner.save(folder, step), buffer_state,
                write_more=export,
            )  # fmt: skip
        except CheckpointError:  # the same error on every rank (the ranks agree), so all of them export
            if last and ckpt.export_final:
                self._export_after_failed_save(step)
            raise
        self.saved_step = step

    def _export_after_failed_save(self, step: int) -> None:
        folder = Path(self.spec["run_dir"]) / FINAL_EXPORT_DIR
        try:
            self.export_hf(folder, step)
        except Exception as err:  # the save's error is the one to raise
            log.error("the final export to %s failed too: %s: %s", folder, type(err).__name__, err)
        else:
            if self.is_rank0:
                log.warning("the last checkpoint failed, but the final policy is exported to %s", folder)

    def export_hf(self, folder: Path, step: int) -> None:
        """(Every rank) the current policy (that of `step`) as a Hugging Face checkpoint folder (weights/export.py),
        in the dtypes of `model.hf_path`, replacing an earlier export there only once the new one is whole."""
        self.heartbeat.phase(self.step, f"exporting the policy of step {step}")
        self._export(folder, step)

    def _export(self, folder: Path, step: int) -> None:
        rank, start = self.learner.rank, time.perf_counter()
        model = unwrap_model(self.learner.state.model)
        nbytes = export_hf_folder(model, rank.family, rank.arch, rank.ctx, folder, self.cfg.model.hf_path)
        if self.cfg.lora.enabled:  # the merged model above; the adapters alone beside it, for peft
            export_lora_adapter(model, rank, self.cfg, folder.parent / PEFT_EXPORT_DIR)
        if self.is_rank0:
            log.info("exported the policy of step %d to %s (%.1f MB, %.1f s)", step, folder, nbytes / 2**20,
                     time.perf_counter() - start)  # fmt: skip

    def push(self, step: int) -> dict:
        """(Every rank) send the weights of version `step` to the engines, after checking they are finite (a
        skipped update leaves them as they were). With `algorithm.forced_lag` k the engines get version
        `step - k` instead, and nothing while that is the start version they already hold."""
        self.heartbeat.phase(self.step, f"pushing the weights of step {step}")
        self.learner.check_weights(step)
        report = self._push(step)
        if self.teachers is not None:
            self.heartbeat.phase(self.step, f"refreshing the teacher engines after step {step}")
            report["teachers"] = self.teachers.after_step(step)
        return report

    def _push(self, step: int) -> dict:
        if not self.lagged.lag:
            return self.sync.push(step)
        self.lagged.record(step)
        version = step - self.lagged.lag
        if version <= 0:
            return {"version": 0, "seconds": 0.0, "forced_lag": self.lagged.lag}
        with self.lagged.swapped_in(version):
            return self.sync.push(version) | {"forced_lag": self.lagged.lag}

    def finish_step(self, step: int, groups, stats: dict, sync_report: dict, t_data: float, step_s: float) -> None:
        """The new version is out: tell the buffer (now: it admits the next prompts by it), then log the step's
        metrics in the background (rank 0; `metrics/background.py`)."""
        self.step = step
        if not self.is_rank0:
            return
        self.heartbeat.phase(step, f"reporting step {step}")
        self.buffer.set_trainer_version.remote(step)
        ended = time.perf_counter()
        self.reporter.submit(lambda: self._log_step(step, groups, stats, sync_report, t_data, step_s, ended))

    def _log_step(self, step: int, groups, stats: dict, sync_report: dict, t_data: float, step_s: float, ended):
        """(Rank 0, the reporter's thread) the metrics record of `step`, which ended at `ended`."""
        record = collect_metrics(groups, stats, sync_report, self.buffer, step, t_data, step_s, self.zero_variance)
        record["sync/resyncs"] = self.sync.resyncs
        evaluating, later = self.cfg.eval.interval > 0, []
        if evaluating and step == self.cfg.steps:  # the launcher evaluates the last version: its record waits
            first, *later = self.evals.drain_until(step, self.cfg.eval.timeout_s)
            record |= first
        elif evaluating:
            record |= self.evals.take()
        record |= sync_report.get("teachers", {}) | (self.teacher_meter.measure() if self.spec.get("teachers") else {})
        self.metrics.log(step, record | self.meter.measure(), at=ended)
        for result in later:  # results that came after the previous step's record: records of their own
            self.metrics.log(step, result, kind=EVAL_RECORD)

    def close(self) -> None:
        """Finish the last step's report, report the end of training (and why it came early, if it did) and close
        the metrics."""
        if self.is_rank0:
            self.heartbeat.phase(self.step, f"reporting step {self.step}")
            self.reporter.close()
            self.metrics.close()
            self.heartbeat.stop("done", self.end_message)


def connect_rank0(spec: dict, stall_s: float | None = None) -> tuple:
    """(Rank 0) join the run's Ray cluster, find its buffer and run control, and start the heartbeat, which beats
    for the trainer's whole life (first: building the model, which may take long) and writes the process's stacks
    to stderr as a phase nears `stall_s`; (buffer, control, heartbeat)."""
    join_ray(spec["ray_address"])
    control = ray.get_actor(spec["control"])
    heartbeat = TrainerHeartbeat(control, stall_s=stall_s)
    heartbeat.phase(0, "building the model and loading its weights", state="starting")
    return ray.get_actor(spec["buffer"]), control, heartbeat.start()


def load_resumed(learner: Learner, ckpt: CheckpointConfig, folder: Path, is_rank0: bool) -> int:
    """Load the checkpoint a resume continues from into `learner`, then (once every rank has) rank 0 makes it the
    run's `latest` and moves the step folders after it aside (`run_state.continue_from`); its step. A file of it
    that fails its checksum raises a CorruptCheckpointError that also names the run's other checkpoints."""
    try:
        step = learner.load(folder)
    except CorruptCheckpointError as err:
        raise CorruptCheckpointError(f"{err}; {other_checkpoints(ckpt.save_dir, folder)}") from None
    agree(None)  # every rank has loaded it: nothing a rank still reads is moved below
    rewind = ckpt.resume_step == step  # the launcher honoured checkpoint.resume_step
    agree(attempt(lambda: continue_from(ckpt.save_dir, folder, rewind)) if is_rank0 else None)
    return step


def admission(cfg: RunConfig) -> dict:
    """What the buffer must screen groups for (`RolloutBuffer.configure_admission`), from the algorithm section."""
    a = cfg.algorithm
    return {
        "drop_zero_variance": a.dynamic_sampling,
        "max_zero_variance_drops": a.dynamic_sampling_max_drops,
        "max_abs_reward": a.max_abs_reward,
    }


class LaggedWeights:
    """`algorithm.forced_lag` (benchmarks): copies of the weights of the last `lag` versions, swapped into the model
    while an old version is pushed, so that the engines always generate exactly `lag` versions behind."""

    def __init__(self, model, lag: int):
        self.model, self.lag = model, lag
        self.history: dict[int, list[torch.Tensor]] = {}

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.model.parameters(), *self.model.buffers()) if t.is_floating_point()]

    def record(self, version: int) -> None:
        """Keep a copy of the current weights as `version`; versions older than the lag window are let go."""
        self.history[version] = [t.detach().clone() for t in self._tensors()]
        for old in [v for v in self.history if v <= version - self.lag - 1]:
            del self.history[old]

    @contextlib.contextmanager
    def swapped_in(self, version: int):
        """The model holds the weights of `version` inside the block and its own ones again after it."""
        current = [t.detach().clone() for t in self._tensors()]
        with torch.no_grad():
            for tensor, saved in zip(self._tensors(), self.history[version], strict=True):
                tensor.copy_(saved)
        try:
            yield
        finally:
            with torch.no_grad():
                for tensor, mine in zip(self._tensors(), current, strict=True):
                    tensor.copy_(mine)


class _WeightView:
    """What the weight sync needs of the learner: the GPTModel itself (not its DDP wrapper)."""

    def __init__(self, learner: Learner):
        rank = learner.rank
        self.ctx, self.family, self.arch, self.hf_config = rank.ctx, rank.family, rank.arch, rank.hf_config
        self.model = unwrap_model(learner.state.model)


TEACHER_METER_KEYS = ("distill/teacher_idle_frac", None, "distill/teachers_answering")
"""The teacher engines' `EngineMeter` metrics (they generate no tokens)."""


def engine_sync(cfg: RunConfig, learner: Learner, engines: list, is_rank0: bool, inflight: str, what: str):
    """(Every rank) a `TrainerWeightSync` to the named engines `[(name, workers), ...]` once rank 0 saw them start
    (the launcher starts them while the trainer loads); with LoRA only the adapters travel (the engines hold W0)."""
    handles = engine_handles(engines, is_rank0)
    if is_rank0:
        ready = {h.name: h.actor.ready.remote(cfg.sync.timeout_s) for h in handles}
        ray_get_named(ready, cfg.sync.timeout_s + 30, f"waiting for the {what} to start")
    return TrainerWeightSync(
        _WeightView(learner), handles, cfg.sync.bucket_mb << 20, cfg.sync.timeout_s, host=cfg.sync.bind_host,
        inflight=inflight, streams=cfg.sync.gloo_streams, lora_scale=merge_scale(cfg.lora),
    )  # fmt: skip


def snapshot_teachers(cfg: RunConfig, spec: dict, learner: Learner, is_rank0: bool) -> SnapshotTeachers | None:
    """(Every rank) the snapshot teachers' weight sync, formed (`distill.teacher: snapshot`); else None."""
    if cfg.distill.teacher != "snapshot":
        return None
    sync = engine_sync(cfg, learner, spec["teachers"], is_rank0, "keep", "teacher engines")
    teachers = SnapshotTeachers(sync, cfg.distill.refresh_every, max_failures=cfg.rollout.max_engine_restarts + 1)
    teachers.setup()
    return teachers


def named_handles(engines: list) -> list:
    """(Rank 0) handles of the named engines that exist now (one being restarted is left out)."""
    handles = []
    for name, workers in engines:
        with contextlib.suppress(ValueError):
            handles.extend(engine_handles([(name, workers)], True))
    return handles


def _tell_other_ranks(err: BaseException) -> None:
    """(Rank 0) broadcast an error marker in place of the batch; best effort (rank 0's own error matters most)."""
    try:
        dist.broadcast_object_list([("error", f"{type(err).__name__}: {err}")], src=0)
    except Exception as broadcast_err:
        log.warning("could not tell the other ranks why rank 0 stops: %s", broadcast_err)


def _inflight_mode(cfg: RunConfig) -> str:
    return "keep" if cfg.sync.inflight == "pause" else "abort"


def to_train_batch(groups: list[Group], cfg: RunConfig, learner: Learner) -> TrainBatch:
    """This data-parallel replica's share of the step's batch."""
    ctx = learner.rank.ctx
    batch = groups_to_batch(groups, cfg.algorithm.advantage, ctx.layout.tp)
    return replica_share(batch, ctx.dp_rank, ctx.layout.data_parallel, cfg.algorithm.ppo_minibatches)


def main(spec_path: str) -> None:
    """Entry point of each torchrun process (launched by `megatron-rl train`, or by hand/SLURM with
    `--external-trainer`, in which case the spec file may not exist yet)."""
    enable_stack_dumps()  # `kill -USR1` writes where every thread is; the launcher does it before killing a lost job
    spec = json.loads(wait_for_file(Path(spec_path), float(os.environ.get("MRL_SPEC_WAIT_S", "900"))).read_text())
    cfg = RunConfig.model_validate(spec["config"])
    place_process(
        cfg.trainer.cpu_affinity,
        cfg.trainer.cpu_batch_scheduling and not torch.cuda.is_available(),
        "trainer.cpu_affinity",
    )
    try:
        run_loop(cfg, spec)
    except BaseException as err:
        report_failure(spec, err)
        raise
    destroy_distributed()


def report_failure(spec: dict, err: BaseException) -> None:
    """(Rank 0) tell the launcher why the trainer stops, so it need not wait out its watchdog; best effort."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
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

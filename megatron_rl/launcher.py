"""The launcher: the process of `megatron-rl train CONFIG` that runs the rollout side and starts the trainer.

It starts (or joins) Ray, the rollout buffer and run-control actors and the vLLM engine pool, launches the
Megatron trainer under torchrun (every rank runs `trainer/loop.py`), and runs the generation driver and the
engine supervisor here until the trainer finishes. At the end it checks the buffer's accounting, and writes the
reward curve and a summary.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from pathlib import Path

import ray

from megatron_rl.config import RunConfig, dump_config
from megatron_rl.errors import UserError, error_line
from megatron_rl.metrics.console import LOGS_DIR, Console, MetricsFollower, ThirdPartyOutput, collect_ray_logs
from megatron_rl.metrics.evals import EVAL_FILE
from megatron_rl.metrics.logger import is_step_record, read_metrics
from megatron_rl.metrics.plots import plot_report, plot_reward_curve
from megatron_rl.models import get_family, read_hf_config
from megatron_rl.models.base import CheckpointError
from megatron_rl.models.hf_checkpoint import HFCheckpoint
from megatron_rl.models.tiny import make_tiny
from megatron_rl.parallel.layout import layout_from_config
from megatron_rl.parallel.processes import STACK_DUMP_WAIT_S, signal_for_stacks, stop_process_group
from megatron_rl.parallel.torchrun import LaunchError, log_failure, start_torchrun
from megatron_rl.planner.planning import checked_model
from megatron_rl.rollout.buffer import make_buffer_actor
from megatron_rl.rollout.control import CONTROL_NAME, TrainerWatch, make_control_actor
from megatron_rl.rollout.driver import GenerationDriver, GenerationError, mode_lag
from megatron_rl.rollout.engine import EngineSpec
from megatron_rl.rollout.evaluation import EvalRunner, Evaluator, generated_eval_prompts
from megatron_rl.rollout.pool import EnginePool
from megatron_rl.rollout.ray_utils import join_ray, start_local_ray
from megatron_rl.rollout.supervisor import EngineSupervisor
from megatron_rl.rollout.tasks import BUILTIN_TASKS, PromptStream, load_tokenizer, make_eval_prompts, make_task
from megatron_rl.rollout.teacher import TeacherScorer, check_teacher, teacher_specs
from megatron_rl.run_state import (
    ABANDONED,
    RUN_STATE,
    ResumeError,
    check_save_dir,
    checkpoint_steps,
    read_run_state,
    refuse_used_run_dir,
    refuse_used_save_dir,
    resume_checkpoint,
    rewound_to,
    truncate_metrics,
    write_atomically,
)
from megatron_rl.trainer.hf_weights import check_checkpoint_names

log = logging.getLogger(__name__)

TRAINER_MODULE = "megatron_rl.trainer.loop"
"""What every trainer rank runs (`torchrun -m`)."""
BUFFER_NAME = "rollout-buffer"
GENERATION_STOP_S = 30.0
"""How long the cancelled generation tasks get to unwind once the trainer is done (requests are not waited for)."""


def ensure_model(cfg: RunConfig) -> str:
    """The HF checkpoint folder; a missing one is made with `make-tiny` only when `model.make_tiny` asks for it."""
    path = Path(cfg.model.hf_path)
    if (path / "config.json").exists():
        return str(path)
    if not cfg.model.make_tiny:
        raise FileNotFoundError(
            f"model.hf_path={cfg.model.hf_path!r}: no config.json there (download the checkpoint there, or set"
            " model.make_tiny=true and model.family for a small random model)"
        )
    return str(make_tiny(cfg.model.family, path, seed=cfg.trainer.seed))


def check_learns(cfg: RunConfig) -> None:
    """UserError for a run that would train on nothing: group-relative advantages with one response a prompt are
    all 0 (a distillation run learns from its teacher's per-token scores instead)."""
    if cfg.rollout.samples_per_prompt < 2 and not cfg.distill.enabled:
        raise UserError(
            f"algorithm.advantage={cfg.algorithm.advantage} compares each response with the others of its prompt's"
            f" group: with rollout.samples_per_prompt={cfg.rollout.samples_per_prompt} every advantage is 0 and"
            " nothing is learned; set it to 2 or more (the quickstart's is 8)"
        )


def skipped_rows_notice(task) -> str | None:
    """The console's line on the dataset rows the task skipped (too long, no prompt, ...), else None: they were
    said only in summary.json, which a failed run never writes."""
    return f"dataset rows skipped: {task.skip_summary()}" if getattr(task, "skipped_log", None) else None


def engine_specs(cfg: RunConfig, hf_path: str) -> list:
    """One EngineSpec per configured engine."""
    r = cfg.rollout
    return [
        EngineSpec(
            name=f"engine-{i}", model_path=hf_path, dtype=cfg.model.dtype, tensor_parallel=r.engine_tp,
            data_parallel=r.engine_dp, expert_parallel=r.engine_ep, max_model_len=cfg.model.max_sequence_length,
            gpu_memory_utilization=r.gpu_memory_utilization, cpu_kv_cache_gb=r.cpu_kv_cache_gb,
            seed=cfg.trainer.seed + i, max_num_seqs=max(16, r.max_concurrent_prompts * r.samples_per_prompt),
            cpu_affinity=list(r.cpu_affinity), cpu_batch_scheduling=r.cpu_batch_scheduling,
            capture_routes=cfg.algorithm.routing != "free",
            max_logprobs=max(20, r.top_k + 1) if cfg.returns_kept_sets else 20,
            lora_rank=cfg.lora.rank if cfg.lora.enabled and cfg.lora.sync == "vllm" else 0,
            enforce_eager=r.enforce_eager,
            engine_core_in_process=r.engine_core_in_process,
        )
        for i in range(r.num_engines)
    ]  # fmt: skip


def start_teacher_scorer(cfg: RunConfig, teachers: EnginePool | None) -> TeacherScorer | None:
    """Wait for the teacher engines (created with the student's) and return their scorer; None without a teacher."""
    if teachers is None:
        return None
    teachers.wait_started()
    restart = functools.partial(teachers.restart, timeout_s=cfg.rollout.restart_timeout_s)
    return TeacherScorer(
        teachers.actors, restart, cfg.distill.request_timeout_s, cfg.rollout.max_engine_restarts,
        refresh_wait_s=cfg.trainer.timeout_s + cfg.sync.timeout_s,  # a snapshot teacher's: the trainer's next poll
        top_k=cfg.distill.top_k if cfg.distill.top_loss else 0,
    )  # fmt: skip


class LocalTrainerJob:
    """The trainer as a torchrun child of this process: it has ended when the job exits, or is lost when its
    reports say so (`TrainerWatch`: a rank 0 gone silent, or stuck in one phase, while the job still runs)."""

    def __init__(self, proc, log_path: Path, watch: TrainerWatch):
        self.proc, self.log_path, self.watch = proc, log_path, watch
        self.lost: str | None = None

    async def finished(self) -> bool:
        """Whether the torchrun job has exited or is lost; a lost job's ranks are first asked for their stacks
        (`signal_for_stacks`), which they write to the trainer's log."""
        if self.proc.poll() is not None:
            return True
        self.lost = self.watch.lost(await self.watch.look())
        if self.lost is not None and await asyncio.to_thread(signal_for_stacks, self.proc):
            self.lost += " (every rank's Python stacks at this moment are at the end of its log)"
            await asyncio.sleep(STACK_DUMP_WAIT_S)
        return self.lost is not None

    def check(self) -> None:
        """Raise LaunchError, naming the failed rank and its error (or why the job is lost), when the job did not
        succeed."""
        if self.proc.poll() is None and self.lost is not None:
            raise LaunchError(f"{self.lost}; the trainer's log: {self.log_path}")
        if self.proc.wait() != 0:
            raise log_failure(self.log_path, TRAINER_MODULE, self.proc.returncode)

    def stop(self) -> None:
        """Kill the job (and every rank in it)."""
        stop_process_group(self.proc)


class ExternalTrainerJob:
    """A trainer launched elsewhere (`--external-trainer`: SLURM, launch/torchrun.sh), watched through its reports
    to the run-control actor: it has failed when it says so, or is lost (`TrainerWatch`)."""

    def __init__(self, watch: TrainerWatch):
        self.watch = watch
        self.status: dict = {}

    async def finished(self) -> bool:
        """Whether the trainer reported the end (done or failed) or is lost."""
        self.status = await self.watch.look()
        return self.watch.ended(self.status) or self.watch.lost(self.status) is not None

    def check(self) -> None:
        """Raise LaunchError unless the trainer reported success."""
        status = self.status
        if status.get("state") == "failed":
            raise LaunchError(f"trainer failed after step {status['step']}: {status['message']}")
        if status.get("state") != "done":
            raise LaunchError(self.watch.lost(status) or f"trainer did not finish: {status}")

    def stop(self) -> None:
        """Nothing to kill from here: the job that launched the trainer ends it (see launch/)."""


async def _drive(driver, supervisor, job, poll_s: float = 0.5, on_poll=None) -> None:
    """Run generation (and restart dead engines) until the trainer ends; a failure of generation while the
    trainer still runs stops the trainer. Once the trainer has ended, its own outcome (`job.check()`) is what
    counts, so generation is cancelled rather than waited for."""
    tasks = [asyncio.create_task(driver.run()), asyncio.create_task(supervisor.run())]
    raised = None  # the task whose error this raises: not logged again as it stops
    try:
        trainer_done = False
        while not (trainer_done := await job.finished()) and not any(t.done() for t in tasks):
            if on_poll is not None:
                on_poll()  # the console's step lines
            await asyncio.sleep(poll_s)
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None and not trainer_done:
            job.stop()
            raised, err = failed, failed.exception()
            raise GenerationError(f"generation failed: {type(err).__name__}: {err}") from err
    finally:
        await _stop_generation(driver, supervisor, [t for t in tasks if t is not raised])


async def _stop_generation(driver, supervisor, tasks: list[asyncio.Task]) -> None:
    """Stop the driver and supervisor now: their tasks are cancelled, not waited for (a request may take up to
    rollout.request_timeout_s). An abandoned prompt stays in flight in the buffer's accounting; never raises."""
    driver.stop()
    supervisor.stop()
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=GENERATION_STOP_S)
    for task in pending:
        log.warning(
            "generation task %s did not stop within %g s of its cancellation", task.get_name(), GENERATION_STOP_S
        )
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            err = task.exception()
            log.warning("generation ended with %s: %s (after the trainer's end)", type(err).__name__, err)


def resume_point(cfg: RunConfig) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from and its run state, or (None, None) for a fresh start."""
    check_save_dir(cfg.checkpoint.save_dir)
    if not cfg.checkpoint.resume:
        refuse_used_save_dir(cfg.checkpoint.save_dir)  # a crash before the first save would leave the old `latest`
        return None, None
    if not cfg.checkpoint.save_dir:
        raise ResumeError("checkpoint.resume needs checkpoint.save_dir (where the run's checkpoints are)")
    save_dir, step = cfg.checkpoint.save_dir, cfg.checkpoint.resume_step
    if step and int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0 and rewound_to(save_dir) == step:
        # A requeued job reruns its command: once the rewind was done, it would undo what the run trained since.
        log.warning("checkpoint.resume_step=%d ignored in a requeued Slurm job (rewound already): the latest", step)
        step = 0
    folder = resume_checkpoint(save_dir, step)
    if folder is None:
        return None, None
    state = read_run_state(folder)
    if cfg.algorithm.forced_lag:  # trainer/loop.py LaggedWeights: copies of the last versions, in no checkpoint
        raise ResumeError(
            f"{folder}: algorithm.forced_lag={cfg.algorithm.forced_lag} cannot resume (the weights of the versions"
            " it lags behind are not in the checkpoint); start the run afresh in another checkpoint.save_dir"
        )
    later = [number for number in checkpoint_steps(save_dir) if number > state["step"]]
    if later:
        log.warning(
            "resuming from step %d: once the trainer has loaded it, the later checkpoints (steps %s) move to %s",
            state["step"],
            later,
            Path(save_dir) / ABANDONED,
        )
    return folder, state


def run_training(
    cfg: RunConfig,
    ray_address: str | None = None,
    external_trainer: bool = False,
    console: Console | None = None,
    output: ThirdPartyOutput | None = None,
    overwrite: bool = False,
) -> dict:
    """Run the whole job; returns the summary (also written to the run folder).

    `ray_address` joins a running Ray cluster instead of starting a local one; `external_trainer` writes the
    trainer spec and waits for a trainer started elsewhere (`torchrun -m megatron_rl.trainer.loop SPEC`).
    `console` gets the run's prefixed lines (one per step); `output`, when given, takes the third-party output
    of this process to `RUN_DIR/logs/launcher.log` and keeps the engines' out of the console. A run folder that
    holds an earlier run is refused unless the run resumes it or `overwrite` replaces it (and then only once the
    model, tokenizer and task are ready).
    """
    console = console or Console()
    run_dir = Path(cfg.output_dir) / cfg.name
    refuse_used_run_dir(run_dir, cfg.checkpoint.resume, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_dir = run_dir / LOGS_DIR
    launcher_log = output.to_file(log_dir) if output is not None else None
    spec_path = run_dir / "trainer_spec.json"
    spec_path.unlink(missing_ok=True)  # an external trainer must not start from a previous run's spec
    cfg, tokenizer, task, resume_from, run_state, eval_set = prepare_run(cfg, run_dir)
    hf_path = cfg.model.hf_path
    start = time.perf_counter()
    if ray_address:
        join_ray(ray_address)
    quiet = output is not None and not output.verbose
    ray_info = {"address": ray_address} if ray_address else start_local_ray(log_to_driver=not quiet)
    console.say(
        f"run {cfg.name}: {cfg.mode}, {cfg.steps} steps, trainer {layout_from_config(cfg.trainer.parallel).describe()}, "
        f"{cfg.rollout.num_engines} engine(s); logs in {log_dir}"
        + (f" (this process: {launcher_log})" if launcher_log else "")
    )
    if (notice := skipped_rows_notice(task)) is not None:
        console.say(notice)
    buffer = start_buffer(cfg, task, run_state, resume_from)
    pool = EnginePool(engine_specs(cfg, hf_path), cpus_per_engine=0.5)
    teachers = EnginePool(teacher_specs(cfg), cpus_per_engine=0.5) if cfg.distill.enabled else None
    pools = [p for p in (pool, teachers) if p is not None]  # teachers: not in the roster (a snapshot's own sync)
    job = None
    try:
        for engines in pools:  # vLLM loads while the trainer starts: neither waits for the other until the first sync
            engines.create()
        control = make_control_actor([(h.name, h.workers) for h in pool.handles()])
        spec = trainer_spec(cfg, ray_info["address"], pool, run_dir, resume_from, teachers)
        write_atomically(spec_path, json.dumps(spec))  # a trainer waiting for the file never reads half of it
        job = start_trainer_job(cfg, spec_path, log_dir, control, external_trainer)
        pool.wait_started()
        scorer = start_teacher_scorer(cfg, teachers)
        console.say("engines up; training (one line per step)")
        driver = GenerationDriver(
            buffer, dict(pool.actors), task, tokenizer, cfg, mode_lag(cfg.mode, cfg.buffer.max_staleness), scorer
        )
        supervisor = EngineSupervisor(
            pool, driver, control, buffer, cfg.rollout.max_engine_restarts,
            hang_timeout_s=cfg.rollout.hang_timeout_s, restart_timeout_s=cfg.rollout.restart_timeout_s,
        )  # fmt: skip
        follower = MetricsFollower(run_dir / "metrics.jsonl", cfg.steps, console)
        evaluation = eval_runner(cfg, eval_set, tokenizer, driver, run_dir, console)
        asyncio.run(_drive(driver, supervisor, job, on_poll=functools.partial(_poll, follower, evaluation, driver)))
        follower.poll()
        job.check()
        outcome = {
            "ended": ray.get(control.trainer_status.remote(), timeout=60)["message"],  # why it ended early, if so
            "accounting": ray.get(buffer.check_accounting.remote(), timeout=60),
            "engines": pool.health(),
        }
    finally:
        if job is not None:
            job.stop()
        stop_engines(pools, ray_info.get("temp_dir"), log_dir)
    summary = summarize(cfg, run_dir, time.perf_counter() - start, resume_from, outcome, driver, supervisor, task)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _poll(follower: MetricsFollower, evaluation: EvalRunner | None, driver) -> None:
    """What the launcher does while the trainer runs: the console's step lines and the due evaluations."""
    follower.poll()
    if evaluation is not None:
        evaluation.poll(driver.trainer_version)


def stop_engines(pools: list[EnginePool], ray_temp_dir: str | None, log_dir: Path) -> None:
    """Shut down every engine pool (the student's and the teacher's) and keep their Ray logs, by engine name."""
    names: dict[int, str] = {}
    for engines in pools:
        names |= engines.pids()
    for engines in pools:
        engines.shutdown()
    collect_ray_logs(ray_temp_dir, names, log_dir)


def prepare_run(cfg: RunConfig, run_dir: Path) -> tuple:
    """The model (made when asked), tokenizer, task, resume point and evaluation prompts; then, start-up having
    succeeded, the run folder's metrics cut to the resumed step (all of them for a fresh run) and its config
    written. Returns (config with the model's path, tokenizer, task, checkpoint to resume from, its run state,
    the evaluation prompts or None)."""
    resume_from, run_state = resume_point(cfg)
    check_learns(cfg)
    hf_path = ensure_model(cfg)
    arch = checked_model(cfg, read_hf_config(hf_path), f"{hf_path}/config.json")  # before anything starts: family,
    check_checkpoint_names(HFCheckpoint(hf_path), get_family(arch.family).rule_table(arch))  # layout, tensors, dtypes
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf_path": hf_path})})
    tokenizer = load_tokenizer(hf_path)
    if len(tokenizer) > arch.vocab_size:
        raise CheckpointError(
            f"{hf_path}: its tokenizer has {len(tokenizer)} tokens, config.json's vocab_size is {arch.vocab_size}: the"
            " tokens past it have no embedding"
        )
    if cfg.distill.teacher == "hf":
        check_teacher(hf_path, cfg.distill.teacher_path)  # before any engine starts: refused at start-up
    task = make_task(cfg.task, tokenizer, seed=cfg.task.seed, length=cfg.task.length)
    task.set_response_limit(cfg.rollout.max_new_tokens)  # the length penalties against the engines' limit, now
    eval_set = eval_prompts(cfg, task, tokenizer)
    truncate_metrics(run_dir / "metrics.jsonl", run_state["step"] if run_state else 0)
    (run_dir / "summary.json").unlink(missing_ok=True)  # an earlier run's: this run writes its own at the end
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return cfg, tokenizer, task, resume_from, run_state, eval_set


def eval_prompts(cfg: RunConfig, task, tokenizer) -> list[dict] | None:
    """The prompts the run evaluates on (None without `eval.interval`): the validation datasets' (`task.
    eval_datasets`, read and checked whenever given, so that bad eval data fails at start-up), or a generated
    task's held-out prompts; UserError when evaluation is asked for and there is nothing to evaluate on."""
    limit = cfg.eval.max_prompts
    prompts = make_eval_prompts(cfg.task, tokenizer)[:limit] if cfg.task.eval_datasets else None
    if not cfg.eval.interval:
        return None
    if prompts is None:
        prompts = generated_eval_prompts(task, limit or 32) if isinstance(task, tuple(BUILTIN_TASKS.values())) else []
    if not prompts:
        raise UserError(
            "eval.interval is set but there is nothing to evaluate on: give task.eval_datasets (see docs/data.md)"
        )
    return prompts


def eval_runner(cfg: RunConfig, prompts, tokenizer, driver, run_dir: Path, console: Console) -> EvalRunner | None:
    """The evaluations of the run on `prompts` (`eval_prompts`; None: no evaluation), scored by the training
    reward."""
    if prompts is None:
        return None
    (run_dir / EVAL_FILE).unlink(missing_ok=True)  # an earlier run's results
    evaluator = Evaluator(driver.engines, driver.down, prompts, tokenizer, driver.score, cfg.eval, cfg.rollout)
    return EvalRunner(evaluator, run_dir / EVAL_FILE, cfg.steps, cfg.eval.timeout_s, say=console.say)


def start_buffer(cfg: RunConfig, task, run_state: dict | None, resume_from: Path | None = None):
    """The rollout buffer actor over the task's prompts, with a resumed run's contents and data position (from
    the checkpoint folder `resume_from`)."""
    buffer = make_buffer_actor(
        capacity=cfg.buffer.capacity, max_staleness=cfg.buffer.max_staleness, stale_policy=cfg.buffer.stale_policy,
        prompts=PromptStream(task, cfg.task.epochs), max_requeues=cfg.buffer.max_requeues, name=BUFFER_NAME,
    )  # fmt: skip
    if run_state is not None:
        try:
            ray.get(buffer.load_state_dict.remote(run_state["buffer"]), timeout=120)
        except ray.exceptions.RayTaskError as err:  # the state itself (counts, prompts) is wrong, not Ray
            raise ResumeError(
                f"{Path(resume_from or '.') / RUN_STATE}: the rollout buffer's state cannot be restored"
                f" ({error_line(err)})"
            ) from None
    if cfg.mode == "async" and cfg.buffer.lookahead == "adaptive":
        lag, target = mode_lag(cfg.mode, cfg.buffer.max_staleness), cfg.buffer.target_trainer_idle
        ray.get(buffer.configure_lookahead.remote(cfg.prompts_per_step, lag, target), timeout=60)
    return buffer


def trainer_spec(
    cfg: RunConfig,
    ray_address: str,
    pool: EnginePool,
    run_dir: Path,
    resume_from: Path | None,
    teachers: EnginePool | None = None,
) -> dict:
    """What every trainer rank reads at start (`trainer_spec.json`): the config and where to find the run."""
    return {
        "teachers": [[h.name, h.workers] for h in teachers.handles()] if teachers is not None else [],
        "config": cfg.model_dump(mode="json"), "ray_address": ray_address, "buffer": BUFFER_NAME,
        "control": CONTROL_NAME, "engines": [[h.name, h.workers] for h in pool.handles()],
        "run_dir": str(run_dir), "resume_from": str(resume_from) if resume_from else None,
        "world_size": layout_from_config(cfg.trainer.parallel).world_size,
    }  # fmt: skip


def start_trainer_job(
    cfg: RunConfig, spec_path: Path, log_dir: Path, control, external: bool
) -> LocalTrainerJob | ExternalTrainerJob:
    """Start torchrun here (its output to `log_dir/trainer.log`), or (`external`) watch a trainer started
    elsewhere through its reports."""
    # Beats come every 10 s: silence this long (a collective's wait and a minute, as before the beats ran
    # through every phase) means rank 0's process, or its Python, or its way to Ray is gone.
    watch = TrainerWatch(control, cfg.trainer.collective_timeout_s + 60, cfg.stall_timeout_s)
    if external:
        return ExternalTrainerJob(watch)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "trainer.log"
    world_size = layout_from_config(cfg.trainer.parallel).world_size
    return LocalTrainerJob(start_torchrun(TRAINER_MODULE, [str(spec_path)], world_size, log_path), log_path, watch)


def summarize(
    cfg: RunConfig, run_dir: Path, seconds: float, resume_from: Path | None, outcome: dict, driver, supervisor, task
) -> dict:
    """The run's summary (`summary.json`), with the reward curve drawn from its metrics."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if is_step_record(r)]
    plot_reward_curve(run_dir / "metrics.jsonl", run_dir / "reward_curve.png", title=f"{cfg.name}: {cfg.mode}")
    plot_report(run_dir / "metrics.jsonl", run_dir / "report.png", title=f"{cfg.name}: {cfg.mode}")
    return {
        "run_dir": str(run_dir), "mode": cfg.mode, "steps": len(records), "wall_seconds": round(seconds, 1),
        "steps_planned": cfg.steps, "ended_early": outcome["ended"] or None,
        "resumed_from": str(resume_from) if resume_from else None,
        "reward_first": records[0]["reward/mean"] if records else None,
        "reward_last": records[-1]["reward/mean"] if records else None,
        "reward_best": max((r["reward/mean"] for r in records), default=None),
        "accounting": outcome["accounting"], "driver": vars(driver.stats), "engine_restarts": supervisor.restarts,
        "engine_restart_reasons": supervisor.reasons, "engines": outcome["engines"], "task": task.report(),
        "teacher": driver.teacher.report() if driver.teacher is not None else None,
    }  # fmt: skip

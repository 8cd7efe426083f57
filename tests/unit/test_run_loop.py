"""The trainer-side run loop without processes: how rank 0's wait for a batch ends on every rank (a batch, the end
of the prompts, or rank 0's error), and how the launcher ends generation, refuses another run's save_dir."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import types
from pathlib import Path

import pytest
import torch

from megatron_rl import launcher
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.trainer import COLLECTIVE_TIMEOUT_MARGIN_S
from megatron_rl.metrics.background import BackgroundReporter
from megatron_rl.models.base import CheckpointError
from megatron_rl.rollout.control import TrainerHeartbeat
from megatron_rl.rollout.driver import GenerationError
from megatron_rl.run_state import ResumeError, mark_latest, step_dir, write_run_state
from megatron_rl.trainer import learner, loop
from megatron_rl.trainer.loop import BatchWaitError, TrainerLoop
from tests.unit.test_buffer import fill, make_buffer

# ---------------------------------------------------------------------------------------------------------------
# Trainer side (trainer/loop.py): Ray and torch.distributed replaced by in-process stand-ins.


class Local:
    """A plain object behind Ray's call syntax; with `ray.get` patched to return its argument."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name: str):
        return types.SimpleNamespace(remote=getattr(self._obj, name))


class Control:
    def __init__(self):
        self.reports: list[tuple] = []

    def report_trainer(self, state: str, step: int, message: str = "") -> None:
        self.reports.append((state, step, message))


class NoRosterChange:
    def roster_changed(self):
        return None


class Broadcasts:
    """`dist.broadcast_object_list`: records what rank 0 sends; on other ranks, delivers `incoming`."""

    def __init__(self, incoming=None):
        self.sent: list = []
        self.incoming = incoming

    def __call__(self, objects: list, src: int = 0) -> None:
        if objects[0] is None:
            objects[0] = self.incoming
        else:
            self.sent.append(objects[0])


@pytest.fixture
def broadcasts(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)
    made = Broadcasts()
    monkeypatch.setattr(loop.dist, "broadcast_object_list", made)
    return made


def _cfg(*overrides: str):
    return load_config("configs/quickstart.yaml", ["prompts_per_step=2", *overrides])


def _run(cfg, buffer=None, rank0: bool = True, step: int = 0) -> TrainerLoop:
    """A TrainerLoop of one rank without its learner, engines or Ray actors."""
    run = TrainerLoop.__new__(TrainerLoop)
    run.cfg, run.is_rank0, run.step, run.saved_step, run.end_message = cfg, rank0, step, step, ""
    run.buffer = Local(buffer) if buffer is not None else None
    run.control = Local(Control())
    run.sync = NoRosterChange()
    run.heartbeat = TrainerHeartbeat(run.control)  # not started: no beats, only the last report
    run.teachers = None
    run.reporter = BackgroundReporter()
    return run


def test_collectives_wait_longer_than_rank0_waits_for_a_batch(monkeypatch):
    cfg = _cfg("trainer.timeout_s=300", "algorithm.kl_coef=0")
    seen = {}

    def bring_up_from_hf(*args, timeout_s):
        seen["timeout_s"] = timeout_s
        return types.SimpleNamespace(model=None)

    monkeypatch.setattr(learner, "bring_up_from_hf", bring_up_from_hf)
    monkeypatch.setattr(learner, "build_training", lambda *a: None)
    learner.Learner(cfg)
    assert seen["timeout_s"] == cfg.trainer.collective_timeout_s == 300 + COLLECTIVE_TIMEOUT_MARGIN_S
    assert COLLECTIVE_TIMEOUT_MARGIN_S >= 60  # covers rank 0's per-step calls and last get_batch


def test_rank0_without_a_batch_tells_every_rank_its_error(broadcasts):
    buffer = make_buffer()  # an endless stream, but nothing generates
    run = _run(_cfg("trainer.timeout_s=0.1"), buffer)
    with pytest.raises(TimeoutError, match="no batch of 2 groups within trainer.timeout_s.*is generation running"):
        run.next_batch()
    [(kind, message)] = broadcasts.sent
    assert kind == "error" and message.startswith("TimeoutError: no batch of 2 groups")


def test_other_ranks_raise_rank0s_error_instead_of_a_broadcast_timeout(broadcasts):
    broadcasts.incoming = ("error", "TimeoutError: no batch of 2 groups within ... is generation running?")
    run = _run(_cfg(), rank0=False)
    with pytest.raises(BatchWaitError, match="rank 0 stopped waiting for a batch: TimeoutError: no batch of 2"):
        run.next_batch()


def test_used_up_prompts_end_the_batches_on_every_rank_at_once(broadcasts):
    buffer = make_buffer(count=3, epochs=1)
    fill(buffer, 3)
    assert buffer.claim_prompts(1) == []  # what the driver keeps doing: the stream is now known to be exhausted
    run = _run(_cfg("trainer.timeout_s=600", "task.epochs=1"), buffer)
    assert [g.prompt_index for g in run.next_batch()] == [0, 1]
    start = time.monotonic()
    assert run.next_batch() is None  # one group left, none can come: at once, not after trainer.timeout_s
    assert time.monotonic() - start < 5
    assert [kind for kind, _ in broadcasts.sent] == ["groups", "exhausted"]
    broadcasts.incoming = ("exhausted", None)
    assert _run(_cfg(), rank0=False).next_batch() is None


def test_a_group_that_arrives_as_the_stream_finishes_still_makes_the_batch(broadcasts):
    class LastGroupLate:  # the last in-flight group lands between the empty get_batch and the stats call
        def __init__(self):
            self.buffer = make_buffer(count=2, epochs=1)
            fill(self.buffer, 1)
            self.late = self.buffer.claim_prompts(1)

        def get_batch(self, *args):
            return self.buffer.get_batch(*args)

        def stats(self):
            if self.late:
                fill_one(self.buffer, self.late.pop()[0])
                self.buffer.claim_prompts(1)
            return self.buffer.stats()

    from tests.unit.test_buffer import make_group

    def fill_one(buffer, index):
        assert buffer.put_group(make_group(index))

    run = _run(_cfg("trainer.timeout_s=600"), LastGroupLate())
    assert [g.prompt_index for g in run.next_batch()] == [0, 1]


def test_ending_out_of_prompts_checkpoints_the_last_step_once(monkeypatch, caplog, broadcasts):
    saved = []
    monkeypatch.setattr(TrainerLoop, "save_checkpoint", lambda self, step, last: saved.append((step, last)))
    run = _run(_cfg("checkpoint.save_dir=/ckpt", "task.epochs=2", "steps=50"), step=7)
    run.saved_step = 6
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.loop"):
        run.end_out_of_prompts()
    assert saved == [(7, True)]  # the run's last save: a failed one still writes the final export
    assert "prompt stream exhausted after step 7 (task.epochs=2)" in caplog.text
    run.metrics = types.SimpleNamespace(close=lambda: None)
    run.close()
    assert run.control._obj.reports == [("done", 7, "prompt stream exhausted after step 7 (task.epochs=2)")]

    already = _run(_cfg("checkpoint.save_dir=/ckpt", "task.epochs=2"), step=8)  # saved by the loop (or resumed)
    already.end_out_of_prompts()
    unsaved = _run(_cfg("task.epochs=2"), step=9)  # no save_dir: nothing to save
    unsaved.end_out_of_prompts()
    assert saved == [(7, True)]


def test_run_loop_stops_cleanly_when_the_prompts_run_out(monkeypatch):
    class FakeRun:
        def __init__(self, cfg, spec):
            self.step, self.batches, self.calls = 0, 2, []
            self.learner = types.SimpleNamespace(step=lambda batch, version=None: {"loss": 0.0})
            self.heartbeat = types.SimpleNamespace(phase=lambda step, what: self.calls.append((what, step)))

        def push(self, step):
            return {"seconds": 0.0}

        def next_batch(self):
            self.batches -= 1
            return ["group"] if self.batches >= 0 else None

        def finish_step(self, step, *args):
            self.step = step
            self.calls.append(("step", step))

        def end_out_of_prompts(self):
            self.calls.append(("out of prompts", self.step))

        def export_hf(self, folder, step):
            self.calls.append(("export", step, folder.name))

        def close(self):
            self.calls.append(("close", self.step))
            made.append(self)

    made: list[FakeRun] = []
    monkeypatch.setattr(loop, "TrainerLoop", FakeRun)
    monkeypatch.setattr(loop, "to_train_batch", lambda groups, cfg, learner: groups)
    loop.run_loop(_cfg("steps=5"), {"run_dir": "/nowhere/run"})
    assert made[0].calls == [
        ("training step 1", 0), ("step", 1), ("training step 2", 1), ("step", 2),
        ("out of prompts", 2), ("export", 2, "hf"), ("close", 2),
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Launcher side (launcher.py).


class Stoppable:
    """A driver or supervisor whose `run` ignores `stop` (like a request waiting on a slow engine)."""

    def __init__(self, error: BaseException | None = None):
        self.error, self.stopped, self.cancelled = error, False, False

    def stop(self):
        self.stopped = True

    async def run(self):
        if self.error is not None:
            raise self.error
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


class FakeTrainer:
    def __init__(self, finished_after: int):
        self.polls, self.finished_after, self.stopped = 0, finished_after, False

    async def finished(self) -> bool:
        self.polls += 1
        return self.polls > self.finished_after

    def stop(self):
        self.stopped = True


def test_generation_is_cancelled_not_awaited_once_the_trainer_is_done():
    driver, supervisor, trainer = Stoppable(), Stoppable(), FakeTrainer(finished_after=1)
    start = time.monotonic()
    asyncio.run(launcher._drive(driver, supervisor, trainer, poll_s=0.01))
    assert time.monotonic() - start < 5
    assert driver.cancelled and supervisor.cancelled and driver.stopped and supervisor.stopped
    assert not trainer.stopped  # its own outcome is for trainer.check()


def test_a_generation_error_after_the_trainer_ended_leaves_the_verdict_to_the_trainer(caplog):
    driver, supervisor, trainer = Stoppable(RuntimeError("engine gone")), Stoppable(), FakeTrainer(finished_after=1)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.launcher"):
        asyncio.run(launcher._drive(driver, supervisor, trainer, poll_s=0.01))
    assert "RuntimeError: engine gone (after the trainer's end)" in caplog.text
    assert supervisor.cancelled and not trainer.stopped


def test_a_generation_error_while_the_trainer_runs_stops_it(caplog):
    driver, supervisor, trainer = Stoppable(RuntimeError("engine gone")), Stoppable(), FakeTrainer(10**9)
    failed = pytest.raises(GenerationError, match="generation failed: RuntimeError: engine gone")
    with caplog.at_level(logging.WARNING, logger="megatron_rl.launcher"), failed:
        asyncio.run(launcher._drive(driver, supervisor, trainer, poll_s=0.01))
    assert trainer.stopped and supervisor.cancelled
    assert "engine gone" not in caplog.text  # raised, not also logged as ending "after the trainer's end"


def _with_checkpoint(save_dir) -> None:
    folder = step_dir(save_dir, 4)
    folder.mkdir(parents=True)
    write_run_state(folder, 4, None)
    mark_latest(save_dir, folder)


def test_a_fresh_run_refuses_a_save_dir_with_another_runs_latest(tmp_path):
    save_dir = tmp_path / "ckpt"
    assert launcher.resume_point(_cfg(f"checkpoint.save_dir={save_dir}")) == (None, None)  # no folder yet
    _with_checkpoint(save_dir)
    with pytest.raises(ResumeError, match=rf"{save_dir}.*step_00000004.*--resume.*another checkpoint.save_dir"):
        launcher.resume_point(_cfg(f"checkpoint.save_dir={save_dir}"))
    assert (save_dir / "latest").exists() and step_dir(save_dir, 4).exists()  # nothing deleted
    folder, state = launcher.resume_point(_cfg(f"checkpoint.save_dir={save_dir}", "checkpoint.resume=true"))
    assert folder == step_dir(save_dir, 4) and state["step"] == 4
    assert launcher.resume_point(_cfg()) == (None, None)  # no saving: nothing to refuse
    lagged = ("mode=sync", "algorithm.forced_lag=2", "checkpoint.resume=true")
    with pytest.raises(ResumeError, match=r"step_00000004: algorithm.forced_lag=2 cannot resume"):
        launcher.resume_point(_cfg(f"checkpoint.save_dir={save_dir}", *lagged))


def test_resume_from_an_earlier_checkpoint_when_the_latest_fails_its_checks(tmp_path, caplog, monkeypatch):
    from megatron_rl.run_state import latest_checkpoint, save_run_checkpoint
    from megatron_rl.trainer.checkpoint import CorruptCheckpointError

    save_dir = tmp_path / "ckpt"
    for step in (2, 4):
        save_run_checkpoint(save_dir, step, 3, lambda folder: None, lambda: {"groups": []})
    state = step_dir(save_dir, 4) / "run_state.json"
    state.write_text(state.read_text().replace('"step": 4', '"step": 5'))
    resume = (f"checkpoint.save_dir={save_dir}", "checkpoint.resume=true")
    with pytest.raises(ResumeError, match=r"run_state.json: corrupted.*steps 2: checkpoint.resume_step=<step>"):
        launcher.resume_point(_cfg(*resume))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.launcher"):
        folder, state = launcher.resume_point(_cfg(*resume, "checkpoint.resume_step=2"))
    assert folder == step_dir(save_dir, 2) and state["step"] == 2
    assert "resuming from step 2: once the trainer has loaded it, the later checkpoints (steps [4]) move" in caplog.text
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job reruns its command: rewinds until it was done
    assert launcher.resume_point(_cfg(*resume, "checkpoint.resume_step=2"))[0] == step_dir(save_dir, 2)
    (save_dir / "rewound.json").write_text(json.dumps({"step": 2}))  # as the trainer's load of step 2 records
    with caplog.at_level(logging.WARNING, logger="megatron_rl.launcher"), pytest.raises(ResumeError, match="corrupt"):
        launcher.resume_point(_cfg(*resume, "checkpoint.resume_step=2"))  # then from the latest (here: corrupt)
    assert "checkpoint.resume_step=2 ignored in a requeued Slurm job (rewound already)" in caplog.text
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    (save_dir / "rewound.json").unlink()
    with pytest.raises(ConfigError, match="resume_step=2 picks a checkpoint.*needs checkpoint.resume"):
        _cfg(f"checkpoint.save_dir={save_dir}", "checkpoint.resume_step=2")

    class Learner:  # loads as `Learner.load` would, or finds what `fails` says
        def __init__(self, fails: Exception | None = None):
            self.fails = fails

        def load(self, folder):
            if self.fails:
                raise self.fails
            return int(folder.name[5:])

    ckpt = _cfg(*resume, "checkpoint.resume_step=2").checkpoint
    corrupt = CorruptCheckpointError(f"{step_dir(save_dir, 4)}/shard.distcp: corrupted")
    with pytest.raises(CorruptCheckpointError, match=r"shard.distcp: corrupted; .*steps 2: checkpoint.resume_step"):
        loop.load_resumed(Learner(corrupt), ckpt, step_dir(save_dir, 4), True)
    misfit = CheckpointError("does not fit the model")  # every checkpoint of the run would fail alike: no hint
    with pytest.raises(CheckpointError, match=r"^does not fit the model$"):
        loop.load_resumed(Learner(misfit), ckpt, step_dir(save_dir, 4), True)
    assert loop.load_resumed(Learner(), ckpt, step_dir(save_dir, 2), True) == 2
    assert latest_checkpoint(save_dir) == step_dir(save_dir, 2) and not step_dir(save_dir, 4).exists()
    assert [p.name for p in (save_dir / "abandoned").glob("*/step_*")] == ["step_00000004"]
    assert json.loads((save_dir / "rewound.json").read_text())["step"] == 2  # a requeue will not rewind again


# ---------------------------------------------------------------------------------------------------------------
# Guards, mini-batch stats and the forced lag (trainer/learner.py, trainer/loop.py).


def test_skipped_updates_in_a_row_stop_the_run():
    skips = learner.SkipCounter(limit=3)
    for skipped in (True, True, False, True, True):
        skips.record(skipped, "x")
    assert (skips.total, skips.in_a_row) == (4, 2)
    with pytest.raises(learner.NonFiniteError, match=r"3 updates in a row.*last: mb 7.*in_a_row=3"):
        skips.record(True, "mb 7")


def test_batch_stats_aggregate_over_minibatches():
    updates = [
        {"loss": 1.0, "grad_norm": 2.0, "ppo/clip_frac": 0.0, "batch/sequences": 4.0, "guard/skipped": 0.0},
        {"loss": float("nan"), "grad_norm": float("inf"), "ppo/clip_frac": 0.5, "batch/sequences": 4.0,
         "guard/skipped": 1.0},
        {"loss": 3.0, "grad_norm": 4.0, "ppo/clip_frac": 0.2, "batch/sequences": 4.0, "guard/skipped": 0.0},
        {"loss": 5.0, "grad_norm": 1.0, "ppo/clip_frac": 0.4, "batch/sequences": 4.0, "guard/skipped": 0.0},
    ]  # fmt: skip
    stats = learner.aggregate_updates(updates, per_epoch=2)  # two epochs of two mini-batches
    assert stats["loss"] == 3.0 and stats["grad_norm"] == pytest.approx(7 / 3)  # the skipped one left out
    assert stats["ppo/clip_frac"] == pytest.approx(0.2)
    assert stats["batch/sequences"] == 8.0  # one epoch's sequences
    assert stats["grad_norm_max"] == float("inf") and stats["ppo/updates"] == 4
    assert stats["guard/skipped_updates"] == 1 and stats["guard/skipped"] == 0
    all_bad = learner.aggregate_updates([updates[1]], per_epoch=1)
    assert all_bad["guard/skipped"] == 1 and math.isnan(all_bad["loss"])


class RecordingSync:
    def __init__(self, model):
        self.model, self.pushed = model, []

    def push(self, version):
        self.pushed.append((version, self.model.weight.detach().clone()))
        return {"seconds": 0.0}


def _push_loop(model, lag: int):
    run = TrainerLoop.__new__(TrainerLoop)
    run.step = 0
    run.learner = types.SimpleNamespace(check_weights=lambda step: learner.Learner.check_weights(fake, step))
    fake = types.SimpleNamespace(state=types.SimpleNamespace(model=model))
    run.sync = RecordingSync(model)
    run.lagged = loop.LaggedWeights(model, lag)
    run.heartbeat = TrainerHeartbeat(None)
    run.teachers = None
    return run


@pytest.fixture
def local_all_reduce(monkeypatch):
    """One process: the finiteness check's all-reduce is the identity."""
    monkeypatch.setattr(learner.dist, "all_reduce", lambda tensor, op=None: None)


def test_a_forced_lag_pushes_the_weights_of_exactly_k_versions_ago(local_all_reduce):
    model = torch.nn.Linear(2, 2, bias=False)
    run = _push_loop(model, lag=2)
    history = {}
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(float(step))  # the weights after step `step`
        history[step] = model.weight.detach().clone()
        report = run.push(step)
        assert torch.equal(model.weight, history[step])  # the model holds its own weights again
        assert report.get("forced_lag") == 2
    assert [v for v, _ in run.sync.pushed] == [1, 2, 3]  # nothing while version 0 (what the engines start with)
    for version, weights in run.sync.pushed:
        assert torch.equal(weights, history[version])
    assert sorted(run.lagged.history) == [3, 4, 5]  # the window: no more copies than the lag needs


def test_weights_that_are_not_finite_never_reach_the_engines(local_all_reduce):
    model = torch.nn.Linear(2, 2, bias=False)
    run = _push_loop(model, lag=0)
    run.push(1)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(learner.NonFiniteError, match="weights after step 2 are not finite: not pushing"):
        run.push(2)
    assert [v for v, _ in run.sync.pushed] == [1]


def test_the_trainer_configures_the_buffers_admission_from_the_algorithm_section():
    cfg = _cfg(
        "algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_drops=9", "algorithm.max_abs_reward=5"
    )
    assert loop.admission(cfg) == {"drop_zero_variance": True, "max_zero_variance_drops": 9, "max_abs_reward": 5.0}
    buffer = make_buffer()
    buffer.configure_admission(**loop.admission(cfg))
    assert (buffer.drop_zero_variance, buffer.max_zero_variance_drops, buffer.max_abs_reward) == (True, 9, 5.0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.ppo_minibatches=3"], "ppo_minibatches=3 must divide the batch of .* = 16 sequences"),
        (["algorithm.forced_lag=4", "mode=async"], "forced_lag=4 .* needs mode=sync"),
        (["algorithm.forced_lag=8", "mode=sync"], r"buffer.max_staleness >= 8 \(got 4\)"),
        (["algorithm.dynamic_sampling=true", "rollout.samples_per_prompt=1"], "samples_per_prompt >= 2"),
        (["algorithm.kl_in=reward"], "kl_in=reward needs algorithm.kl_coef > 0"),
        (["buffer.stale_policy=correct", "algorithm.loss=ppo"], "needs a decoupled algorithm.loss"),
    ],
)
def test_algorithm_settings_that_cannot_work_fail_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)
    assert _cfg("algorithm.ppo_minibatches=4", "algorithm.forced_lag=4", "mode=sync").algorithm.ppo_minibatches == 4


def test_update_stats_reach_rank0_without_a_collective_unless_the_owner_is_elsewhere(monkeypatch):
    """The stats owner (last stage, TP and DP rank 0) is rank 0 without pipeline parallelism: the others get {}
    and nothing is sent; with PP2 the owner is a later rank and one broadcast carries its dictionary."""
    from megatron_rl.trainer import train_step

    sent = []

    def broadcast_object_list(box, src):
        sent.append(src)
        box[0] = {"ppo/clip_frac": 0.25}

    monkeypatch.setattr(train_step.dist, "broadcast_object_list", broadcast_object_list)

    def ctx(rank, pp):
        return types.SimpleNamespace(rank=rank, layout=types.SimpleNamespace(pp=pp, tp=1, data_parallel=2))

    owned = {"ppo/clip_frac": 0.5}
    assert train_step.stats_for_rank0(ctx(0, 1), owned) == owned
    assert train_step.stats_for_rank0(ctx(1, 1), None) == {}
    assert sent == []
    assert train_step.stats_for_rank0(ctx(0, 2), None) == {"ppo/clip_frac": 0.25}
    assert sent == [2]  # the last stage's TP and DP rank 0 (Megatron's rank order)


def test_the_finiteness_check_reads_sums_first_and_confirms_element_by_element(local_all_reduce):
    """Finite elements whose fp32 sum overflows are finite (the element-wise check confirms a suspect sum); a
    NaN in a bf16 parameter or an infinity in a buffer is not."""
    model = torch.nn.Linear(2, 2, bias=False)
    model.register_buffer("bias_counts", torch.zeros(3))
    with torch.no_grad():
        model.weight.fill_(3e38)  # every element finite, their sum is not
    assert learner.weights_finite(model)
    model.bias_counts[1] = float("inf")
    assert not learner.weights_finite(model)
    model.bias_counts[1] = 0.0
    model.to(torch.bfloat16)
    with torch.no_grad():
        model.weight[1, 0] = float("nan")
    assert not learner.weights_finite(model)


@pytest.mark.parametrize("last", [True, False])
def test_a_failed_last_save_still_writes_the_final_export_and_raises_the_saves_error(monkeypatch, caplog, last):
    def failing_save(*args, **kwargs):
        raise CheckpointError("saving the checkpoint of step 5 failed: OSError: [Errno 28] No space left on device")

    exported = []
    monkeypatch.setattr(loop, "save_run_checkpoint", failing_save)
    monkeypatch.setattr(TrainerLoop, "export_hf", lambda self, folder, step: exported.append((folder, step)))
    run = _run(_cfg("checkpoint.save_dir=/ckpt", "steps=5"), step=4)
    run.spec = {"run_dir": "/runs/r"}
    run.learner = types.SimpleNamespace(check_weights=lambda step, doing: None)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.loop"), pytest.raises(CheckpointError):
        run.save_checkpoint(5, last=last)
    assert exported == ([(Path("/runs/r") / loop.FINAL_EXPORT_DIR, 5)] if last else [])
    assert ("the final policy is exported to /runs/r/hf" in caplog.text) == last
    assert run.saved_step == 4


def test_weights_that_are_not_finite_are_not_saved_as_a_checkpoint(monkeypatch, local_all_reduce):
    # A checkpoint becomes `latest` and older ones are pruned: a resume or a requeued job would load it.
    saved = []
    monkeypatch.setattr(loop, "save_run_checkpoint", lambda *args, **kwargs: saved.append(args[1]))
    model = torch.nn.Linear(2, 2, bias=False)
    run = _run(_cfg("checkpoint.save_dir=/ckpt", "steps=5"), step=3, rank0=False)
    fake = types.SimpleNamespace(state=types.SimpleNamespace(model=model))
    run.learner = types.SimpleNamespace(
        check_weights=lambda step, doing: learner.Learner.check_weights(fake, step, doing)
    )
    run.save_checkpoint(4)
    with torch.no_grad():
        model.weight[1, 1] = float("inf")
    with pytest.raises(learner.NonFiniteError, match="weights after step 5 are not finite: not saving them"):
        run.save_checkpoint(5, last=True)
    assert saved == [4] and run.saved_step == 4

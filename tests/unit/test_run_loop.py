"""The trainer-side run loop without processes: how rank 0's wait for a batch ends on every rank (a batch, the end
of the prompts, or rank 0's error), and how the launcher ends generation, refuses another run's save_dir."""

from __future__ import annotations

import asyncio
import logging
import time
import types

import pytest

from megatron_rl import launcher
from megatron_rl.config import load_config
from megatron_rl.config.trainer import COLLECTIVE_TIMEOUT_MARGIN_S
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
    monkeypatch.setattr(TrainerLoop, "save_checkpoint", lambda self, step: saved.append(step))
    run = _run(_cfg("checkpoint.save_dir=/ckpt", "task.epochs=2", "steps=50"), step=7)
    run.saved_step = 6
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.loop"):
        run.end_out_of_prompts()
    assert saved == [7]
    assert "prompt stream exhausted after step 7 (task.epochs=2)" in caplog.text
    run.metrics = types.SimpleNamespace(close=lambda: None)
    run.close()
    assert run.control._obj.reports == [("done", 7, "prompt stream exhausted after step 7 (task.epochs=2)")]

    already = _run(_cfg("checkpoint.save_dir=/ckpt", "task.epochs=2"), step=8)  # saved by the loop (or resumed)
    already.end_out_of_prompts()
    unsaved = _run(_cfg("task.epochs=2"), step=9)  # no save_dir: nothing to save
    unsaved.end_out_of_prompts()
    assert saved == [7]


def test_run_loop_stops_cleanly_when_the_prompts_run_out(monkeypatch):
    class FakeRun:
        def __init__(self, cfg, spec):
            self.step, self.batches, self.calls = 0, 2, []
            self.learner = types.SimpleNamespace(step=lambda batch: {"loss": 0.0})
            self.sync = types.SimpleNamespace(push=lambda step: {"seconds": 0.0})

        def next_batch(self):
            self.batches -= 1
            return ["group"] if self.batches >= 0 else None

        def finish_step(self, step, *args):
            self.step = step
            self.calls.append(("step", step))

        def end_out_of_prompts(self):
            self.calls.append(("out of prompts", self.step))

        def close(self):
            self.calls.append(("close", self.step))
            made.append(self)

    made: list[FakeRun] = []
    monkeypatch.setattr(loop, "TrainerLoop", FakeRun)
    monkeypatch.setattr(loop, "to_train_batch", lambda groups, cfg, learner: groups)
    loop.run_loop(_cfg("steps=5"), {})
    assert made[0].calls == [("step", 1), ("step", 2), ("out of prompts", 2), ("close", 2)]


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


def test_a_generation_error_while_the_trainer_runs_stops_it():
    driver, supervisor, trainer = Stoppable(RuntimeError("engine gone")), Stoppable(), FakeTrainer(10**9)
    with pytest.raises(GenerationError, match="generation failed: RuntimeError: engine gone"):
        asyncio.run(launcher._drive(driver, supervisor, trainer, poll_s=0.01))
    assert trainer.stopped and supervisor.cancelled


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

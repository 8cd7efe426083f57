"""The launcher's watch over the trainer (`TrainerWatch`, `LocalTrainerJob`, `ExternalTrainerJob`): a trainer that
goes silent, or whose rank 0 stays in one phase past `trainer.stall_timeout_s`, is lost, with a message naming how
long and at what; one that reports a long phase is not. Run control is the real `RunControl` object (its Ray
actor and the heartbeat thread are tested in tests/distributed/test_run_control.py); the local job is a real
process."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time

import pytest

from megatron_rl.config import load_config
from megatron_rl.launcher import ExternalTrainerJob, LocalTrainerJob
from megatron_rl.parallel.torchrun import LaunchError
from megatron_rl.rollout.control import TrainerWatch
from tests.support.async_control import AsyncControl


def _look(watch: TrainerWatch) -> dict:
    return asyncio.run(watch.look())


def test_a_long_phase_with_beats_is_neither_silence_nor_a_stall_until_its_bound():
    control = AsyncControl()
    watch = TrainerWatch(control, silence_s=0.8, stall_s=1.5, every_s=0.0)
    control.control.report_trainer("starting", 0, "building the model and loading its weights", 0.0)
    for _ in range(4):  # beats every 0.3 s, the same phase: its age grows, the silence does not
        time.sleep(0.3)
        control.control.report_trainer("starting", 0, "building the model and loading its weights", 0.3 * (_ + 1))
        status = _look(watch)
        assert watch.lost(status) is None, status
    assert status["age_s"] < 0.3 and 1.1 < status["phase_s"] < 1.5
    time.sleep(0.4)
    lost = watch.lost(_look(watch))  # still heard from 0.4 s ago, but 1.6 s at one thing
    assert lost is not None and lost.startswith(
        "trainer stuck at 'building the model and loading its weights' for 2 s (> trainer.stall_timeout_s=2 s)"
        " in state 'starting' after step 0"
    ), lost


def test_between_fetches_the_last_status_ages_on_its_own_clock():
    control = AsyncControl()
    control.control.report_trainer("running", 5, "training step 6", 10.0)
    watch = TrainerWatch(control, silence_s=100.0, stall_s=100.0, every_s=0.5)
    time.sleep(0.55)
    first = _look(watch)  # fetched
    control.control.report_trainer("running", 6, "training step 7", 0.0)  # not seen until the next fetch
    time.sleep(0.3)
    cached = _look(watch)
    assert (first["step"], cached["step"]) == (5, 5) and cached["message"] == "training step 6"
    assert 0.25 < cached["age_s"] - first["age_s"] < 0.4 and 0.25 < cached["phase_s"] - first["phase_s"] < 0.4
    assert 10.5 < cached["phase_s"] < 11.0, cached
    time.sleep(0.25)
    assert _look(watch)["step"] == 6  # the next fetch


def test_a_silent_trainer_is_lost_naming_what_it_last_did_and_a_failed_status_call_only_delays_it(caplog):
    control = AsyncControl()
    watch = TrainerWatch(control, silence_s=0.6, stall_s=100.0, every_s=0.0)
    control.control.report_trainer("running", 3, "training step 4", 0.0)
    assert watch.lost(_look(watch)) is None
    control.failing = True
    with caplog.at_level(logging.WARNING, logger="megatron_rl.rollout.control"):
        status = _look(watch)
    assert "could not read the trainer's status from run control: ConnectionError" in caplog.text
    assert (status["state"], status["step"], watch.lost(status)) == ("running", 3, None)  # the last one kept
    time.sleep(0.7)
    lost = watch.lost(_look(watch))
    assert lost is not None and lost.startswith("trainer silent for 1 s (> 1 s, from trainer.timeout_s) in state")
    assert "after step 3, last at 'training step 4'" in lost


def test_an_ended_trainer_is_not_lost_and_later_beats_do_not_hide_its_end():
    control = AsyncControl()
    watch = TrainerWatch(control, silence_s=100.0, stall_s=0.1, every_s=0.0)
    control.control.report_trainer("running", 7, "pushing the weights of step 8", 50.0)
    control.control.report_failure("rank 0: SyncError: engine-0 gone")
    control.control.report_trainer("running", 7, "pushing the weights of step 8", 51.0)  # a beat sent meanwhile
    status = _look(watch)
    assert watch.ended(status) and status["state"] == "failed" and watch.lost(status) is None
    job = ExternalTrainerJob(watch)
    assert asyncio.run(job.finished())
    with pytest.raises(LaunchError, match="trainer failed after step 7: rank 0: SyncError: engine-0 gone"):
        job.check()


def test_the_external_job_names_a_silent_trainer():
    control = AsyncControl()
    job = ExternalTrainerJob(TrainerWatch(control, silence_s=0.3, stall_s=100.0, every_s=0.0))
    control.control.report_trainer("running", 2, "waiting for the batch of step 3", 0.0)
    assert not asyncio.run(job.finished())
    time.sleep(0.4)
    assert asyncio.run(job.finished())
    with pytest.raises(LaunchError, match=r"trainer silent for 0 s \(> 0 s.*after step 2.*is its torchrun job alive"):
        job.check()


def test_a_local_job_whose_rank0_is_stuck_is_lost_and_stopped_while_its_processes_run(tmp_path):
    control = AsyncControl()
    control.control.report_trainer("running", 4, "training step 5", 30.0)
    proc = subprocess.Popen(["sleep", "120"], start_new_session=True)  # the torchrun job, alive
    job = LocalTrainerJob(proc, tmp_path / "trainer.log", TrainerWatch(control, 100.0, stall_s=20.0, every_s=0.0))
    try:
        assert asyncio.run(job.finished())
        with pytest.raises(LaunchError, match=r"trainer stuck at 'training step 5' for 30 s.*after step 4"):
            job.check()  # at once: not waiting for a process that does not end
    finally:
        job.stop()
    assert proc.poll() is not None


def test_a_local_job_ends_with_its_processes(tmp_path):
    control = AsyncControl()
    control.control.report_trainer("running", 1, "training step 2", 0.0)
    healthy = TrainerWatch(control, 100.0, 100.0, every_s=0.0)
    done = LocalTrainerJob(subprocess.Popen(["true"], start_new_session=True), tmp_path / "trainer.log", healthy)
    done.proc.wait(30)
    assert asyncio.run(done.finished())
    done.check()
    (tmp_path / "trainer.log").write_text("[rank1]: RuntimeError: out of memory\n")
    failed = LocalTrainerJob(subprocess.Popen(["false"], start_new_session=True), tmp_path / "trainer.log", healthy)
    failed.proc.wait(30)
    assert asyncio.run(failed.finished())
    with pytest.raises(LaunchError, match="failed \\(exit 1\\)"):
        failed.check()


def test_the_stall_bound_leaves_room_for_every_bounded_wait():
    cfg = load_config("configs/quickstart.yaml")
    assert cfg.trainer.stall_timeout_s is None and cfg.stall_timeout_s == 3600.0
    # trainer.timeout_s + 120 = 720; a restart 120 + 600 = 720; the weight groups and a push 4 x 300 + 30 = 1230
    assert cfg.phase_wait_s == 1230.0
    slow = load_config("configs/quickstart.yaml", ["rollout.restart_timeout_s=3000"])
    assert slow.stall_timeout_s == 2 * (120 + 3000)  # twice the longest wait, when over 3600
    assert load_config("configs/quickstart.yaml", ["trainer.stall_timeout_s=1290"]).stall_timeout_s == 1290
    with pytest.raises(Exception, match=r"trainer.stall_timeout_s=1000 must exceed by 60 s the 1230 s"):
        load_config("configs/quickstart.yaml", ["trainer.stall_timeout_s=1000"])
    evaluating = ["eval.interval=5", "eval.timeout_s=2000"]
    with pytest.raises(Exception, match=r"the 2000 s that the other timeouts let"):
        load_config("configs/quickstart.yaml", [*evaluating, "trainer.stall_timeout_s=1500"])

"""The run-control actor on a real local Ray: it survives its process being killed (Ray restarts it with its
state), and the trainer's heartbeat reports its phase for its whole life, so a long phase (a checkpoint's load, a
save, a weight-sync recovery) is not silence; near the stall bound it writes where the main thread is."""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil
import pytest
import ray

from megatron_rl.rollout.buffer import make_buffer_actor
from megatron_rl.rollout.control import TrainerHeartbeat, make_control_actor
from megatron_rl.trainer.loop import connect_rank0

pytestmark = pytest.mark.usefixtures("local_ray")


def _actor_process(actor) -> psutil.Process:
    """The process of this very actor (asked through Ray: never another run's actor on a shared machine)."""
    return psutil.Process(ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60))


def test_run_control_comes_back_with_its_state_after_its_process_dies():
    control = make_control_actor([("engine-0", 1), ("engine-1", 2)], name="control-under-test")
    ray.get(control.report_trainer.remote("running", 7, "step 7"), timeout=60)
    ray.get(control.engine_down.remote("engine-1", "killed"), timeout=60)
    assert ray.get(control.engine_restarted.remote("engine-1"), timeout=60) == 1
    ray.get(control.engine_down.remote("engine-0", "hung"), timeout=60)
    victim = _actor_process(control)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait(30)
    roster = ray.get(control.roster.remote(), timeout=120)  # retried on the restarted actor
    assert _actor_process(control).pid != victim.pid
    assert roster == {
        "epoch": 1, "engines": [["engine-0", 1], ["engine-1", 2]], "down": {"engine-0": "hung"},
        "restarts": {"engine-1": 1},
    }  # fmt: skip
    status = ray.get(control.trainer_status.remote(), timeout=60)
    assert status["state"] == "running" and status["step"] == 7 and status["message"] == "step 7"
    assert ray.get(control.engine_restarted.remote("engine-0"), timeout=60) == 2  # and it goes on from there


def test_heartbeat_reports_the_phase_and_its_age_for_the_trainers_whole_life():
    control = make_control_actor([("engine-0", 1)], name="control-heartbeat")
    heartbeat = TrainerHeartbeat(control, interval_s=0.3).start()
    heartbeat.phase(0, "building the model and loading its weights", state="starting")
    ages, phases = [], []
    for _ in range(8):  # the main thread busy in one long phase: the beats go on
        time.sleep(0.4)
        status = ray.get(control.trainer_status.remote(), timeout=60)
        ages.append(status["age_s"])
        phases.append(status["phase_s"])
    assert max(ages) < 1.0, ages  # without the beats the age would reach 3.2 s
    assert status["state"] == "starting" and status["message"] == "building the model and loading its weights"
    assert phases == sorted(phases) and phases[-1] > 2.5, phases  # how long it has been at it
    heartbeat.phase(3, "training step 4")
    time.sleep(0.8)
    status = ray.get(control.trainer_status.remote(), timeout=60)
    assert (status["state"], status["step"], status["message"]) == ("running", 3, "training step 4")
    assert status["phase_s"] < 1.5, status  # a new phase starts its clock again
    heartbeat.stop("done", "all steps")
    time.sleep(1.0)
    status = ray.get(control.trainer_status.remote(), timeout=60)
    assert (status["state"], status["step"], status["message"]) == ("done", 3, "all steps")
    assert status["age_s"] > 0.9  # no beat after the end
    quiet = TrainerHeartbeat(None).start()  # the other ranks: nothing to report to
    quiet.phase(1, "training step 2")
    quiet.stop("done")


def test_trainer_rank0_beats_from_before_its_model_is_built():
    control = make_control_actor([("engine-0", 1)], name="control-rank0")
    held = make_buffer_actor(capacity=4, max_staleness=1, stale_policy="drop", name="buffer-rank0")  # noqa: F841
    spec = {"ray_address": "auto", "buffer": "buffer-rank0", "control": "control-rank0"}
    buffer, found, heartbeat = connect_rank0(spec)
    try:
        deadline, status = time.monotonic() + 10, {}
        while status.get("message") != "building the model and loading its weights" and time.monotonic() < deadline:
            time.sleep(0.1)
            status = ray.get(control.trainer_status.remote(), timeout=60)
        assert (status["state"], status["step"], status["message"]) == (
            "starting",
            0,
            "building the model and loading its weights",
        ), status  # reported by the heartbeat's first beat, at once
        assert ray.get(found.roster.remote(), timeout=60)["engines"] == [["engine-0", 1]]
        assert ray.get(buffer.stats.remote(), timeout=60)["buffered"] == 0
    finally:
        heartbeat.stop()


def _sitting_in_a_long_phase(seconds: float) -> None:
    time.sleep(seconds)


def test_heartbeat_writes_every_threads_stack_once_per_phase_as_it_nears_the_stall_bound(capfd, caplog):
    control = make_control_actor([("engine-0", 1)], name="control-stacks")
    heartbeat = TrainerHeartbeat(control, interval_s=0.2, stall_s=1.0).start()
    try:
        heartbeat.phase(4, "training step 5")
        _sitting_in_a_long_phase(0.5)  # far from the bound: nothing written
        assert "most recent call first" not in capfd.readouterr().err
        with caplog.at_level(logging.ERROR, logger="megatron_rl.rollout.control"):
            _sitting_in_a_long_phase(1.5)  # past stall_s - interval_s, several beats: one dump
        err = capfd.readouterr().err
        assert err.count("Current thread") + err.count("Thread 0x") >= 2, err  # the main and the beating thread
        assert "_sitting_in_a_long_phase" in err and "test_heartbeat_writes_every_threads_stack" in err, err
        assert err.count("_sitting_in_a_long_phase") == 1, err  # once for the phase, not at every beat
        assert any(
            "at 'training step 5'" in r.getMessage() and "stall_timeout_s" in r.getMessage() for r in caplog.records
        )
        heartbeat.phase(5, "saving the checkpoint of step 5")  # a new phase: its own dump when it nears the bound
        _sitting_in_a_long_phase(1.2)
        assert "_sitting_in_a_long_phase" in capfd.readouterr().err
    finally:
        heartbeat.stop()

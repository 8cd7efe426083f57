"""The run-control actor on a real local Ray: it survives its process being killed (Ray restarts it with its
state), and the trainer's heartbeat keeps the launcher's watchdog fed through a long block (a checkpoint save, a
weight-sync recovery)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import ray

from megatron_rl.rollout.control import TrainerHeartbeat, make_control_actor

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


def test_heartbeat_feeds_the_watchdog_while_a_long_block_runs():
    control = make_control_actor([("engine-0", 1)], name="control-heartbeat")
    ray.get(control.report_trainer.remote("running", 3), timeout=60)
    ages = []
    with TrainerHeartbeat(control, interval_s=0.3).during(3, "saving the checkpoint of step 3"):
        for _ in range(8):
            time.sleep(0.4)
            ages.append(ray.get(control.trainer_status.remote(), timeout=60)["age_s"])
        status = ray.get(control.trainer_status.remote(), timeout=60)
    assert max(ages) < 1.0, ages  # without the heartbeat the age would reach 3.2 s
    assert status["message"] == "saving the checkpoint of step 3" and status["step"] == 3
    time.sleep(1.0)
    assert ray.get(control.trainer_status.remote(), timeout=60)["age_s"] > 0.9  # it stops with the block
    with TrainerHeartbeat(None).during(3, "not rank 0"):  # the other ranks: nothing to report to
        pass

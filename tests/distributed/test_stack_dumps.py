"""Where a hung torchrun job's ranks are, in its log, before it is killed: the launcher's lost trainer
(`LocalTrainerJob`) and a worker past its deadline (`run_torchrun`) signal the ranks (`signal_for_stacks`), which
write every thread's stack (`enable_stack_dumps`). Real torchrun, two real gloo ranks: rank 0 hangs in a barrier
that rank 1 never joins."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.launcher import LocalTrainerJob
from megatron_rl.parallel.processes import STACK_SIGNAL, handles, stop_process_group
from megatron_rl.parallel.torchrun import LaunchError, run_torchrun, start_torchrun
from megatron_rl.rollout.control import TrainerWatch
from tests.support.async_control import AsyncControl

WORKER = "tests.support.stuck_ranks"


def _wait_ready(prefix: Path, ranks: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(Path(f"{prefix}{r}").exists() for r in range(ranks)):
        assert time.monotonic() < deadline, "the stuck ranks did not start"
        time.sleep(0.2)


def _assert_gone(prefix: Path, ranks: int) -> None:
    """Every rank's process has ended (torchrun starts them in sessions of their own: the agent's group is not
    enough)."""
    for r in range(ranks):
        pid = int(Path(f"{prefix}{r}").read_text())
        try:
            psutil.Process(pid).wait(30)
        except psutil.NoSuchProcess:
            pass


def _assert_both_ranks_stacks(text: str) -> None:
    assert text.count("most recent call first") >= 2, text[-3000:]
    assert "in rank0_waits_in_a_barrier" in text and "in rank1_stuck_elsewhere" in text, text[-3000:]
    assert text.index("in rank0_waits_in_a_barrier") < text.index("in rank1_stuck_elsewhere")  # in RANK order


def test_a_lost_local_trainer_writes_every_ranks_stack_to_its_log_before_it_is_stopped(tmp_path):
    log = tmp_path / "trainer.log"
    job = LocalTrainerJob(
        start_torchrun(WORKER, [str(tmp_path / "ready-")], 2, log), log,
        TrainerWatch(control := AsyncControl(), 100.0, stall_s=20.0, every_s=0.0),
    )  # fmt: skip
    try:
        _wait_ready(tmp_path / "ready-", 2)
        assert "most recent call first" not in log.read_text()
        control.control.report_trainer("running", 4, "training step 5", 30.0)
        assert asyncio.run(job.finished())
        with pytest.raises(LaunchError, match=r"stuck at 'training step 5'.*Python stacks.*end of its log"):
            job.check()
        _assert_both_ranks_stacks(log.read_text())
    finally:
        job.stop()
    assert job.proc.poll() is not None
    _assert_gone(tmp_path / "ready-", 2)


def test_a_worker_past_its_deadline_is_killed_with_every_ranks_stack_in_its_output(tmp_path):
    ready = tmp_path / "ready-"
    with pytest.raises(LaunchError, match="past its 30 s deadline") as raised:
        run_torchrun(WORKER, [str(ready)], 2, timeout_s=30, log_path=tmp_path / "log.txt")
    assert Path(f"{ready}1").exists(), (tmp_path / "log.txt").read_text()[-3000:]  # it got as far as hanging
    _assert_both_ranks_stacks((tmp_path / "log.txt").read_text())
    assert "rank1_stuck_elsewhere" in str(raised.value)  # the error's tail shows it too
    _assert_gone(ready, 2)


def test_stopping_a_job_whose_agent_cannot_pass_the_signal_on_still_ends_every_rank(tmp_path):
    """torchrun starts each rank in a session of its own: the agent's process group alone misses them."""
    proc = start_torchrun(WORKER, [str(tmp_path / "ready-")], 2, tmp_path / "trainer.log")
    try:
        _wait_ready(tmp_path / "ready-", 2)
        os.kill(proc.pid, signal.SIGSTOP)  # a hung agent: SIGTERM waits, SIGKILL ends it, its ranks hear nothing
        stop_process_group(proc, grace_s=1.0)
        assert proc.poll() is not None
        _assert_gone(tmp_path / "ready-", 2)
    finally:
        stop_process_group(proc, grace_s=1.0)


def test_only_a_process_that_handles_the_signal_is_sent_it():
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dumping = subprocess.Popen(
        [sys.executable, "-c", DUMPING], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert dumping.stdout.readline().strip() == "ready"
        assert handles(dumping.pid, STACK_SIGNAL) and not handles(plain.pid, STACK_SIGNAL)
        assert not handles(os.getpid(), signal.SIGKILL)
    finally:
        plain.kill()
        dumping.kill()


DUMPING = """
import time
from megatron_rl.parallel.processes import enable_stack_dumps
enable_stack_dumps()
print("ready", flush=True)
time.sleep(60)
"""

"""Real faults in a real run: a trainer rank is SIGKILLed during a checkpoint save, an engine is SIGKILLed or
SIGSTOPped, the run-control or the buffer actor is SIGKILLed, the disk fills up during a save.

- A dead trainer rank ends the whole job non-zero, in bounded time, with a message that names the rank; killed
  during a checkpoint save, `--resume` continues from the previous checkpoint, and in `sync` mode the resumed run's
  losses equal an uninterrupted run's.
- A dead or hung (alive, silent) engine is restarted, brought to the current weights and its prompts re-queued:
  the run finishes every step, the buffer's exactly-once accounting holds, and the restart's reason is logged.
- A full disk during a save fails the run saying that the previous checkpoint is intact; it is, and resumes.
- The run-control actor is restarted by Ray with its state: the run finishes. The buffer actor's death stops the
  run with an error naming it; `--resume` finishes it from the last checkpoint with nothing lost.

Processes are found among the run's own descendants (the launcher starts the run's Ray), never another run's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.metrics.logger import read_metrics
from tests.support.processes import descendants, titled_below

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

REPO = Path(__file__).resolve().parents[2]


def _train_command(tmp_path: Path, name: str, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "configs/quickstart.yaml"),
        f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", f"name={name}", *overrides, "--json",
    ]  # fmt: skip


def _run(cmd: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def _trainer_rank(launcher_pid: int, rank: int) -> psutil.Process | None:
    """The torchrun worker process of `rank` under the launcher (not the torchrun agent itself)."""
    for proc in descendants(launcher_pid):
        try:
            if "megatron_rl.trainer.loop" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == str(rank):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_metrics(run_dir / "metrics.jsonl")}


def _latest(save_dir: Path) -> str | None:
    marker = save_dir / "latest"
    return marker.read_text().strip() if marker.exists() else None


def _saving(save_dir: Path, step: int) -> bool:
    """Whether the save of `step` has begun (its staging folder, or its step folder before `latest` names it)."""
    staging, final = save_dir / f".step_{step:08d}.partial", save_dir / f"step_{step:08d}"
    return staging.exists() or (final.exists() and _latest(save_dir) != final.name)


@pytest.mark.slow
def test_trainer_killed_during_a_save_fails_the_job_and_resumes_from_the_previous_checkpoint(tmp_path):
    """In `sync` mode (with the KL penalty to a frozen reference model, which a resume rebuilds too): rank 1 is
    frozen (SIGSTOP) as soon as the save of step 4 has begun, so that the save cannot finish, then SIGKILLed."""
    sync = ["mode=sync", "steps=4", "checkpoint.save_interval=2", "algorithm.kl_coef=0.05"]
    straight = _run(_train_command(tmp_path, "straight", *sync, f"checkpoint.save_dir={tmp_path}/ckpt-straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["staleness/max"] for r in records] == [0, 0, 0, 0]  # sync: never trained on older weights
    assert records[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert records[-1]["kl/ref"] > 0
    _resume_past_a_corrupted_checkpoint(tmp_path, sync)

    save_dir = tmp_path / "ckpt-faulty"
    cmd = _train_command(tmp_path, "faulty", *sync, f"checkpoint.save_dir={save_dir}")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _latest(save_dir) == "step_00000002", 600, "the step-2 checkpoint", proc)
        victim = _trainer_rank(proc.pid, 1)
        assert victim is not None, "trainer rank 1 not found"
        deadline = time.monotonic() + 600
        while not _saving(save_dir, 4):
            assert proc.poll() is None and time.monotonic() < deadline, "the save of step 4 never began"
            time.sleep(0.02)
        victim.send_signal(signal.SIGSTOP)  # rank 0 now waits for it in the save's next collective
        time.sleep(1.0)
        assert _latest(save_dir) == "step_00000002", "the save of step 4 finished before rank 1 was stopped"
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=180)  # bounded: the job must not hang on the dead rank
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 180
    assert "rank 1" in err and "SIGKILL" in err, err[-3000:]
    assert _latest(save_dir) == "step_00000002" and not (save_dir / "step_00000004" / "run_state.json").exists()

    resumed = _run(cmd + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "faulty" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == str(save_dir / "step_00000002")
    expected, got = _losses(tmp_path / "straight"), _losses(tmp_path / "faulty")
    assert sorted(got) == [1, 2, 3, 4]
    assert got == expected, f"resumed {got} != uninterrupted {expected}"
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def _resume_past_a_corrupted_checkpoint(tmp_path: Path, sync: list[str]) -> None:
    """The finished `straight` run's step-4 checkpoint has a byte of a shard flipped: `--resume` fails naming the
    file and the step-2 checkpoint; `checkpoint.resume_step=2` resumes from that one, moves the step-4 folder aside
    and repeats steps 3-4 bit for bit."""
    save_dir = tmp_path / "ckpt-straight"
    expected = _losses(tmp_path / "straight")
    shard = max((save_dir / "step_00000004").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    cmd = _train_command(tmp_path, "straight", *sync, f"checkpoint.save_dir={save_dir}", "--resume")
    refused = _run(cmd)
    assert refused.returncode != 0
    assert f"{shard.name}: corrupted" in refused.stderr, refused.stderr[-3000:]
    assert "also holds the checkpoints of steps 2: checkpoint.resume_step=<step>" in refused.stderr
    resumed = _run([*cmd, "checkpoint.resume_step=2"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    assert summary["resumed_from"] == str(save_dir / "step_00000002")
    assert _losses(tmp_path / "straight") == expected
    assert _latest(save_dir) == "step_00000004"  # saved anew; the corrupted one moved aside, kept
    assert [p.parent.parent.name for p in save_dir.glob("*/*/step_00000004")] == ["abandoned"]


@pytest.mark.slow
def test_dead_engine_is_restarted_resynced_and_its_prompts_requeued(tmp_path):
    run_dir = tmp_path / "engine-fault"
    steps = 10  # enough that the run is still generating when the engine dies after its first step
    cmd = _train_command(tmp_path, "engine-fault", "mode=async", f"steps={steps}")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 1, 600, "a trained step", proc)
        engine = titled_below(proc.pid, "ray::VLLMEngine")
        assert engine is not None, "no ray::VLLMEngine process found"
        engine.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["engine_restarts"] == {"engine-0": 1}, "the engine was not killed while the run needed it"
    acc = summary["accounting"]  # exactly once: every prompt produced is consumed, dropped, buffered or in flight
    assert acc["produced"] == acc["consumed"] + acc["dropped"] + acc["buffered"] + acc["in_flight"]
    assert acc["consumed"] == steps * 8
    driver = summary["driver"]
    assert driver["requeued"] == driver["engine_failures"]  # every prompt of a failed request went back
    (reason,) = summary["engine_restart_reasons"]["engine-0"]
    if not reason.startswith("health probe"):  # found by a failed request (else by the probe, e.g. during a push)
        assert driver["requeued"] >= 1
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[-1]["sync/resyncs"] >= 1
    assert all(r["version"] == r["step"] for r in records)


def _exactly_once(summary: dict, steps: int) -> None:
    acc = summary["accounting"]  # every prompt produced is consumed, dropped, buffered or in flight
    assert acc["produced"] == acc["consumed"] + acc["dropped"] + acc["buffered"] + acc["in_flight"]
    assert acc["consumed"] == steps * 8


@pytest.mark.slow  # the default suite has its cheap twin: tests/distributed/test_supervisor.py's hung engine
def test_hung_engine_is_killed_restarted_and_its_prompts_requeued(tmp_path):
    """SIGSTOP: the engine is alive but answers nothing; past rollout.hang_timeout_s it is taken for dead."""
    run_dir = tmp_path / "engine-hang"
    steps = 6
    cmd = _train_command(tmp_path, "engine-hang", "mode=async", f"steps={steps}", "rollout.hang_timeout_s=20")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 1, 600, "a trained step", proc)
        engine = titled_below(proc.pid, "ray::VLLMEngine")
        assert engine is not None, "no ray::VLLMEngine process found"
        engine.send_signal(signal.SIGSTOP)
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert not psutil.pid_exists(engine.pid) or engine.status() == psutil.STATUS_ZOMBIE  # killed, not left stopped
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["engine_restarts"] == {"engine-0": 1}
    (reason,) = summary["engine_restart_reasons"]["engine-0"]
    assert "hung: answered no health probe" in reason and "rollout.hang_timeout_s" in reason, reason
    assert "hung: answered no health probe" in (run_dir / "logs" / "launcher.log").read_text()  # the reason logged
    _exactly_once(summary, steps)
    assert summary["driver"]["requeued"] == summary["driver"]["engine_failures"]
    assert all(r["version"] == r["step"] for r in read_metrics(run_dir / "metrics.jsonl"))


@pytest.mark.slow
def test_run_control_actor_killed_mid_run_is_restarted_and_the_run_finishes(tmp_path):
    run_dir = tmp_path / "control-fault"
    steps = 5
    cmd = _train_command(tmp_path, "control-fault", "mode=async", f"steps={steps}")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 2, 600, "two trained steps", proc)
        control = titled_below(proc.pid, "ray::RunControl")
        assert control is not None, "no ray::RunControl process found"
        control.send_signal(signal.SIGKILL)

        def restarted() -> bool:
            again = titled_below(proc.pid, "ray::RunControl")
            return again is not None and again.pid != control.pid

        _wait_for(restarted, 120, "Ray to restart the run control", proc)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    _exactly_once(summary, steps)


@pytest.mark.slow
def test_buffer_actor_death_stops_the_run_clearly_and_resume_finishes_it(tmp_path):
    """The buffer holds the rollouts (it is checkpointed, not replicated): its death ends the run with an error
    that names it, and `--resume` continues from the last checkpoint, counting every prompt once. One step ahead
    with a bound of 1: the resumed gate opens once the trainer brought the fresh engines to step 3's weights, so
    nothing is generated on the start-up ones (it would be 2 versions old and dropped). Here the step's prompts
    are usually all back before the save; tests/unit/test_buffer.py resumes with prompts in flight."""
    run_dir, save_dir, steps = tmp_path / "buffer-fault", tmp_path / "ckpt", 6
    cmd = _train_command(
        tmp_path, "buffer-fault", "mode=one_step_off", "buffer.max_staleness=1", f"steps={steps}",
        "checkpoint.save_interval=3", f"checkpoint.save_dir={save_dir}",
    )  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _latest(save_dir) == "step_00000003", 600, "the step-3 checkpoint", proc)
        buffer = titled_below(proc.pid, "ray::RolloutBuffer")
        assert buffer is not None, "no ray::RolloutBuffer process found"
        killed_at = time.monotonic()
        buffer.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "killed-run.stderr").write_text(err)  # kept for a post-mortem
    assert proc.returncode != 0 and time.monotonic() - killed_at < 300
    assert "RolloutBuffer" in err or "rollout-buffer" in err, err[-3000:]
    resumed = _run(cmd + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == str(save_dir / "step_00000003")
    _exactly_once(summary, steps)  # every step's batch consumed once: nothing lost, nothing trained twice
    assert summary["accounting"]["dropped"] == 0, summary["accounting"]  # none generated on the start-up weights
    steps_logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    # Step 3's line is missing when the buffer died between its checkpoint and its metrics (trainer/loop.py
    # logs a step after its weight push, which follows the save).
    assert steps_logged[-3:] == [4, 5, 6] and set(steps_logged) <= set(range(1, steps + 1))


FULL_DISK = """
mount -t tmpfs -o size="$SIZE_MB"m mrl-full-disk "$SAVE_DIR" || exit 97
"$@"
rc=$?
cp -a "$SAVE_DIR"/. "$COPY_TO"/
exit $rc
"""
"""Run the command with SAVE_DIR on a small tmpfs, in a private mount namespace (`unshare -m`: the mount cannot
outlive the command nor be seen outside), and copy what it holds to COPY_TO at the end."""


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare (tmpfs)")
def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_so(tmp_path):
    save_dir, kept = tmp_path / "small-disk", tmp_path / "kept"
    save_dir.mkdir()
    kept.mkdir()
    size_mb = 16  # one checkpoint of the quickstart model (model, optimizer: about 10.5 MB) fits, two do not
    cmd = _train_command(
        tmp_path, "full-disk", "mode=sync", "steps=4", "checkpoint.save_interval=2", f"checkpoint.save_dir={save_dir}"
    )
    env = {**os.environ, "SIZE_MB": str(size_mb), "SAVE_DIR": str(save_dir), "COPY_TO": str(kept)}
    full = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", FULL_DISK, "full-disk", *cmd],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    (tmp_path / "full-disk-run.stderr").write_text(full.stderr)  # kept for a post-mortem
    assert full.returncode not in (0, 97), full.stderr[-3000:]
    message = full.stderr + full.stdout
    assert "saving the checkpoint of step 4 failed" in message, message[-3000:]
    assert f"the previous checkpoint {save_dir}/step_00000002 is intact" in message
    assert sorted(p.name for p in kept.iterdir()) == ["latest", "step_00000002"]  # the partial one was removed
    # Usable: a resume from it (on a disk with room) finishes the run.
    cmd = [w.replace(str(save_dir), str(kept)) for w in cmd]
    resumed = _run(cmd + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "full-disk" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from"] == str(kept / "step_00000002")

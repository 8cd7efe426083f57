"""Real faults in a real run: a trainer rank or an engine process is SIGKILLed mid-run.

- A dead trainer rank ends the whole job non-zero, in bounded time, with a message that names the rank; `--resume`
  continues from the last checkpoint, and in `sync` mode the resumed run's losses equal an uninterrupted run's.
- A dead engine is restarted, brought to the current weights and its prompts re-queued: the run finishes every
  step, and the buffer's exactly-once accounting holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.metrics.logger import read_metrics

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


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _trainer_rank(launcher_pid: int, rank: int) -> psutil.Process | None:
    """The torchrun worker process of `rank` under the launcher (not the torchrun agent itself)."""
    for proc in _descendants(launcher_pid):
        try:
            if "megatron_rl.trainer.loop" in " ".join(proc.cmdline()) and proc.environ().get("RANK") == str(rank):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _engine_actor() -> psutil.Process | None:
    """The Ray actor process of the vLLM engine (Ray titles it `ray::VLLMEngine...`)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if cmdline.startswith("ray::VLLMEngine"):
            return proc
    return None


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/total"] for r in read_metrics(run_dir / "metrics.jsonl")}


def test_dead_trainer_rank_fails_the_job_and_resume_reproduces_the_losses(tmp_path):
    """In `sync` mode (with the KL penalty to a frozen reference model, which a resume rebuilds too)."""
    sync = ["mode=sync", "steps=4", "checkpoint.save_interval=2", "algorithm.kl_coef=0.05"]
    straight = _run(_train_command(tmp_path, "straight", *sync, f"checkpoint.save_dir={tmp_path}/ckpt-straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    assert [r["staleness/max"] for r in records] == [0, 0, 0, 0]  # sync: never trained on older weights
    assert records[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # the policy starts at the reference
    assert records[-1]["kl/ref"] > 0

    save_dir = tmp_path / "ckpt-faulty"
    cmd = _train_command(tmp_path, "faulty", *sync, f"checkpoint.save_dir={save_dir}")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (save_dir / "latest").exists(), 600, "the step-2 checkpoint", proc)
        victim = _trainer_rank(proc.pid, 1)
        assert victim is not None, "trainer rank 1 not found"
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=180)  # bounded: the job must not hang on the dead rank
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 180
    assert "rank 1" in err and "SIGKILL" in err, err[-3000:]

    resumed = _run(cmd + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4
    expected, got = _losses(tmp_path / "straight"), _losses(tmp_path / "faulty")
    assert sorted(got) == [1, 2, 3, 4]
    assert got == expected, f"resumed {got} != uninterrupted {expected}"


def test_dead_engine_is_restarted_resynced_and_its_prompts_requeued(tmp_path):
    run_dir = tmp_path / "engine-fault"
    steps = 10  # enough that the run is still generating when the engine dies after its first step
    cmd = _train_command(tmp_path, "engine-fault", "mode=async", f"steps={steps}")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 1, 600, "a trained step", proc)
        engine = _engine_actor()
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

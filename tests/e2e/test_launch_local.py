"""launch/torchrun.sh for real: Ray head, launcher (`--external-trainer`) and torchrun trainer as separate
processes on one machine (tiny model, gloo on CPU), the same split a SLURM job uses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
RAY_UP = re.compile(r"Ray head up \(pid (\d+), state (\S+)\)")


def launch(args: list[str], timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MRL_", "RAY_ADDRESS"))}
    env["MRL_PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", "launch/torchrun.sh", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )  # fmt: skip


def assert_ray_stopped(stderr: str) -> Path:
    """The private Ray head is gone, and so is its state folder after a clean run."""
    match = RAY_UP.search(stderr)
    assert match, stderr
    pid, state = int(match.group(1)), Path(match.group(2))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "Ray node" in stderr and "stopped" in stderr
    return state


@pytest.mark.slow
def test_torchrun_sh_runs_two_steps(tmp_path):
    result = launch(["configs/quickstart.yaml", "steps=2", f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny"])
    assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-5000:]}"
    run_dir = tmp_path / "quickstart"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(records) == 2
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    assert (run_dir / "trainer.log").exists() and (run_dir / "launcher.log").exists()
    assert not assert_ray_stopped(result.stderr).exists()


def test_torchrun_sh_fails_clearly_when_the_launcher_fails(tmp_path):
    # No checkpoint there and none to be made: the launcher stops before writing the trainer spec.
    result = launch(
        [
            "configs/quickstart.yaml",
            f"output_dir={tmp_path}",
            f"model.hf_path={tmp_path}/none",
            "model.make_tiny=false",
        ],
        timeout=300,
    )
    assert result.returncode != 0
    assert "the launcher exited (status 2) before writing" in result.stderr, result.stderr[-3000:]
    assert "no config.json there" in result.stdout  # the launcher's own error, passed through
    assert not (tmp_path / "quickstart" / "trainer.log").exists()  # the trainer never started
    state = assert_ray_stopped(result.stderr)
    assert f"Ray logs kept in {state}/ray" in result.stderr  # kept for a post-mortem after a failure
    if state.name.startswith("mrl-ray-"):
        shutil.rmtree(state, ignore_errors=True)

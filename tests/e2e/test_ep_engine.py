"""An expert-parallel engine in a real run (vLLM TP2 with `enable_expert_parallel`: each of its two workers hosts 4
of the tiny model's 8 experts and receives only those in every weight sync): SIGKILLed mid-run, it is restarted,
re-synced and its prompts requeued; the run finishes every step with nothing lost.

Processes are found among the run's own descendants (the launcher starts the run's Ray), never another run's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.metrics.logger import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.fault, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def _engine_actor(launcher_pid: int) -> psutil.Process | None:
    """The run's engine actor process (Ray titles it `ray::VLLMEngine...`)."""
    for proc in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith("ray::VLLMEngine"):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_expert_parallel_engine_killed_mid_run_is_restarted_and_resynced(tmp_path):
    run_dir, steps = tmp_path / "ep-fault", 6
    cmd = [
        sys.executable, "-m", "megatron_rl.cli", "train", str(REPO / "configs/quickstart.yaml"),
        f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "name=ep-fault", "mode=async", f"steps={steps}",
        "rollout.engine_tp=2", "rollout.engine_ep=true", "--json",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 900
        while _steps_logged(run_dir) < 1:
            assert proc.poll() is None, f"the run exited ({proc.returncode}): {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no step was trained"
            time.sleep(0.5)
        engine = _engine_actor(proc.pid)
        assert engine is not None, "no ray::VLLMEngine process found"
        engine.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
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
    assert summary["driver"]["requeued"] == summary["driver"]["engine_failures"]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[-1]["sync/resyncs"] >= 1  # the restarted engine's workers published their experts again
    assert all(r["version"] == r["step"] for r in records)
    # The engine's two workers each hosted half of the experts (vLLM's own log of its expert map).
    engine_log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("engine-*.log"))
    assert "Local/global number of experts: 4/8" in engine_log, engine_log[-3000:]

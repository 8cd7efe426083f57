"""The launcher's console: prefixed step lines with ETA, read from a metrics file being written; torn lines."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys

import pytest

from megatron_rl.metrics.console import PREFIX, Console, MetricsFollower, ThirdPartyOutput, step_line
from megatron_rl.metrics.logger import read_metrics


def test_step_line_shows_what_a_step_has():
    record = {"step": 3, "reward/mean": 0.8125, "staleness/mean": 2.0, "sync/seconds": 0.031, "flag": True}
    assert step_line(record, 50, 95.4) == "step 3/50 | reward 0.812 | stale 2.0 | sync 0.03s | ETA 1:35"
    assert step_line({"step": 1, "eval/reward_mean": 0.5}, 2, None) == "step 1/2 | eval 0.500"


def test_follower_prints_each_complete_record_once_with_an_eta(tmp_path):
    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()
    follower = MetricsFollower(path, total_steps=10, console=Console(out))
    assert follower.poll() == []  # no file yet
    with path.open("w") as f:
        f.write(json.dumps({"step": 1, "wall_s": 10.0, "reward/mean": 0.1}) + "\n")
        f.write(json.dumps({"step": 2, "wall_s": 12.0, "reward/mean": 0.2}) + "\n")
        f.write('{"step": 3, "wall_s": 1')  # being written
    assert [r["step"] for r in follower.poll()] == [1, 2]
    with path.open("a") as f:
        f.write('4.0, "reward/mean": 0.3}\n')
    assert [r["step"] for r in follower.poll()] == [3]
    with path.open("a") as f:  # an evaluation logged on its own: no step line, no effect on the ETA
        f.write(json.dumps({"step": 3, "wall_s": 99.0, "record": "eval", "eval/reward_mean": 0.5}) + "\n")
    assert [r.get("record") for r in follower.poll()] == ["eval"]
    assert follower.poll() == []
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and all(line.startswith(PREFIX + " step ") for line in lines)
    assert "ETA" not in lines[0] and lines[1].endswith("ETA 0:16") and lines[2].endswith("ETA 0:14")


def test_read_metrics_leaves_out_a_torn_last_line_and_names_a_bad_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_metrics(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(path)


def test_third_party_output_goes_to_the_file_and_ours_to_the_console(tmp_path):
    out = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        output = ThirdPartyOutput(Console(out))
        logging.getLogger("vllm.engine").warning("before the file is known")
        import warnings

        warnings.warn("a library's warning", UserWarning, stacklevel=1)
        path = output.to_file(tmp_path / "logs")
        logging.getLogger("ray").info("after")
        logging.getLogger("megatron_rl.rollout.driver").warning("engine-0 failed on prompt 3")
        for handler in logging.getLogger().handlers:
            handler.flush()
        text = path.read_text()
        assert "before the file is known" in text and "a library's warning" in text and "after" in text
        assert "engine-0 failed on prompt 3" in text
        assert out.getvalue() == f"{PREFIX} warning: engine-0 failed on prompt 3\n"
    finally:
        logging.captureWarnings(False)
        root.handlers, _ = saved
        root.setLevel(saved[1])
        logging.getLogger("megatron_rl").handlers = []


def test_report_command_draws_both_pictures(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [
        {"step": s, "reward/mean": s / 10, "staleness/mean": 1.0, "time/trainer_idle_frac": 0.1, "sync/seconds": 0.02}
        for s in range(1, 6)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 6, "rew')
    cmd = [sys.executable, "-m", "megatron_rl.cli", "report", str(run_dir), "--json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 5
    assert (run_dir / "report.png").stat().st_size > 20_000 and (run_dir / "reward_curve.png").stat().st_size > 10_000

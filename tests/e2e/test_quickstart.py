"""The main job: the CPU quickstart learns its task; the run's accounting and outputs are checked."""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import load_config
from megatron_rl.launcher import run_training
from megatron_rl.metrics.logger import read_metrics

pytestmark = pytest.mark.e2e


def test_quickstart_learns_within_ten_minutes(tmp_path):
    cfg = load_config("configs/quickstart.yaml", [f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny"])
    summary = run_training(cfg)
    run_dir = tmp_path / "quickstart"
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == cfg.steps
    assert records[0]["reward/mean"] < 0.3, "reward should start near chance (about 0.06)"
    best = max(r["reward/mean"] for r in records)
    assert best >= 0.9, [round(r["reward/mean"], 3) for r in records]
    assert summary["wall_seconds"] < 600
    # Exactly-once accounting of prompts at the end of the run (run_training also asserts it).
    acc = summary["accounting"]
    assert acc["produced"] == acc["consumed"] + acc["dropped"] + acc["buffered"] + acc["in_flight"]
    assert acc["consumed"] == cfg.steps * cfg.prompts_per_step
    assert (run_dir / "reward_curve.png").stat().st_size > 10_000
    for key in (
        "mismatch/k3_kl",
        "is/weight_mean",
        "is/ess",
        "ppo/clip_frac",
        "staleness/histogram",
        "time/trainer_idle_frac",
        "time/engine_idle_frac",
        "sync/seconds",
        "throughput/trained_tokens_per_s",
    ):
        assert key in records[-1], key  # fmt: skip
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == cfg.steps

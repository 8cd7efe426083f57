"""`megatron-rl train` as a user sees it: prefixed lines on the console, one per step with reward and ETA; the
engines', trainer's and third-party output in RUN_DIR/logs/; report.png written; evaluation every 2 steps and at
the end, its metrics in metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_rl.config import load_config
from megatron_rl.metrics.console import PREFIX
from megatron_rl.metrics.logger import is_step_record, read_metrics

pytestmark = pytest.mark.e2e

MAX_UNPREFIXED = 40
"""Console lines without our prefix allowed over a whole run (pip, torchrun and Ray start-up that escape us)."""


def test_train_console_shows_our_lines_and_logs_hold_the_rest(tmp_path):
    """One short run checks the console and the run folder, and (a launch costs a minute, so it is shared) the
    newer paths end to end: the reference model's KL subtracted from the rewards, GSPO with two mini-batches,
    an entropy bonus, dynamic sampling at the buffer (the trainer configures it), routing replay (the engine's
    routes in every policy forward), and two engines (a claim deals a step's prompts over both)."""
    steps = 4
    cmd = [
        sys.executable, "-m", "megatron_rl.cli", "train", "configs/quickstart.yaml", f"steps={steps}",
        f"output_dir={tmp_path}", f"model.hf_path={tmp_path}/tiny", "eval.interval=2", "eval.n=4",
        "eval.max_prompts=6", "eval.pass_threshold=0.5", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward",
        "algorithm.loss=gspo", "algorithm.ppo_minibatches=2", "algorithm.entropy_coef=0.01",
        "algorithm.dynamic_sampling=true", "algorithm.routing=replay", "rollout.num_engines=2",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [ln for ln in (result.stdout + result.stderr).splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith(PREFIX)]
    others = [ln for ln in lines if not ln.startswith(PREFIX)]
    assert len(others) <= MAX_UNPREFIXED, "\n".join(others)
    step_lines = [ln for ln in ours if ln.startswith(f"{PREFIX} step ")]
    assert [ln.split()[2] for ln in step_lines] == [f"{s}/{steps}" for s in range(1, steps + 1)], ours
    assert all("reward " in ln for ln in step_lines) and "ETA" in step_lines[-2]
    assert any("done:" in ln for ln in ours)
    run_dir = tmp_path / "quickstart"
    logs = run_dir / "logs"
    assert "Falling back to Torch" in (logs / "launcher.log").read_text()  # Megatron's warnings: not on the console
    assert "[step 1/" in (logs / "trainer.log").read_text()
    engine_log = (logs / "engine-0.log").read_text()
    assert "vLLM" in engine_log or "vllm" in engine_log
    assert (run_dir / "report.png").stat().st_size > 20_000
    records = read_metrics(run_dir / "metrics.jsonl")
    evaluated = [r["eval/version"] for r in records if "eval/version" in r]
    # At the first look past each multiple of 2 (tests/unit/test_eval_due.py), and the last step's waits for it.
    assert evaluated[-1] == steps and evaluated == sorted(set(evaluated)) and min(evaluated) >= 2, evaluated
    last = records[-1]
    assert last["eval/prompts"] == 6 and 0 <= last["eval/pass@1"] <= last["eval/pass@2"] <= last["eval/pass@4"] <= 1
    assert 0 <= last["eval/reward_mean"] <= 1 and "eval/mean@4" in last
    assert last["eval/version_min"] <= last["eval/version_max"] <= steps
    assert any(ln.startswith(f"{PREFIX} eval at version {steps}:") for ln in ours)
    _check_new_paths(run_dir, [r for r in records if is_step_record(r)], steps)


def _check_new_paths(run_dir, records: list[dict], steps: int) -> None:
    """KL in the reward, GSPO's two updates, the entropy bonus, dynamic sampling and routing replay, seen in the step
    records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    prompts_per_step = load_config("configs/quickstart.yaml").prompts_per_step
    assert len(records) == steps and summary["accounting"]["consumed"] == steps * prompts_per_step, summary
    # Both engines generated, and both hold the last version (each worker took what a claim dealt its engine).
    assert [(e["engine"], e["version"]) for e in summary["engines"]] == [("engine-0", steps), ("engine-1", steps)]
    assert all(e["requests"] > 0 for e in summary["engines"]), summary["engines"]
    for r in records:
        assert r["ppo/updates"] == 2 and r["guard/skipped_updates"] == 0
        assert r["kl/reward_penalty_mean"] != 0 and "kl/penalty" not in r
        assert r["loss/entropy_bonus"] > 0 and r["batch/zero_variance_frac"] == 0  # none reached the trainer
        assert 0.5 < r["routing/agreement"] <= 1.0, r["routing/agreement"]  # the routers' own choices vs the engine's
    # Step 1 trains on samples of version 0: the trainer's weights are the engine's, so its routers agree.
    assert records[0]["routing/agreement"] >= 0.99, records[0]["routing/agreement"]
    dropped = records[-1]["buffer/dropped_by_reason"].get("zero_variance", 0)
    assert dropped == records[-1]["dynamic/dropped"]

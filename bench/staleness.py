"""Benchmark: does bounded-staleness async training reach the same reward as sync? Prints one JSON object.

Runs the quickstart task for each of three settings and several seeds:
  - sync: generate with the current weights, then train (the on-policy baseline);
  - async + decoupled PPO + token TIS, max_staleness 4 (the recommended async setting);
  - async + plain PPO against the behaviour policy, no correction, max_staleness 4 (measured beside them).
Figures: the final reward (mean of the last 5 steps) per seed, their mean and std per setting, and the
difference of each async setting from sync in units of the seeds' standard error.

    .venv/bin/python bench/staleness.py [--seeds 0 1] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.launcher import run_training  # noqa: E402
from megatron_rl.metrics.logger import read_metrics  # noqa: E402

SETTINGS = {
    "sync": ["mode=sync"],
    "async_decoupled_tis": [
        "mode=async",
        "buffer.max_staleness=4",
        "algorithm.loss=decoupled_ppo",
        "algorithm.correction=tis",
    ],
    "async_ppo_uncorrected": [
        "mode=async",
        "buffer.max_staleness=4",
        "algorithm.loss=ppo",
        "algorithm.correction=none",
    ],
}


def final_reward(name: str, seed: int, steps: int, root: str) -> dict:
    """Run one setting with one seed; the mean reward of its last 5 steps and the step it first reached 0.9."""
    overrides = SETTINGS[name] + [f"steps={steps}", f"name={name}-{seed}", f"output_dir={root}",
                                  f"trainer.seed={seed}", f"task.seed={seed}", f"model.hf_path={root}/tiny-{seed}"]  # fmt: skip
    run_training(load_config("configs/quickstart.yaml", overrides))
    records = read_metrics(f"{root}/{name}-{seed}/metrics.jsonl")
    rewards = [r["reward/mean"] for r in records]
    reached = next((r["step"] for r in records if r["reward/mean"] >= 0.9), None)
    return {"final": statistics.mean(rewards[-5:]), "first_step_at_0.9": reached}


def main() -> None:
    """Run every setting for every seed and summarise."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="mrl-bench-stale-") as root:
        for name in SETTINGS:
            runs = [final_reward(name, seed, args.steps, root) for seed in args.seeds]
            finals = [r["final"] for r in runs]
            results[name] = {
                "final_per_seed": finals, "mean": statistics.mean(finals),
                "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                "first_step_at_0.9": [r["first_step_at_0.9"] for r in runs],
            }  # fmt: skip
    base = results["sync"]
    for name in ("async_decoupled_tis", "async_ppo_uncorrected"):
        spread = max(1e-3, (base["std"] ** 2 + results[name]["std"] ** 2) ** 0.5 / max(1, len(args.seeds)) ** 0.5)
        results[name]["diff_from_sync_in_se"] = (results[name]["mean"] - base["mean"]) / spread
    print(json.dumps({"seeds": args.seeds, "steps": args.steps, **results}))


if __name__ == "__main__":
    main()

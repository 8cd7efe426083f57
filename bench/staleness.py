"""Benchmark: which off-policy correction holds up when every sample is several versions old? One JSON object.

Runs the quickstart task for each setting and several seeds:
  - sync: generate with the current weights, then train (the on-policy baseline);
  - at a forced lag of k = 4 and 8 versions (`algorithm.forced_lag`: sync mode, the engines always generate with
    the weights of version v - k while the trainer is at v, so every sample is exactly k versions old):
    decoupled PPO + token TIS, decoupled PPO + token MIS, decoupled PPO + sequence-level IS (`seq_tis`, the
    product of token ratios), and GSPO + token TIS.
Figures: the final reward (mean of the last 5 steps) per seed, their mean and std per setting, the first step
whose reward reached 0.9, and the difference of each lagged setting from sync in units of the seeds' standard
error.

    .venv/bin/python bench/staleness.py [--seeds 0 1] [--steps 40] [--lags 4 8]
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

CORRECTIONS = {
    "decoupled_tis": ["algorithm.loss=decoupled_ppo", "algorithm.correction=tis"],
    "decoupled_mis": ["algorithm.loss=decoupled_ppo", "algorithm.correction=mis"],
    "decoupled_seq_is": ["algorithm.loss=decoupled_ppo", "algorithm.correction=seq_tis"],
    "gspo_tis": ["algorithm.loss=gspo", "algorithm.correction=tis", "algorithm.loss_agg=seq_mean"],
}


def settings(lags: list[int]) -> dict[str, list[str]]:
    """Every setting's overrides: sync, then each correction at each forced lag."""
    out = {"sync": ["mode=sync"]}
    for lag in lags:
        for name, overrides in CORRECTIONS.items():
            out[f"lag{lag}_{name}"] = [
                "mode=sync",
                f"algorithm.forced_lag={lag}",
                f"buffer.max_staleness={lag}",
                *overrides,
            ]
    return out


def final_reward(name: str, overrides: list[str], seed: int, steps: int, root: str) -> dict:
    """Run one setting with one seed; the mean reward of its last 5 steps, the step it first reached 0.9, and
    the staleness its batches had (mean over steps)."""
    overrides = overrides + [f"steps={steps}", f"name={name}-{seed}", f"output_dir={root}",
                             f"trainer.seed={seed}", f"task.seed={seed}", f"model.hf_path={root}/tiny-{seed}"]  # fmt: skip
    run_training(load_config("configs/quickstart.yaml", overrides))
    records = read_metrics(f"{root}/{name}-{seed}/metrics.jsonl")
    rewards = [r["reward/mean"] for r in records]
    reached = next((r["step"] for r in records if r["reward/mean"] >= 0.9), None)
    staleness = statistics.mean(r["staleness/mean"] for r in records)
    return {"final": statistics.mean(rewards[-5:]), "first_step_at_0.9": reached, "staleness": staleness}


def main() -> None:
    """Run every setting for every seed and summarise."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lags", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="mrl-bench-stale-") as root:
        for name, overrides in settings(args.lags).items():
            runs = [final_reward(name, overrides, seed, args.steps, root) for seed in args.seeds]
            finals = [r["final"] for r in runs]
            results[name] = {
                "final_per_seed": finals, "mean": statistics.mean(finals),
                "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                "first_step_at_0.9": [r["first_step_at_0.9"] for r in runs],
                "mean_staleness": statistics.mean(r["staleness"] for r in runs),
            }  # fmt: skip
    base = results["sync"]
    for name, result in results.items():
        if name == "sync":
            continue
        spread = max(1e-3, (base["std"] ** 2 + result["std"] ** 2) ** 0.5 / max(1, len(args.seeds)) ** 0.5)
        result["diff_from_sync_in_se"] = (result["mean"] - base["mean"]) / spread
    print(json.dumps({"seeds": args.seeds, "steps": args.steps, "lags": args.lags, **results}))


if __name__ == "__main__":
    main()

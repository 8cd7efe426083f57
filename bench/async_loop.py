"""Benchmark: tokens trained per second in `sync` and `async` mode on the same config and machine, with the
trainer and the engine pinned to different cores. Prints one JSON object with `speedup` (goal >= 1.5) and both
idle fractions.

    .venv/bin/python bench/async_loop.py [--steps 20] [--model tiny|compute]

`--model compute` trains a 4-layer hidden-512 Qwen3-MoE (`bench/train_step.py`'s `compute` size), where the
matmuls, not per-step overhead, take the time; `tiny` (default) is the quickstart's own model.

Throughput counts the steady state: trained response tokens of steps 3..N over the wall time between the end
of step 2 and the end of step N (start-up and the first fills are excluded in both modes alike).
"""

from __future__ import annotations

import argparse
import json
import tempfile

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.launcher import run_training  # noqa: E402
from megatron_rl.metrics.logger import read_metrics  # noqa: E402
from megatron_rl.models.tiny import make_tiny  # noqa: E402

COMPUTE = {"num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64}  # fmt: skip
"""The compute-bound size (as `bench/train_step.py`'s `compute` workload)."""


def run(mode: str, steps: int, root: str, max_new_tokens: int) -> dict:
    """One run of the quickstart task at layout 1x1x1, trainer on core 0 and engine on core 1."""
    cfg = load_config(
        "configs/quickstart.yaml",
        [f"mode={mode}", f"steps={steps}", f"name={mode}", f"output_dir={root}", f"model.hf_path={root}/tiny",
         "trainer.parallel.ep=1", "trainer.cpu_affinity=[0]", "rollout.cpu_affinity=[1]",
         f"rollout.max_new_tokens={max_new_tokens}"],
    )  # fmt: skip
    run_training(cfg)
    records = read_metrics(f"{root}/{mode}/metrics.jsonl")
    steady = records[2:]
    wall = records[-1]["wall_s"] - records[1]["wall_s"]
    tokens = sum(r["rollout/tokens"] for r in steady)
    return {
        "tokens_per_s": tokens / wall,
        "trainer_idle_frac": sum(r["time/trainer_idle_frac"] for r in steady) / len(steady),
        "engine_idle_frac": sum(r["time/engine_idle_frac"] for r in steady) / len(steady),
        "reward_last": records[-1]["reward/mean"],
        "step_s": wall / len(steady),
    }


def main() -> None:
    """Run both modes and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="response length (generation share of a step)")
    parser.add_argument("--model", choices=("tiny", "compute"), default="tiny")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mrl-bench-async-") as root:
        if args.model == "compute":  # made here: the config's make_tiny makes the quickstart's own size
            make_tiny("qwen3_moe", f"{root}/tiny", seed=0, overrides=COMPUTE)
        sync = run("sync", args.steps, root, args.max_new_tokens)
        async_ = run("async", args.steps, root, args.max_new_tokens)
    print(json.dumps({
        "steps": args.steps, "model": args.model, "max_new_tokens": args.max_new_tokens, "layout": "tp1-pp1-ep1", "trainer_cores": [0], "engine_cores": [1],
        "sync_tokens_per_s": round(sync["tokens_per_s"], 1), "async_tokens_per_s": round(async_["tokens_per_s"], 1),
        "speedup": round(async_["tokens_per_s"] / sync["tokens_per_s"], 3), "goal_speedup": 1.5,
        "sync": sync, "async": async_,
    }))  # fmt: skip


if __name__ == "__main__":
    main()

"""Benchmark: the quickstart with generation always `max_staleness` steps ahead (`buffer.lookahead=max`) against
just in time (`adaptive`, the default). Prints one JSON object: each run's mean staleness, trained tokens/s and
trainer idle fraction over the steady state, and the ratio of tokens/s (goal: staleness <= 1.5 at >= 0.9 of the
tokens/s).

    .venv/bin/python bench/lookahead.py [--steps 40] [--rounds 1]

The runs alternate (max, adaptive, max, ...) so that the machine's drift falls on both alike. The steady state
is steps 6..N: the adaptive lookahead starts one step ahead and needs a few batches to find its level.
"""

from __future__ import annotations

import json
import statistics

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from _rounds import alternate, rounds_parser, steady_state  # noqa: E402

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.launcher import run_training  # noqa: E402

SKIP = 5  # start-up steps left out of the steady state


def run(lookahead: str, steps: int, root: str, name: str) -> dict:
    """One quickstart run (its own layout and settings) with the given lookahead; its steady-state figures."""
    cfg = load_config(
        "configs/quickstart.yaml",
        [f"buffer.lookahead={lookahead}", f"steps={steps}", f"name={name}", f"output_dir={root}",
         f"model.hf_path={root}/tiny"],
    )  # fmt: skip
    run_training(cfg)
    steady, wall = steady_state(f"{root}/{name}/metrics.jsonl", SKIP)
    return {
        "tokens_per_s": sum(r["rollout/tokens"] for r in steady) / wall,
        "mean_staleness": statistics.mean(r["staleness/mean"] for r in steady),
        "trainer_idle_frac": statistics.mean(r["time/trainer_idle_frac"] for r in steady),
        # `max` logs no lookahead (it is fixed): its bound stands in, so that both runs report a number.
        "lookahead_prompts_mean": statistics.mean(
            r.get("buffer/lookahead", cfg.buffer.max_staleness * cfg.prompts_per_step) for r in steady
        ),
        "reward_last": steady[-1]["reward/mean"],
    }


def main() -> None:
    """Run both lookaheads `--rounds` times each, alternating, and print the comparison."""
    args = rounds_parser(__doc__, 40).parse_args()
    mean = alternate(("max", "adaptive"), args.rounds, "mrl-bench-lookahead-",
                     lambda mode, root, name: run(mode, args.steps, root, name))  # fmt: skip
    ratio = mean["adaptive"]["tokens_per_s"] / mean["max"]["tokens_per_s"]
    print(json.dumps({
        "config": "configs/quickstart.yaml", "steps": args.steps, "rounds": args.rounds, "steady_from_step": SKIP + 1,
        "max": {k: round(v, 4) for k, v in mean["max"].items()},
        "adaptive": {k: round(v, 4) for k, v in mean["adaptive"].items()},
        "tokens_per_s_ratio": round(ratio, 3),
        "goal": "adaptive mean_staleness <= 1.5 and tokens_per_s_ratio >= 0.9",
        "goal_met": mean["adaptive"]["mean_staleness"] <= 1.5 and ratio >= 0.9,
    }))  # fmt: skip


if __name__ == "__main__":
    main()

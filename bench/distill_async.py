"""Benchmark: on-policy distillation's trained tokens/s in async mode against sync (generate, score, then train).
Prints one JSON object: each mode's trained tokens/s, trainer idle fraction, teacher idle fraction and mean
staleness over the steady state, and the ratio async / sync.

    .venv/bin/python bench/distill_async.py [--steps 16] [--rounds 1]

The setting is configs/distill_quickstart.yaml's (a tiny Qwen3-MoE student, one student engine, one teacher
engine, pure distillation), with a teacher of its own that needs no earlier run: another random tiny Qwen3-MoE
(`make-tiny` with another seed: the same tokenizer, other weights), so the KL is large and the student learns.
The runs alternate (sync, async, sync, ...) so that the machine's drift falls on both alike; steps 1..SKIP
(start-up) are left out.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from megatron_rl.rollout.ray_env import prefer_loopback_ray

prefer_loopback_ray()  # a local Ray on loopback only: before anything below imports ray

from _rounds import alternate, rounds_parser, steady_state  # noqa: E402

from megatron_rl.config import load_config  # noqa: E402
from megatron_rl.launcher import run_training  # noqa: E402
from megatron_rl.metrics.logger import read_metrics  # noqa: E402
from megatron_rl.models.tiny import make_tiny  # noqa: E402

SKIP = 3  # start-up steps left out of the steady state
CONFIG = "configs/distill_quickstart.yaml"


def run(mode: str, steps: int, root: str, name: str, teacher: Path) -> dict:
    """One distillation run in `mode`; its steady-state figures."""
    cfg = load_config(
        CONFIG,
        [f"mode={mode}", f"steps={steps}", f"name={name}", f"output_dir={root}", f"model.hf_path={root}/tiny",
         f"distill.teacher_path={teacher}", "checkpoint.export_final=false"],
    )  # fmt: skip
    run_training(cfg)
    steady, wall = steady_state(f"{root}/{name}/metrics.jsonl", SKIP)
    records = read_metrics(f"{root}/{name}/metrics.jsonl")
    return {
        "trained_tokens_per_s": sum(r["rollout/tokens"] for r in steady) / wall,
        "trainer_idle_frac": statistics.mean(r["time/trainer_idle_frac"] for r in steady),
        "teacher_idle_frac": statistics.mean(r["distill/teacher_idle_frac"] for r in steady),
        "mean_staleness": statistics.mean(r["staleness/mean"] for r in steady),
        "reverse_kl_first": records[0]["distill/reverse_kl"],
        "reverse_kl_last": records[-1]["distill/reverse_kl"],
    }


def main() -> None:
    """Run both modes `--rounds` times each, alternating, and print the comparison."""
    parser = rounds_parser(__doc__, 16)
    args = parser.parse_args()
    if args.steps <= SKIP + 1:
        parser.error(f"--steps must be above {SKIP + 1} (the first {SKIP} are start-up)")

    def run_mode(mode: str, root: str, name: str) -> dict:
        teacher = Path(root) / "teacher"
        if not teacher.exists():
            make_tiny("qwen3_moe", teacher, seed=7)
        return run(mode, args.steps, root, name, teacher)

    mean = alternate(("sync", "async"), args.rounds, "mrl-bench-distill-", run_mode)
    ratio = mean["async"]["trained_tokens_per_s"] / mean["sync"]["trained_tokens_per_s"]
    print(json.dumps({
        "config": CONFIG, "steps": args.steps, "rounds": args.rounds, "steady_from_step": SKIP + 1,
        "sync": {k: round(v, 4) for k, v in mean["sync"].items()},
        "async": {k: round(v, 4) for k, v in mean["async"].items()},
        "trained_tokens_per_s_ratio": round(ratio, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()

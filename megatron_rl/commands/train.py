"""`megatron-rl train CONFIG [overrides]`: run RL from a YAML config (see configs/quickstart.yaml)."""

from __future__ import annotations

import argparse

from megatron_rl.commands.args import add_json_flag
from megatron_rl.config import load_config
from megatron_rl.metrics.console import Console, ThirdPartyOutput


def add_parser(sub) -> None:
    """Register `train`."""
    p = sub.add_parser("train", help="run asynchronous RL from a YAML config (see configs/quickstart.yaml)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as steps=5 trainer.parallel.ep=2")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in checkpoint.save_dir, if any (checkpoint.resume_step=N: step N's)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier run of the same name (its metrics and config)"
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--external-trainer", action="store_true",
        help="write <run_dir>/trainer_spec.json and wait for a trainer started elsewhere "
        "(torchrun -m megatron_rl.trainer.loop SPEC; see launch/)",
    )  # fmt: skip
    p.add_argument(
        "--verbose", action="store_true", help="show vLLM's, Ray's and Megatron's output on the console as well"
    )
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict | None:
    """Run the job; print the headline of its summary (or return it for --json)."""
    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    console = Console()
    output = ThirdPartyOutput(console, verbose=args.verbose)  # before the imports below, which already warn
    from megatron_rl.launcher import run_training  # Ray, torch, vLLM's engine actors: not for --help

    summary = run_training(
        cfg,
        ray_address=args.ray_address,
        external_trainer=args.external_trainer,
        console=console,
        output=output,
        overwrite=args.overwrite,
    )
    keys = ("run_dir", "mode", "steps", "wall_seconds", "reward_first", "reward_last", "reward_best")
    headline = {k: summary[k] for k in keys} | {"accounting": summary["accounting"]}
    if args.json:
        return headline
    console.say("done: " + ", ".join(f"{k} {v}" for k, v in headline.items() if k != "accounting"))
    console.say(f"accounting: {headline['accounting']}")
    return None

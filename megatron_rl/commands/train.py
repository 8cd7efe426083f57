"""`megatron-rl train CONFIG [overrides]`: run RL from a YAML config (see configs/quickstart.yaml)."""

from __future__ import annotations

import argparse

from megatron_rl.commands.layout_args import add_json_flag
from megatron_rl.config import load_config


def add_parser(sub) -> None:
    """Register `train`."""
    p = sub.add_parser("train", help="run asynchronous RL from a YAML config (see configs/quickstart.yaml)")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as steps=5 trainer.parallel.ep=2")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in checkpoint.save_dir, if any"
    )
    p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--external-trainer", action="store_true",
        help="write <run_dir>/trainer_spec.json and wait for a trainer started elsewhere "
        "(torchrun -m megatron_rl.trainer.loop SPEC; see launch/)",
    )  # fmt: skip
    add_json_flag(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> dict:
    """Run the job; returns the headline of its summary."""
    from megatron_rl.launcher import run_training  # Ray, torch, vLLM's engine actors: not for --help

    overrides = list(args.overrides) + (["checkpoint.resume=true"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    summary = run_training(cfg, ray_address=args.ray_address, external_trainer=args.external_trainer)
    keys = ("run_dir", "mode", "steps", "wall_seconds", "reward_first", "reward_last", "reward_best")
    return {k: summary[k] for k in keys} | {"accounting": summary["accounting"]}
